"""A memory snapshot in the format of PyTorch's memory viewer (torch.cuda._memory_viz,
pytorch.org/memory_viz) from an exported profile's DeviceMemory table, as torch's
``_memory_viz.profile_plot`` builds one from a profile's memory events.

The table has the allocator's block sizes and addresses but no requested sizes, streams or
stacks: each event's frame is the innermost op it happened in (its ``correlation_id``), with
that op's source line when the profile had ``with_stack=True``."""
from __future__ import annotations

import os
import pickle
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
    if "correlation_id" in m:
        frames = _op_frames(ev[ev.source == "framework"], m.correlation_id.to_numpy())
    else:  # exported before schema 1.4.0: the events are not linked to ops
        frames = [[]] * len(m)
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


def _op_frames(ops, corr) -> list:
    """Per memory event: [frame of the op it happened in], [] outside every op."""
    by_id = {int(c): (n, f, ln) for c, n, f, ln in zip(ops.correlation_id, ops.name,
                                                          ops.source_file, ops.source_line)}
    out = []
    for c in corr:
        op = by_id.get(int(c))
        if op is None:
            out.append([])
            continue
        name, file, line = op
        out.append([{"filename": file if line >= 0 else "<host op>",
                     "line": int(line) if line >= 0 else 0, "name": name}])
    return out
