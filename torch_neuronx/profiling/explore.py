"""Bottleneck report over an exported Parquet directory: ``torchneuron explore DIR`` and
``python -m torch_neuronx.profiler DIR``."""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq

from .. import _state


def report(path: str, top: int = 10) -> dict:
    events_file = os.path.join(path, "SystemProfileEvents.parquet")
    if not os.path.exists(events_file):
        raise FileNotFoundError(f"explore: {path!r} has no SystemProfileEvents.parquet "
                                f"(pass the directory NeuronProfiler.export_trace wrote)")
    ev = pq.read_table(events_file).to_pandas()
    hw = ev[ev.source == "hardware"]
    from ..cost_model import kernel_latency_ns
    profile = _state.config().profile
    # What every launch costs however small the kernel: the launch and the kernel's
    # DMA-in / engine / DMA-out latency.
    launch_ns = profile.launch_overhead_ns + kernel_latency_ns(profile)
    by_kernel = hw.groupby("name").agg(modelled_ns=("modelled_ns", "sum"), launches=("launches", "sum"))
    by_kernel["mean_ns"] = by_kernel.modelled_ns / by_kernel.launches
    # Kernels whose mean is dominated by the fixed cost of a launch gain from fusion or
    # batching, not from faster engines.
    by_kernel["bound"] = ["launch" if m < 2 * launch_ns else "work" for m in by_kernel.mean_ns]
    by_kernel = by_kernel.sort_values("modelled_ns", ascending=False)
    total = int(hw.modelled_ns.sum())
    launch_total = int(hw.launches.sum() * launch_ns)
    engines = hw.groupby("engine").modelled_ns.sum()
    host = ev[ev.source == "framework"]
    lines = host[host.source_line >= 0].groupby(["source_file", "source_line"]).duration_ns.sum()
    lines = lines.sort_values(ascending=False).head(top)
    return {
        "modelled_ns": total,
        "hardware_events": int(hw.shape[0]),
        "launch_overhead_share": (launch_total / total) if total else 0.0,
        "top_kernels": [{"name": n, "modelled_ns": int(r.modelled_ns), "launches": int(r.launches),
                         "mean_ns": float(r.mean_ns), "bound": r.bound}
                        for n, r in by_kernel.head(top).iterrows()],
        "engines": {k: int(v) for k, v in engines.items()},
        "top_source_lines_host_ns": [{"file": f, "line": int(ln), "host_ns": int(v)}
                                     for (f, ln), v in lines.items()],
    }


def format_text(r: dict) -> str:
    out = [f"modelled device time {r['modelled_ns'] / 1e6:.3f} ms over {r['hardware_events']} kernels; "
           f"launch overhead {100 * r['launch_overhead_share']:.0f}% of it"]
    if r["launch_overhead_share"] > 0.5:
        out.append("bottleneck: launch-bound (many tiny kernels; fuse them or batch the work)")
    out.append("top kernels by modelled time:")
    for k in r["top_kernels"]:
        out.append(f"  {k['name']:<24}{k['modelled_ns'] / 1e3:>12.1f} us {k['launches']:>7} launches  "
                   f"{k['bound']}-bound")
    out.append("engines: " + ", ".join(f"{e} {ns / 1e3:.1f} us" for e, ns in r["engines"].items()))
    out.append("top source lines by host time:")
    for s in r["top_source_lines_host_ns"]:
        out.append(f"  {s['file']}:{s['line']}  {s['host_ns'] / 1e3:.1f} us")
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
    fig.tight_layout()
    files.append(os.path.join(out_dir, "top_kernels.png"))
    fig.savefig(files[-1])
    plt.close(fig)
    ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet")).to_pandas()
    hw = ev[ev.source == "hardware"]
    fig, ax = plt.subplots(figsize=(10, 3))
    lanes = sorted(set(zip(hw.device, hw.queue)))
    for i, lane in enumerate(lanes):
        q = hw[(hw.device == lane[0]) & (hw.queue == lane[1])]
        ax.broken_barh(list(zip(q.start_ns / 1e3, q.duration_ns / 1e3)), (i - 0.4, 0.8))
    ax.set_yticks(range(len(lanes)), [f"neuron:{d} q{q}" for d, q in lanes])
    ax.set_xlabel("modelled time (us)")
    fig.tight_layout()
    files.append(os.path.join(out_dir, "timeline.png"))
    fig.savefig(files[-1])
    plt.close(fig)
    return files


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="torchneuron explore", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser) -> None:
    parser.add_argument("dir", help="Parquet directory written by NeuronProfiler.export_trace")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for agents)")
    parser.add_argument("--plots", default=None, help="write PNG plots into this directory")
    parser.add_argument("--top", type=int, default=10)


def run(args) -> int:
    r = report(args.dir, top=args.top)
    if args.plots:
        r["plots"] = plots(args.dir, r, args.plots)
    print(json.dumps(r, indent=1) if args.json else format_text(r))
    return 0
