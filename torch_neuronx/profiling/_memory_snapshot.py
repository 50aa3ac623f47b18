"""A memory snapshot in the format of PyTorch's memory viewer (torch.cuda._memory_viz,
pytorch.org/memory_viz) from an exported profile's DeviceMemory table, as torch's
``_memory_viz.profile_plot`` builds one from a profile's memory events.

The table has the allocator's block sizes and addresses but no requested sizes, streams or
stacks: each event's frame is the innermost host op running when it happened (its source line
when the profile had ``with_stack=True``)."""
from __future__ import annotations

import os
import pickle
import re

import numpy as np
import pyarrow.parquet as pq

SNAPSHOT_FILE = "memory_snapshot.pickle"


def snapshot(path: str) -> dict | None:
    """The snapshot of the profile in ``path``, or None when it recorded no memory."""
    f = os.path.join(path, "DeviceMemory.parquet")
    if not os.path.exists(f):  # traces exported before schema 1.2.0
        return None
    m = pq.read_table(f).to_pandas()
    if m.empty:
        return None
    ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet")).to_pandas()
    frames = _op_frames(ev[ev.source == "framework"], m.time_ns.to_numpy())
    traces = [[] for _ in range(int(m.device.max()) + 1)]
    live = {}
    for row, fr in zip(m.itertuples(index=False), frames):
        d, addr, size, t = int(row.device), int(row.addr), int(row.bytes), int(row.time_ns) // 1000
        entry = {"addr": addr, "size": abs(size), "stream": 0, "time_us": t, "frames": fr}
        if size > 0:
            traces[d].append({"action": "alloc", **entry})
            live[(d, addr)] = (size, fr)
        else:
            # The allocator takes a block back at once (reuse is stream-ordered).
            traces[d].append({"action": "free_requested", **entry})
            traces[d].append({"action": "free_completed", **entry})
            live.pop((d, addr), None)
    segments = []
    for (d, addr), (size, fr) in sorted(live.items()):
        block = {"address": addr, "size": size, "requested_size": size,
                 "state": "active_allocated", "frames": fr}
        segments.append({"device": d, "address": addr, "total_size": size,
                         "allocated_size": size, "active_size": size, "requested_size": size,
                         "stream": 0, "segment_type": "small" if size <= 1 << 20 else "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": fr,
                         "blocks": [block]})
    return {"segments": segments, "device_traces": traces}


def write(path: str, out_dir: str) -> str | None:
    """Write ``memory_snapshot.pickle`` into ``out_dir``; its path, or None without memory."""
    s = snapshot(path)
    if s is None:
        return None
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, SNAPSHOT_FILE)
    with open(out, "wb") as f:
        pickle.dump(s, f)
    return out


# torch.profiler's names of Python-function events (with_stack=True): "file.py(12): f",
# "<built-in method ...>". They are not ops: the frame names the op that allocated.
_PY_EVENT = re.compile(r"\(\d+\): |^<built-in ")


# Memory events and op events come from two clocks, reconciled through matched ops
# (_parquet._trace_origin): an event that lands outside every op by less than this is the
# nearest op's (an allocation happens inside an op; a miss of that size is the clocks').
_NEAREST_NS = 1_000_000


def _op_frames(ops, times: np.ndarray) -> list:
    """Per time: [frame of the innermost host op running then] (of the nearest op within
    _NEAREST_NS when none runs then; [] beyond)."""
    ops = ops[(ops.duration_ns >= 0) & ~ops.name.str.contains(_PY_EVENT)].sort_values("start_ns")
    start = ops.start_ns.to_numpy()
    end = start + ops.duration_ns.to_numpy()
    # Ops before index j end no later than reach[j]: the walk back stops there.
    reach = np.maximum.accumulate(end) if len(end) else end
    names, files, lines = ops.name.to_numpy(), ops.source_file.to_numpy(), ops.source_line.to_numpy()
    def frame(j):
        has_line = lines[j] >= 0
        return [{"filename": files[j] if has_line else "<host op>",
                 "line": int(lines[j]) if has_line else 0, "name": names[j]}]
    out = []
    for t in times:
        j = int(np.searchsorted(start, t, side="right")) - 1
        found = None
        # The innermost op running at t is the latest-starting one still running.
        while j >= 0 and reach[j] >= t:
            if end[j] >= t:
                found = j
                break
            j -= 1
        if found is None and len(start):
            gap = np.maximum(start - t, t - end)   # distance to each op's interval
            k = int(np.argmin(gap))
            found = k if gap[k] <= _NEAREST_NS else None
        out.append(frame(found) if found is not None else [])
    return out
