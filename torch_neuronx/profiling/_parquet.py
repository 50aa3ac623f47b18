"""Parquet export: one ``<Table>.parquet`` per table, built column by column (a list per
column, one pyarrow array each) because per-row dicts made 20k events take seconds."""
from __future__ import annotations

import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch.autograd import DeviceType

PROFILE_SCHEMA_VERSION = "1.7.0"

# The Kineto plugin's host-side event for each kernel (csrc/profiler/kineto_plugin.cpp).
RUNTIME_EVENT = "neuronLaunchKernel"

# (column, arrow type, description): the SchemaFields table is written from this.
SCHEMA = {
    "SystemProfileEvents": [
        ("event_id", pa.int64(), "row number, unique within the trace"),
        ("source", pa.string(), "framework (torch.profiler op), runtime (the launch of a kernel on the host) or hardware (a device kernel)"),
        ("name", pa.string(), "op or kernel name"),
        ("device", pa.int32(), "neuron device index; -1 for framework and runtime events"),
        ("queue", pa.int32(), "device queue (stream) of a hardware event; -1 otherwise"),
        ("engine", pa.string(), "engine of a hardware event's modelled time (tensor, vector, scalar, dma, fused, nki, collective); empty otherwise"),
        ("start_ns", pa.int64(), "start, ns since the trace's first framework event; -1 for a hardware event not traced by the Kineto plugin"),
        ("duration_ns", pa.int64(), "host execution time (of the op, the launch, or the kernel on its queue's executor); -1 when not traced"),
        ("modelled_start_ns", pa.int64(), "hardware events: start on the modelled Trainium timeline (each queue's kernels back to back from 0); -1 otherwise"),
        ("modelled_ns", pa.int64(), "modelled Trainium time of a hardware event; 0 otherwise"),
        ("flops", pa.int64(), "hardware events traced by the Kineto plugin: floating-point operations the cost model counts (TensorE work); 0 otherwise"),
        ("hbm_bytes", pa.int64(), "hardware events traced by the Kineto plugin: HBM bytes read and written; 0 otherwise"),
        ("launches", pa.int32(), "kernel launches the hardware event covers (1 when traced; batched repeats otherwise); 0 for others"),
        ("link_bytes", pa.int64(), "collectives traced by the Kineto plugin (engine collective): bytes over the interconnect, as the collective model priced them; 0 otherwise"),
        ("group_size", pa.int32(), "collectives traced by the Kineto plugin: ranks in the process group; 0 otherwise"),
        ("nodes", pa.int32(), "collectives traced by the Kineto plugin: nodes the group spans; 0 otherwise"),
        ("correlation_id", pa.int64(), "torch.profiler's id of the op: its own for framework events, the launching op's for runtime and hardware events; -1 when unknown"),
        ("source_file", pa.string(), "Python file of the innermost user frame of the op (of the launching op for runtime and hardware events; with_stack=True)"),
        ("source_line", pa.int32(), "line in source_file; -1 when unknown"),
    ],
    "DeviceMemory": [
        ("time_ns", pa.int64(), "when the neuron caching allocator handed out or took back a block (profile_memory=True), ns on start_ns's clock"),
        ("device", pa.int32(), "neuron device index"),
        ("addr", pa.int64(), "block address"),
        ("bytes", pa.int64(), "block size: positive for an allocation, negative for a free"),
        ("total_allocated", pa.int64(), "bytes allocated on the device after this event (the allocator's allocated_bytes.all.current)"),
        ("total_reserved", pa.int64(), "bytes the allocator holds from the device after this event (reserved_bytes.all.current)"),
        ("correlation_id", pa.int64(), "correlation_id of the innermost framework event (op) the allocation or free happened in; -1 outside every op (e.g. a Python del) or on a device queue's thread"),
    ],
    "DeviceInstructions": [
        ("correlation_id", pa.int64(), "correlation_id of the kernel's hardware event in SystemProfileEvents"),
        ("kernel_event_id", pa.int64(), "event_id of the kernel's hardware event in SystemProfileEvents (unique also when uncorrelated)"),
        ("device", pa.int32(), "neuron device index"),
        ("kernel", pa.string(), "kernel name (nki:<function>, compiled_graph)"),
        ("engine", pa.string(), "TensorE, VectorE, ScalarE, GpSimd or DMA queue N (suffixed ' (core N)' past a kernel's first core)"),
        ("name", pa.string(), "ISA instruction name"),
        ("start_ns", pa.int64(), "start on the modelled Trainium timeline (modelled_start_ns's clock)"),
        ("duration_ns", pa.int64(), "modelled duration"),
        ("program_ns", pa.int64(), "modelled time of the program the instruction ran in, from the kernel's modelled start: the kernel's modelled_ns, or for a compiled graph that calls extern kernels the whole program's (its extern calls are eager kernels of their own, so it spans past the graph's event)"),
        ("source_file", pa.string(), "NKI kernels: file of the kernel line that issued the instruction (innermost frame outside nki's own modules); empty otherwise"),
        ("source_line", pa.int32(), "line in source_file; -1 when unknown (compiled graphs' instructions)"),
    ],
    "Metadata": [
        ("key", pa.string(), "metadata key (profile_schema_version, event counts, hardware_source)"),
        ("value", pa.string(), "metadata value"),
    ],
    "SchemaFields": [
        ("table", pa.string(), "table name"),
        ("column", pa.string(), "column name"),
        ("type", pa.string(), "arrow type"),
        ("description", pa.string(), "meaning of the column"),
    ],
}

_FRAME = re.compile(r"^(.*)\((\d+)\): ")


def _user_frame(stack) -> tuple:
    """Innermost frame outside torch and torch_neuronx: the line the user wrote."""
    for frame in stack or ():
        m = _FRAME.match(frame)
        path = m.group(1) if m else ""
        if m and "/torch/" not in path and not path.startswith("torch/") and "torch_neuronx" not in path:
            return m.group(1), int(m.group(2))
    return "", -1


def _table(name: str, cols: dict) -> pa.Table:
    fields = SCHEMA[name]
    return pa.Table.from_arrays([pa.array(cols[c], type=t) for c, t, _ in fields],
                                schema=pa.schema([(c, t) for c, t, _ in fields]))


def _back_to_back(dev, queue, dur, order_key=None) -> np.ndarray:
    """Start of each interval when each (device, queue)'s intervals run back to back, in
    ``order_key`` order (row order if None)."""
    n = len(dur)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    key = dev.astype(np.int64) * (1 << 32) + queue
    order = np.lexsort((order_key,) + (key,)) if order_key is not None else np.argsort(key, kind="stable")
    sk, sd = key[order], dur[order]
    csum = np.cumsum(sd) - sd
    first = np.r_[True, sk[1:] != sk[:-1]]
    base = np.maximum.accumulate(np.where(first, csum, 0))
    out = np.empty(n, dtype=np.int64)
    out[order] = csum - base
    return out


def _surviving_op(corr: int, ops) -> int:
    """The op event a kernel's launching op survives as: torch drops an op that is the only
    child of an op of the same name (aten::sum inside aten::sum), lifting its kernels to the
    parent, which started just before it and so has the id just below."""
    for c in range(corr, max(corr - 8, 0), -1):
        if c in ops:
            return c
    return corr


def _ns(us) -> np.ndarray:
    # FunctionEvent times are float microseconds since the trace start.
    return (np.asarray(us, dtype=np.float64) * 1e3).astype(np.int64)


def _origin_ns(host_events) -> int:
    """start_ns 0: the first framework event's start (the first event's without any)."""
    framework = [e.time_range.start for e in host_events if _is_framework(e)]
    starts = framework or [e.time_range.start for e in host_events]
    return int(_ns(starts).min()) if starts else 0


def _is_framework(e) -> bool:
    """A torch.profiler op (not a device kernel, not a launch)."""
    return e.device_type != DeviceType.PrivateUse1 and e.name != RUNTIME_EVENT


def events_table(host_events=(), device_events=(), kernel_meta=None, cores=None,
                 max_per_device=None) -> pa.Table:
    """``host_events``: torch.profiler FunctionEvents, the Kineto plugin's kernels among them,
    whose metadata ``kernel_meta`` gives by event id (Kineto's chrome trace keeps it, torch's
    events do not); ``device_events``: cost-model intervals ``(device, queue, name, engine,
    seconds, launches)``, used only when the trace has no kernel events (a profile without the
    PrivateUse1 activity). ``cores``/``max_per_device`` keep the kernels of those devices /
    the first kernels of each device."""
    kernel_meta = kernel_meta or {}
    rows = {"framework": [], "runtime": [], "hardware": []}
    per_device: dict = {}
    for e in host_events:
        if e.device_type == DeviceType.PrivateUse1:
            if cores is not None and e.device_index not in cores:
                continue
            seen = per_device.get(e.device_index, 0)
            if max_per_device is not None and seen >= max_per_device:
                continue
            per_device[e.device_index] = seen + 1
            rows["hardware"].append(e)
        elif _is_framework(e):
            rows["framework"].append(e)
        else:
            rows["runtime"].append(e)
    where = {}
    names, src, starts, durs, corr, files, lines = [], [], [], [], [], [], []
    for e in rows["framework"]:
        f, ln = _user_frame(e.stack)
        where[e.id] = (f, ln)
    for kind in ("framework", "runtime", "hardware"):
        for e in rows[kind]:
            names.append(e.name)
            src.append(kind)
            starts.append(e.time_range.start)
            durs.append(e.time_range.end - e.time_range.start)
            c = e.id if kind == "framework" else _surviving_op(e.linked_correlation_id, where)
            corr.append(c if c > 0 else -1)
            f, ln = where.get(c, ("", -1))
            files.append(f)
            lines.append(ln)
    n = len(names)
    nf, nr, nk = (len(rows[k]) for k in ("framework", "runtime", "hardware"))
    start = _ns(starts)
    origin = int(start[:nf].min()) if nf else (int(start.min()) if n else 0)
    start -= origin
    dur = (np.asarray(durs, dtype=np.float64) * 1e3).astype(np.int64)

    dev = np.full(n, -1, np.int32)
    queue = np.full(n, -1, np.int32)
    engine = [""] * n
    modelled = np.zeros(n, np.int64)
    launches = np.zeros(n, np.int32)
    flops = np.zeros(n, np.int64)
    hbm = np.zeros(n, np.int64)
    link = np.zeros(n, np.int64)
    group = np.zeros(n, np.int32)
    nodes = np.zeros(n, np.int32)
    if nk:
        k0 = nf + nr
        metas = [kernel_meta.get(e.id, {}) for e in rows["hardware"]]
        dev[k0:] = [e.device_index for e in rows["hardware"]]
        queue[k0:] = [m.get("stream", 0) for m in metas]
        engine[k0:] = [m.get("engine", "") for m in metas]
        modelled[k0:] = [m.get("modelled_ns", 0) for m in metas]
        flops[k0:] = [m.get("flops", 0) for m in metas]
        hbm[k0:] = [m.get("hbm_bytes", 0) for m in metas]
        link[k0:] = [m.get("link_bytes", 0) for m in metas]
        group[k0:] = [m.get("group_size", 0) for m in metas]
        nodes[k0:] = [m.get("nodes", 0) for m in metas]
        launches[k0:] = 1
    m_start = np.full(n, -1, np.int64)
    if nk:
        m_start[nf + nr:] = _back_to_back(dev[nf + nr:], queue[nf + nr:], modelled[nf + nr:],
                                          start[nf + nr:])

    extra = device_events if not nk else ()
    nd = len(extra)
    if nd:
        d_dev, d_queue, d_names, d_engines, secs, d_launches = zip(*extra)
        d_dev = np.asarray(d_dev, dtype=np.int32)
        d_queue = np.asarray(d_queue, dtype=np.int32)
        d_mod = np.rint(np.asarray(secs, dtype=np.float64) * 1e9).astype(np.int64)
        names += list(d_names)
        src += ["hardware"] * nd
        engine += list(d_engines)
        corr += [-1] * nd
        files += [""] * nd
        lines += [-1] * nd
        start = np.r_[start, np.full(nd, -1, np.int64)]
        dur = np.r_[dur, np.full(nd, -1, np.int64)]
        dev = np.r_[dev, d_dev]
        queue = np.r_[queue, d_queue]
        modelled = np.r_[modelled, d_mod]
        launches = np.r_[launches, np.asarray(d_launches, dtype=np.int32)]
        flops = np.r_[flops, np.zeros(nd, np.int64)]
        hbm = np.r_[hbm, np.zeros(nd, np.int64)]
        link = np.r_[link, np.zeros(nd, np.int64)]
        group = np.r_[group, np.zeros(nd, np.int32)]
        nodes = np.r_[nodes, np.zeros(nd, np.int32)]
        m_start = np.r_[m_start, _back_to_back(d_dev, d_queue, d_mod)]

    kinds = ["framework", "runtime", "hardware"]
    code = {k: i for i, k in enumerate(kinds)}
    cols = {
        "event_id": np.arange(n + nd, dtype=np.int64),
        "source": pa.DictionaryArray.from_arrays(
            np.asarray([code[s] for s in src], dtype=np.int8), kinds).cast(pa.string()),
        "name": names,
        "device": dev,
        "queue": queue,
        "engine": engine,
        "start_ns": start,
        "duration_ns": dur,
        "modelled_start_ns": m_start,
        "modelled_ns": modelled,
        "flops": flops,
        "hbm_bytes": hbm,
        "launches": launches,
        "link_bytes": link,
        "group_size": group,
        "nodes": nodes,
        "correlation_id": np.asarray(corr, dtype=np.int64),
        "source_file": files,
        "source_line": np.asarray(lines, dtype=np.int32),
    }
    return _table("SystemProfileEvents", cols)


def memory_table(allocs=(), origin_ns: int = 0, ops=frozenset()) -> pa.Table:
    """DeviceMemory from ``_allocations.allocations`` rows: times on ``start_ns``'s clock
    (``origin_ns`` is its 0), each event linked to the innermost of its enclosing ops that
    ``ops`` (the framework rows' ids) holds."""
    rows = list(allocs)
    cols = list(zip(*rows)) if rows else [()] * 7
    corr = [next((i for i in ids if i in ops), -1) for ids in cols[6]]
    return _table("DeviceMemory", {
        "time_ns": np.asarray(cols[0], dtype=np.int64) - origin_ns,
        "device": np.asarray(cols[1], dtype=np.int32),
        "addr": np.asarray(cols[2], dtype=np.int64),
        "bytes": np.asarray(cols[3], dtype=np.int64),
        "total_allocated": np.asarray(cols[4], dtype=np.int64),
        "total_reserved": np.asarray(cols[5], dtype=np.int64),
        "correlation_id": np.asarray(corr, dtype=np.int64)})


def instructions_table(rows) -> pa.Table:
    """DeviceInstructions from rows of its columns, in order."""
    cols = list(zip(*rows)) if rows else [()] * len(SCHEMA["DeviceInstructions"])
    return _table("DeviceInstructions", {
        c: (np.asarray(v, dtype=np.int64) if ty == pa.int64() else
            np.asarray(v, dtype=np.int32) if ty == pa.int32() else list(v))
        for (c, ty, _), v in zip(SCHEMA["DeviceInstructions"], cols)})


def export_parquet(path: str, host_events=(), device_events=(), kernel_meta=None, cores=None,
                   max_per_device=None, allocs=()):
    """Writes the tables into directory ``path``; returns the SystemProfileEvents table.
    Arguments as ``events_table``'s; ``allocs``: the profile's allocator events
    (``_allocations.allocations``), which make the DeviceMemory table."""
    os.makedirs(path, exist_ok=True)
    events = events_table(host_events, device_events, kernel_meta, cores, max_per_device)
    src = events["source"].to_numpy(zero_copy_only=False)
    n_hw = int((src == "hardware").sum())
    traced = bool(((src == "hardware") & (events["duration_ns"].to_numpy() >= 0)).any())
    meta = {"profile_schema_version": PROFILE_SCHEMA_VERSION,
            "framework_events": str(int((src == "framework").sum())),
            "runtime_events": str(int((src == "runtime").sum())),
            "hardware_events": str(n_hw),
            "hardware_source": "kineto" if traced else "cost_model"}
    tables = {
        "SystemProfileEvents": events,
        "DeviceMemory": memory_table(allocs, _origin_ns(host_events),
                                     frozenset(events["correlation_id"].to_numpy()[src == "framework"].tolist())),
        "Metadata": _table("Metadata", {"key": list(meta), "value": list(meta.values())}),
        "SchemaFields": _table("SchemaFields", {
            "table": [t for t, f in SCHEMA.items() for _ in f],
            "column": [c for f in SCHEMA.values() for c, _, _ in f],
            "type": [str(ty) for f in SCHEMA.values() for _, ty, _ in f],
            "description": [d for f in SCHEMA.values() for _, _, d in f]}),
    }
    for name, table in tables.items():
        pq.write_table(table, os.path.join(path, f"{name}.parquet"))
    return events
