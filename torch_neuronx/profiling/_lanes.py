"""Per-engine instruction lanes of NKI kernels and compiled graphs: while a
``NeuronProfiler`` collects, the NKI bridge and compile/cost.py hand each kernel's (graph's)
simulator timeline events here (the Timeline the latency came
from; nothing is re-simulated). Nothing is kept when no profiler collects, and only then does
the simulator record each instruction's kernel source line."""
from __future__ import annotations

from nki.simulator import context as _sim_context
from nki.simulator.trace import instruction_lanes, lane_index, lane_label

# Instruction rows kept per kernel, so one large kernel does not flood the trace.
MAX_INSTRUCTIONS_PER_KERNEL = 2000

_collectors: list = []  # one list per collecting NeuronProfiler


def _start(kernels: list) -> None:
    _collectors.append(kernels)
    _sim_context.record_source = True


def _stop(kernels: list) -> None:
    if kernels in _collectors:
        _collectors.remove(kernels)
    _sim_context.record_source = bool(_collectors)

# Thread of the program intervals of compiled graphs that call extern kernels.
_PROGRAM_TID = 1999


def _capture(device: int, name: str, event_lists, program_ns: float = 0.0) -> None:
    """``event_lists``: one Timeline's ``events`` per core of the kernel (or graph).
    ``program_ns``: the program's modelled time when its kernel interval holds only part of
    it (a compiled graph whose extern calls the eager runtime charges as kernels of their own)."""
    rows, n = [], 0
    for core, events in enumerate(event_lists):
        for ev_name, lane, start, dur, args in events:
            if n >= MAX_INSTRUCTIONS_PER_KERNEL:
                break
            n += 1
            where = (args["source_file"], args["source_line"]) if args and "source_file" in args \
                else ("", -1)
            for q in instruction_lanes(lane, args):
                rows.append((core, q, ev_name, start, dur, where))
    kernel = (device, name, rows, program_ns)
    for c in _collectors:
        c.append(kernel)


def _trace_events(hw_rows, kernels, origin_us: float) -> tuple:
    """Chrome events of each kernel's instructions, nested in its modelled interval (the
    n-th ``nki``/``fused`` hardware row of (device, name) takes the n-th captured kernel of
    that pair; a program longer than its row gets a ``modelled_program`` interval from the
    row's start that holds them), their lanes, and their DeviceInstructions rows."""
    pending: dict = {}
    for device, name, rows, program_ns in kernels:
        pending.setdefault((device, name), []).append((rows, program_ns))
    events, lanes, rows_out = [], set(), []
    for event_id, d, name, start_ns, modelled_ns, corr in hw_rows:
        got = pending.get((d, name))
        if not got:
            continue
        rows, program_ns = got.pop(0)
        span = round(program_ns) if program_ns else modelled_ns
        if program_ns:
            lanes.add((d, _PROGRAM_TID, "compiled_graph programs"))
            events.append({"ph": "X", "cat": "modelled_program", "name": f"{name} program",
                           "pid": 1000 + d, "tid": _PROGRAM_TID, "ts": origin_us + start_ns / 1e3,
                           "dur": program_ns / 1e3,
                           "args": {"kernel": name, "modelled_ns": round(program_ns),
                                    "External id": corr}})
        for core, lane, ev_name, s, dur, (file, line) in rows:
            label = lane_label(lane) + (f" (core {core})" if core else "")
            tid = 2000 + 100 * core + lane_index(lane)
            lanes.add((d, tid, label))
            args = {"kernel": name, "engine": label, "External id": corr}
            if line >= 0:
                args["source"] = f"{file}:{line}"
            events.append({"ph": "X", "cat": "modelled_instruction", "name": ev_name,
                           "pid": 1000 + d, "tid": tid, "ts": origin_us + (start_ns + s) / 1e3,
                           "dur": dur / 1e3, "args": args})
            rows_out.append((corr, event_id, d, name, label, ev_name, round(start_ns + s),
                             round(dur), span, file, line))
    return events, lanes, rows_out
