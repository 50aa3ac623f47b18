"""Perfetto / Chrome trace export of a modelled instruction timeline, and the engine lanes'
names and order, which torch_neuronx's profiler lanes share."""
from __future__ import annotations

import json

ENGINE_LANES = ("tensor", "vector", "scalar", "gpsimd")
ENGINE_LABELS = {"tensor": "TensorE", "vector": "VectorE", "scalar": "ScalarE", "gpsimd": "GpSimd"}


def lane_label(lane: str) -> str:
    """AWS's engine names; DMA queue ``dmaN`` -> ``DMA queue N``."""
    label = ENGINE_LABELS.get(lane)
    return label if label is not None else f"DMA queue {lane[3:]}"


def lane_index(lane: str) -> int:
    """Lane order: the four engines, then DMA queues by number."""
    if lane in ENGINE_LANES:
        return ENGINE_LANES.index(lane) + 1
    return 10 + int(lane[3:])          # dmaN


def instruction_lanes(lane: str, args) -> list:
    """Every lane an instruction occupies: a DMA spread over several queues
    (``args["queues"]``, from ``Timeline.dma``) holds each of them for its whole interval."""
    if args and "queues" in args:
        return [f"dma{q}" for q in args["queues"]]
    return [lane]


def chrome_trace(timelines, kernel_name: str, target: str) -> dict:
    events = []
    for tl in timelines:
        pid = tl.core
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"{kernel_name} ({target}, core {pid})"}})
        lanes = sorted({q for e in tl.events for q in instruction_lanes(e[1], e[4])}, key=lane_index)
        for lane in lanes:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane_index(lane),
                           "args": {"name": lane_label(lane)}})
        for name, lane, start, dur, args in tl.events:
            for q in instruction_lanes(lane, args):
                ev = {"ph": "X", "name": name, "pid": pid, "tid": lane_index(q),
                      "ts": start / 1000.0, "dur": max(dur, 1e-3) / 1000.0, "cat": q}
                if args:
                    ev["args"] = args
                events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def save(trace: dict, path: str):
    with open(path, "w") as f:
        json.dump(trace, f)
