"""Per-engine instruction lanes of NKI kernels and compiled graphs: while a
``NeuronProfiler`` collects, the NKI bridge and compile/cost.py hand each kernel's (graph's)
simulator timeline events here (the Timeline the latency came
from; nothing is re-simulated). Nothing is kept when no profiler collects."""
from __future__ import annotations

from nki.simulator.trace import lane_index, lane_label

# Instruction rows kept per kernel, so one large kernel does not flood the trace.
MAX_INSTRUCTIONS_PER_KERNEL = 2000

_collectors: list = []  # one list per collecting NeuronProfiler

def _capture(device: int, name: str, event_lists) -> None:
    """``event_lists``: one Timeline's ``events`` per core of the kernel (or graph)."""
    rows = []
    for core, events in enumerate(event_lists):
        for ev_name, lane, start, dur, _args in events:
            if len(rows) >= MAX_INSTRUCTIONS_PER_KERNEL:
                break
            rows.append((core, lane, ev_name, start, dur))
    kernel = (device, name, rows)
    for c in _collectors:
        c.append(kernel)


def _trace_events(hw_rows, kernels, origin_us: float) -> tuple:
    """Chrome events of each kernel's instructions, nested in its modelled interval (the
    n-th ``nki``/``fused`` hardware row of (device, name) takes the n-th captured kernel of that pair),
    their lanes, and their DeviceInstructions rows."""
    pending: dict = {}
    for device, name, rows in kernels:
        pending.setdefault((device, name), []).append(rows)
    events, lanes, rows_out = [], set(), []
    for d, name, start_ns, corr in hw_rows:
        got = pending.get((d, name))
        if not got:
            continue
        rows = got.pop(0)
        for core, lane, ev_name, s, dur in rows:
            label = lane_label(lane) + (f" (core {core})" if core else "")
            tid = 2000 + 100 * core + lane_index(lane)
            lanes.add((d, tid, label))
            events.append({"ph": "X", "cat": "modelled_instruction", "name": ev_name,
                           "pid": 1000 + d, "tid": tid, "ts": origin_us + (start_ns + s) / 1e3,
                           "dur": dur / 1e3,
                           "args": {"kernel": name, "engine": label, "External id": corr}})
            rows_out.append((corr, d, name, label, ev_name, round(start_ns + s), round(dur)))
    return events, lanes, rows_out

