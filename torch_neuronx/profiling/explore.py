"""Bottleneck report over an exported Parquet directory: ``torchneuron explore DIR`` and
``python -m torch_neuronx.profiler DIR``."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq

from .. import _state
from . import _memory_snapshot
from ._comm import communication
from ._fusion import fusion_opportunities


def _trace_dir(path: str) -> str:
    """``path`` itself, or for a ``profile_output_dir`` its newest ``trace_<n>``."""
    if os.path.exists(os.path.join(path, "SystemProfileEvents.parquet")):
        return path
    traces = [d for d in os.listdir(path) if d.startswith("trace_") and d[6:].isdigit()
              and os.path.exists(os.path.join(path, d, "SystemProfileEvents.parquet"))] \
        if os.path.isdir(path) else []
    if not traces:
        raise FileNotFoundError(f"explore: {path!r} has no SystemProfileEvents.parquet and no "
                                f"trace_<n>/ holding one (pass the directory NeuronProfiler wrote)")
    return os.path.join(path, max(traces, key=lambda d: int(d[6:])))


def report(path: str, top: int = 10) -> dict:
    path = _trace_dir(path)
    events_file = os.path.join(path, "SystemProfileEvents.parquet")
    ev = pq.read_table(events_file).to_pandas()
    hw = ev[ev.source == "hardware"]
    from ..cost_model import kernel_latency_ns
    profile = _state.config().profile
    # What every launch costs however small the kernel: the launch and the kernel's
    # DMA-in / engine / DMA-out latency.
    launch_ns = profile.launch_overhead_ns + kernel_latency_ns(profile)
    by_kernel = hw.groupby("name").agg(modelled_ns=("modelled_ns", "sum"), launches=("launches", "sum"),
                                       # (not `engine=`: agg takes that as its numba switch)
                                       kernel_engine=("engine", "first"), flops=("flops", "sum"),
                                       hbm_bytes=("hbm_bytes", "sum"))
    by_kernel["mean_ns"] = by_kernel.modelled_ns / by_kernel.launches
    by_kernel["bound"] = [_bound(r, launch_ns, profile) for r in by_kernel.itertuples()]
    by_kernel = by_kernel.sort_values("modelled_ns", ascending=False)
    total = int(hw.modelled_ns.sum())
    launch_total = int(hw.launches.sum() * launch_ns)
    engines = hw.groupby("engine").modelled_ns.sum()
    host = ev[ev.source == "framework"]
    lines = _host_line_time(host[host.source_line >= 0]).sort_values(ascending=False).head(top)
    # Correlated kernels (the Kineto plugin's) name the line that launched them.
    dev_lines = hw[hw.source_line >= 0].groupby(["source_file", "source_line"]).modelled_ns.sum()
    dev_lines = dev_lines.sort_values(ascending=False).head(top)
    traced = hw[hw.duration_ns >= 0]
    traced_bytes = bool(hw.hbm_bytes.sum() > 0)
    return {
        "roofline": traced_bytes,
        "trace": path,
        "modelled_ns": total,
        "hardware_events": int(hw.shape[0]),
        "launch_overhead_share": (launch_total / total) if total else 0.0,
        "top_kernels": [{"name": n, "modelled_ns": int(r.modelled_ns), "launches": int(r.launches),
                         "mean_ns": float(r.mean_ns), "bound": r.bound, "engine": r.kernel_engine,
                         "flops": int(r.flops), "hbm_bytes": int(r.hbm_bytes)}
                        for n, r in by_kernel.head(top).iterrows()],
        "engines": {k: int(v) for k, v in engines.items()},
        "top_source_lines_host_ns": [{"file": f, "line": int(ln), "host_ns": int(v)}
                                     for (f, ln), v in lines.items()],
        "top_source_lines_modelled_ns": [{"file": f, "line": int(ln), "modelled_ns": int(v)}
                                         for (f, ln), v in dev_lines.items()],
        "fusion_opportunities": fusion_opportunities(hw, launch_ns, top),
        **communication(hw, _union, _overlap, top),
        **_timeline_analysis(traced, host, top),
        "device_memory": _memory(path),
        "engine_utilisation": _engine_utilisation(path, hw),
        "top_kernel_lines": _kernel_lines(path, top),
    }


def _engine_utilisation(path: str, hw) -> dict:
    """Per kernel with instruction rows: each engine's busy time (DeviceInstructions) over the
    modelled time of its programs (its hardware events' modelled time, a compiled graph's with
    its extern calls)."""
    f = os.path.join(path, "DeviceInstructions.parquet")
    if not os.path.exists(f):  # traces exported before schema 1.3.0
        return {}
    ins = pq.read_table(f).to_pandas()
    out = {}
    for kernel, g in ins.groupby("kernel"):
        if "program_ns" in g:  # one program per kernel event (schema 1.5.0)
            total = int(g.drop_duplicates("kernel_event_id").program_ns.sum())
        else:  # uncorrelated profiles' rows all have correlation_id -1: the name tells them apart
            k = hw[(hw.name == kernel) & hw.correlation_id.isin(set(g.correlation_id))]
            total = int(k.modelled_ns.sum())
        if total > 0:
            out[kernel] = {e: float(v) / total for e, v in g.groupby("engine").duration_ns.sum().items()}
    return out


def _kernel_lines(path: str, top: int) -> list:
    """NKI kernel lines by the modelled engine time of the instructions they issued
    (DeviceInstructions; a DMA counts once per queue it holds)."""
    f = os.path.join(path, "DeviceInstructions.parquet")
    if not os.path.exists(f):
        return []
    ins = pq.read_table(f).to_pandas()
    if "source_line" not in ins:  # traces exported before schema 1.6.0
        return []
    ins = ins[ins.source_line >= 0]
    busy = ins.groupby(["kernel", "source_file", "source_line"]).duration_ns.sum()
    return [{"kernel": k, "file": f, "line": int(ln), "engine_ns": int(v)}
            for (k, f, ln), v in busy.sort_values(ascending=False).head(top).items()]


def _memory(path: str) -> dict:
    """Per device: peak and final allocated/reserved bytes from the DeviceMemory table (empty
    unless the profile ran with profile_memory=True)."""
    f = os.path.join(path, "DeviceMemory.parquet")
    if not os.path.exists(f):  # traces exported before schema 1.2.0
        return {}
    m = pq.read_table(f).to_pandas()
    return {str(d): {"events": int(len(g)), "peak_allocated": int(g.total_allocated.max()),
                     "peak_reserved": int(g.total_reserved.max()),
                     "final_allocated": int(g.total_allocated.iloc[-1]),
                     "final_reserved": int(g.total_reserved.iloc[-1])}
            for d, g in m.groupby("device")}


def _bound(r, launch_ns: float, profile) -> str:
    """What limits a kernel on the modelled chip. The cost model charges each launch a fixed
    cost plus the longer of its engine work and its HBM traffic, so: launch-bound when the
    fixed cost dominates (fusion or batching helps, faster engines do not); else memory-bound
    when the HBM time is the longer part, compute-bound otherwise. Without traced bytes (a
    profile without the PrivateUse1 activity) only launch vs work is known."""
    if r.mean_ns < 2 * launch_ns:
        return "launch"
    if r.hbm_bytes <= 0 or r.kernel_engine in ("nki", "collective", "fused", "dma"):
        return "work"
    from .. import _state
    work_ns = r.modelled_ns - r.launches * launch_ns
    hbm_ns = r.hbm_bytes / profile.core_hbm_bandwidth(_state.config().lnc) * 1e9
    return "memory" if hbm_ns >= 0.99 * work_ns else "compute"


def _host_line_time(host):
    """Wall time per source line: the union of its events' intervals, since the events a line
    launched nest (the Python call, its ops, their sub-ops) and a sum would count each level."""
    import pandas as pd
    out = {}
    for key, g in host.groupby(["source_file", "source_line"]):
        s, e = _union(g.start_ns.to_numpy(), (g.start_ns + g.duration_ns).to_numpy())
        out[key] = int((e - s).sum())
    return pd.Series(out, dtype="int64")


def _union(starts, ends) -> tuple:
    """Merged intervals of [starts, ends): (merged starts, merged ends)."""
    if len(starts) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = np.asarray(starts)[order], np.asarray(ends)[order]
    run_end = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > run_end[:-1]]
    idx = np.flatnonzero(new)
    return s[idx], np.r_[run_end[idx[1:] - 1], run_end[-1]]


def _overlap(a, b) -> int:
    """Length of the intersection of two merged interval sets."""
    (as_, ae), (bs, be) = a, b
    total, i, j = 0, 0, 0
    while i < len(as_) and j < len(bs):
        lo, hi = max(as_[i], bs[j]), min(ae[i], be[j])
        if hi > lo:
            total += int(hi - lo)
        if ae[i] < be[j]:
            i += 1
        else:
            j += 1
    return total


def _timeline_analysis(traced, host, top: int) -> dict:
    """On the traced (host execution) timeline: device busy time, idle gaps between kernels
    of a device, and how much of the device's busy time ran while the host was inside ops
    (overlapped) rather than waiting for nothing."""
    if traced.empty:
        return {"device_busy_ns": 0, "idle_ns": 0, "idle_gaps": [], "host_overlap_share": None}
    gaps, busy_total, idle_total, overlap_total = [], 0, 0, 0
    hs, he = _union(host.start_ns.to_numpy(), (host.start_ns + host.duration_ns).to_numpy())
    for d, k in traced.groupby("device"):
        k = k.sort_values("start_ns")
        s, e = _union(k.start_ns.to_numpy(), (k.start_ns + k.duration_ns).to_numpy())
        busy_total += int((e - s).sum())
        overlap_total += _overlap((s, e), (hs, he))
        for gs, ge in zip(e[:-1], s[1:]):
            nxt = k[k.start_ns >= ge].iloc[0]
            gaps.append({"device": int(d), "start_ns": int(gs), "idle_ns": int(ge - gs),
                         "next_kernel": nxt["name"], "file": nxt.source_file,
                         "line": int(nxt.source_line)})
            idle_total += int(ge - gs)
    gaps.sort(key=lambda g: -g["idle_ns"])
    return {"device_busy_ns": busy_total, "idle_ns": idle_total, "idle_gaps": gaps[:top],
            "host_overlap_share": overlap_total / busy_total if busy_total else None}


def format_text(r: dict) -> str:
    out = [f"trace {r['trace']}",
           f"modelled device time {r['modelled_ns'] / 1e6:.3f} ms over {r['hardware_events']} kernels; "
           f"launch overhead {100 * r['launch_overhead_share']:.0f}% of it"]
    if r["launch_overhead_share"] > 0.5:
        out.append("bottleneck: launch-bound (many tiny kernels; fuse them or batch the work)")
    out.append("top kernels by modelled time:")
    width = max([24] + [len(k["name"]) + 1 for k in r["top_kernels"]])
    for k in r["top_kernels"]:
        out.append(f"  {k['name']:<{width}}{k['modelled_ns'] / 1e3:>12.1f} us {k['launches']:>7} launches  "
                   f"{k['bound']}-bound")
    out.append("engines: " + ", ".join(f"{e} {ns / 1e3:.1f} us" for e, ns in r["engines"].items()))
    if r["top_source_lines_modelled_ns"]:
        out.append("top source lines by modelled device time:")
        for s in r["top_source_lines_modelled_ns"]:
            out.append(f"  {s['file']}:{s['line']}  {s['modelled_ns'] / 1e3:.1f} us")
    out.append("top source lines by host time:")
    for s in r["top_source_lines_host_ns"]:
        out.append(f"  {s['file']}:{s['line']}  {s['host_ns'] / 1e3:.1f} us")
    if r["communication_ns"]:
        out.append(f"communication {r['communication_ns'] / 1e3:.1f} us modelled: "
                   f"{r['communication_exposed_ns'] / 1e3:.1f} us exposed, "
                   f"{r['communication_overlapped_ns'] / 1e3:.1f} us overlapped by compute on other queues")
        if r["communication_exposed_ns"] > 0.25 * r["modelled_ns"]:
            out.append("bottleneck: exposed communication (overlap collectives with compute on "
                       "another stream, or bucket them)")
        for c in r["collectives"][:5]:
            out.append(f"  {c['name']} on neuron:{c['device']} q{c['queue']}: "
                       f"{c['exposed_ns'] / 1e3:.1f} us exposed of {c['modelled_ns'] / 1e3:.1f} us")
    if r["fusion_opportunities"]:
        out.append("fusion opportunities (small elementwise kernels run back to back, unfused):")
        for c in r["fusion_opportunities"][:5]:
            where = ", ".join(f"{s['file']}:{s['line']}" for s in c["source_lines"][:4])
            out.append(f"  {c['launches']} launches on neuron:{c['device']} q{c['queue']} "
                       f"({' -> '.join(c['kernels'][:6])}): one kernel would save "
                       f"{c['saved_ns'] / 1e3:.1f} us of {c['modelled_ns'] / 1e3:.1f} us"
                       + (f" [{where}]" if where else ""))
    if r["device_busy_ns"]:
        out.append(f"device busy {r['device_busy_ns'] / 1e3:.1f} us (host execution), idle between "
                   f"kernels {r['idle_ns'] / 1e3:.1f} us; {100 * r['host_overlap_share']:.0f}% of "
                   f"the busy time overlaps host ops")
        for g in r["idle_gaps"][:5]:
            out.append(f"  idle {g['idle_ns'] / 1e3:.1f} us on neuron:{g['device']} before "
                       f"{g['next_kernel']} ({g['file']}:{g['line']})")
    if r.get("top_kernel_lines"):
        out.append("top NKI kernel lines by modelled engine time:")
        for s in r["top_kernel_lines"]:
            out.append(f"  {s['kernel']} {s['file']}:{s['line']}  {s['engine_ns'] / 1e3:.2f} us")
    for kernel, util in r["engine_utilisation"].items():
        out.append(f"{kernel} engine utilisation: " + ", ".join(
            f"{e} {100 * u:.0f}%" for e, u in sorted(util.items(), key=lambda x: -x[1])))
    for d, m in r["device_memory"].items():
        out.append(f"neuron:{d} memory: peak {m['peak_allocated'] / 2**20:.2f} MiB allocated, "
                   f"{m['peak_reserved'] / 2**20:.2f} MiB reserved ({m['events']} allocator events)")
    if r.get("memory_snapshot"):
        out.append(f"memory snapshot: {r['memory_snapshot']} (pytorch.org/memory_viz, or "
                   f"python -m torch.cuda._memory_viz trace_plot FILE -o memory.html)")
    return "\n".join(out)


def plots(path: str, r: dict, out_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    files = []
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [k["name"] for k in r["top_kernels"]][::-1]
    ax.barh(names, [k["modelled_ns"] / 1e3 for k in r["top_kernels"]][::-1])
    ax.set_xlabel("modelled time (us)")
    ax.set_title("top kernels")
    files.append(_save(plt, fig, out_dir, "top_kernels.png"))
    ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet")).to_pandas()
    hw = ev[ev.source == "hardware"]
    if r.get("roofline"):
        files.append(_roofline_plot(plt, r, out_dir))
    fig, ax = plt.subplots(figsize=(10, 3))
    lanes = sorted(set(zip(hw.device, hw.queue)))
    for i, lane in enumerate(lanes):
        q = hw[(hw.device == lane[0]) & (hw.queue == lane[1])]
        ax.broken_barh(list(zip(q.modelled_start_ns / 1e3, q.modelled_ns / 1e3)), (i - 0.4, 0.8))
    ax.set_yticks(range(len(lanes)), [f"neuron:{d} q{q}" for d, q in lanes])
    ax.set_xlabel("modelled time (us)")
    files.append(_save(plt, fig, out_dir, "timeline.png"))
    if r["device_memory"]:
        files.append(_memory_plot(plt, path, out_dir))
    return files


def _memory_plot(plt, path: str, out_dir: str) -> str:
    """Allocated and reserved bytes per device over the host-time axis, as steps."""
    m = pq.read_table(os.path.join(path, "DeviceMemory.parquet")).to_pandas()
    fig, ax = plt.subplots(figsize=(8, 3))
    for d, g in m.groupby("device"):
        t = g.time_ns / 1e3
        ax.step(t, g.total_allocated / 2**20, where="post", label=f"neuron:{d} allocated")
        ax.step(t, g.total_reserved / 2**20, where="post", linestyle="--", label=f"neuron:{d} reserved")
    ax.set_xlabel("host time (us)")
    ax.set_ylabel("MiB")
    ax.legend()
    return _save(plt, fig, out_dir, "memory.png")


def _roofline_plot(plt, r: dict, out_dir: str) -> str:
    """Achieved modelled FLOP/s against arithmetic intensity (FLOPs per HBM byte), under the
    profile's HBM roof; kernels without TensorE FLOPs sit at intensity 0."""
    from .. import _state
    cfg = _state.config()
    bw = cfg.profile.core_hbm_bandwidth(cfg.lnc)
    fig, ax = plt.subplots(figsize=(6, 4))
    ks = [k for k in r["top_kernels"] if k["hbm_bytes"] > 0]
    ai = [max(k["flops"] / k["hbm_bytes"], 1e-3) for k in ks]
    perf = [max(k["flops"] / (k["modelled_ns"] * 1e-9), 1.0) for k in ks]
    ax.scatter(ai, perf)
    for k, x, y in zip(ks, ai, perf):
        ax.annotate(f"{k['name']} ({k['bound']})", (x, y), fontsize=7)
    xs = [1e-3, max(ai + [1.0]) * 10]
    ax.plot(xs, [x * bw for x in xs], "--", label="HBM roof")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOPs per HBM byte")
    ax.set_ylabel("modelled FLOP/s")
    ax.legend()
    return _save(plt, fig, out_dir, "roofline.png")


def _save(plt, fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="torchneuron explore", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser) -> None:
    parser.add_argument("dir", help="Parquet directory written by NeuronProfiler.export_trace, "
                                    "or its profile_output_dir (then the newest trace_<n>)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for agents)")
    parser.add_argument("--plots", default=None, help="write PNG plots into this directory")
    parser.add_argument("--top", type=int, default=10)


def run(args) -> int:
    args.dir = _trace_dir(args.dir)
    r = report(args.dir, top=args.top)
    if args.plots:
        r["plots"] = plots(args.dir, r, args.plots)
    if r["device_memory"]:
        # For PyTorch's memory viewer; beside the plots, else beside the tables.
        r["memory_snapshot"] = _memory_snapshot.write(args.dir, args.plots or args.dir)
    print(json.dumps(r, indent=1) if args.json else format_text(r))
    return 0
