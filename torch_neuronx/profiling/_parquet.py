"""Parquet export: one ``<Table>.parquet`` per table, built column by column (a list per
column, one pyarrow array each) because per-row dicts made 20k events take seconds."""
from __future__ import annotations

import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PROFILE_SCHEMA_VERSION = "1.0.0"

# (column, arrow type, description): the SchemaFields table is written from this.
SCHEMA = {
    "SystemProfileEvents": [
        ("event_id", pa.int64(), "row number, unique within the trace"),
        ("source", pa.string(), "framework (torch.profiler host event) or hardware (modelled device interval)"),
        ("name", pa.string(), "op or kernel name"),
        ("device", pa.int32(), "neuron device index; -1 for host events"),
        ("queue", pa.int32(), "device queue (stream) of a hardware event; -1 for host events"),
        ("engine", pa.string(), "engine of a hardware event (tensor, vector, scalar, dma, fused, nki, collective); empty for host"),
        ("start_ns", pa.int64(), "start, ns since the trace's first host event"),
        ("duration_ns", pa.int64(), "host execution time of framework events; modelled time of hardware events"),
        ("modelled_ns", pa.int64(), "modelled Trainium time (hardware events); 0 for host events"),
        ("launches", pa.int32(), "kernel launches the hardware event covers (repeats are batched); 0 for host"),
        ("source_file", pa.string(), "Python file of the innermost user frame (with_stack=True)"),
        ("source_line", pa.int32(), "line in source_file; -1 when unknown"),
    ],
    "Metadata": [
        ("key", pa.string(), "metadata key (profile_schema_version, event counts)"),
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
        if m and "/torch/" not in m.group(1) and "torch_neuronx" not in m.group(1):
            return m.group(1), int(m.group(2))
    return "", -1


def _table(name: str, cols: dict) -> pa.Table:
    fields = SCHEMA[name]
    return pa.Table.from_arrays([pa.array(cols[c], type=t) for c, t, _ in fields],
                                schema=pa.schema([(c, t) for c, t, _ in fields]))


def events_table(host_events=(), device_events=()) -> pa.Table:
    """``host_events``: torch.profiler FunctionEvents; ``device_events``: cost-model
    intervals ``(device, queue, name, engine, seconds, launches)``, laid end to end per queue."""
    names, starts, durs, files, lines = [], [], [], [], []
    for e in host_events:
        names.append(e.name)
        starts.append(e.time_range.start)
        durs.append(e.time_range.end - e.time_range.start)
        f, ln = _user_frame(e.stack)
        files.append(f)
        lines.append(ln)
    nh = len(names)
    # FunctionEvent times are float microseconds.
    h_start = (np.asarray(starts, dtype=np.float64) * 1e3).astype(np.int64)
    origin = int(h_start.min()) if nh else 0
    h_start -= origin
    h_dur = (np.asarray(durs, dtype=np.float64) * 1e3).astype(np.int64)

    nd = len(device_events)
    if nd:
        dev, queue, dnames, engines, secs, launches = zip(*device_events)
        launches = np.asarray(launches, dtype=np.int32)
        dev = np.asarray(dev, dtype=np.int32)
        queue = np.asarray(queue, dtype=np.int32)
        d_dur = np.rint(np.asarray(secs, dtype=np.float64) * 1e9).astype(np.int64)
        # Each queue's intervals run back to back: start = cumulative sum within the queue.
        key = dev.astype(np.int64) * (1 << 32) + queue
        order = np.argsort(key, kind="stable")
        sk, sd = key[order], d_dur[order]
        csum = np.cumsum(sd) - sd
        first = np.r_[True, sk[1:] != sk[:-1]]
        base = np.maximum.accumulate(np.where(first, csum, 0))
        d_start = np.empty(nd, dtype=np.int64)
        d_start[order] = csum - base
        dnames, engines = list(dnames), list(engines)
    else:
        dev = queue = np.empty(0, dtype=np.int32)
        d_dur = d_start = np.empty(0, dtype=np.int64)
        dnames, engines = [], []
        launches = np.empty(0, dtype=np.int32)

    cols = {
        "event_id": np.arange(nh + nd, dtype=np.int64),
        "source": pa.DictionaryArray.from_arrays(
            np.r_[np.zeros(nh, np.int8), np.ones(nd, np.int8)], ["framework", "hardware"]
        ).cast(pa.string()),
        "name": names + dnames,
        "device": np.r_[np.full(nh, -1, np.int32), dev],
        "queue": np.r_[np.full(nh, -1, np.int32), queue],
        "engine": [""] * nh + engines,
        "start_ns": np.r_[h_start, d_start],
        "duration_ns": np.r_[h_dur, d_dur],
        "modelled_ns": np.r_[np.zeros(nh, np.int64), d_dur],
        "launches": np.r_[np.zeros(nh, np.int32), launches],
        "source_file": files + [""] * nd,
        "source_line": np.r_[np.asarray(lines, dtype=np.int32), np.full(nd, -1, np.int32)],
    }
    return _table("SystemProfileEvents", cols)


def export_parquet(path: str, host_events=(), device_events=()):
    """Writes the tables into directory ``path``; returns the SystemProfileEvents table."""
    os.makedirs(path, exist_ok=True)
    events = events_table(host_events, device_events)
    n_hw = len(device_events)
    meta = {"profile_schema_version": PROFILE_SCHEMA_VERSION,
            "framework_events": str(events.num_rows - n_hw), "hardware_events": str(n_hw)}
    tables = {
        "SystemProfileEvents": events,
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
