"""Perfetto / Chrome trace export of a modelled instruction timeline."""
from __future__ import annotations

import json

_LANES = ["tensor", "vector", "scalar", "gpsimd"]
_LABEL = {"tensor": "TensorE", "vector": "VectorE", "scalar": "ScalarE", "gpsimd": "GpSimd"}


def _tid(lane: str) -> int:
    if lane in _LANES:
        return _LANES.index(lane) + 1
    return 10 + int(lane[3:])          # dmaN


def chrome_trace(timelines, kernel_name: str, target: str) -> dict:
    events = []
    for tl in timelines:
        pid = tl.core
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"{kernel_name} ({target}, core {pid})"}})
        lanes = sorted({e[1] for e in tl.events}, key=_tid)
        for lane in lanes:
            label = _LABEL.get(lane, f"DMA queue {lane[3:]}")
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _tid(lane),
                           "args": {"name": label}})
        for name, lane, start, dur, args in tl.events:
            ev = {"ph": "X", "name": name, "pid": pid, "tid": _tid(lane),
                  "ts": start / 1000.0, "dur": max(dur, 1e-3) / 1000.0, "cat": lane}
            if args:
                ev["args"] = args
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def save(trace: dict, path: str):
    with open(path, "w") as f:
        json.dump(trace, f)
