"""Benchmark of the "neuron" c10d backend against gloo on CPU, measured in the same run.

    .venv/bin/python bench/bench_distributed.py [--quick] [--reps N] [--runs N] [--write]

1. all_reduce bus bandwidth (nccl-tests definition: 2(p-1)/p * bytes / time), 2 and 4 ranks,
   1 MiB .. 256 MiB float32: neuron tensors on the neuron backend (agreement over shared
   memory, over gloo, off) vs CPU tensors on a gloo group, all in the same processes,
   interleaved; ratios are medians of per-repetition ratios.
2. One DDP training step of a GPT on 2 ranks: neuron device + neuron backend vs the same
   script on CPU with gloo (steps alternate; median of per-step ratios after warm-up).
``--write`` replaces the "Distributed" section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(nproc: int, args: list, timeout: float = 1800) -> dict:
    """Run this file's worker on ``nproc`` ranks (torchrun's environment); rank 0's JSON."""
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}):\n{err[-4000:]}")
        outs.append(out)
    return json.loads(outs[0].strip().splitlines()[-1])


# --- workers ---------------------------------------------------------------------------------
def _worker_allreduce(sizes_mib: list, reps: int) -> dict:
    import torch
    import torch.distributed as dist
    dist.init_process_group("neuron")
    gloo = dist.new_group(backend="gloo")
    # Samples start together after a barrier on a group none of them uses: a barrier on a
    # measured group warms that group's gloo threads and favours it (measured: ~10% at 4 ranks).
    sync = dist.new_group(backend="gloo")
    # the same backend with the agreement as a gloo round trip (what a group spanning hosts
    # uses), and without the per-collective agreement check
    os.environ["TORCH_NEURONX_DIST_CHECK"] = "gloo"
    over_gloo = dist.new_group(backend="neuron")
    os.environ["TORCH_NEURONX_DIST_CHECK"] = "0"
    unchecked = dist.new_group(backend="neuron")
    assert dist.group.WORLD.check_transport == "shm", dist.group.WORLD.check_transport
    p = dist.get_world_size()
    res = {}
    for mib in sizes_mib:
        n = mib * MiB // 4
        dev_t = torch.ones(n, device="neuron")
        cpu_t = torch.ones(n)
        times = {"neuron": [], "over_gloo": [], "unchecked": [], "gloo": []}
        runs = [("neuron", dev_t, None), ("over_gloo", dev_t, over_gloo),
                ("unchecked", dev_t, unchecked), ("gloo", cpu_t, gloo)]
        for kind, t, g in runs:
            dist.all_reduce(t, group=g)          # warm-up (connections, pages)
        # A sample is a few back-to-back all_reduces (throughput). The variants run one after
        # the other in each repetition, in reversed order every other repetition, and ratios
        # are taken within a repetition: paired samples see the same machine load. Small
        # sizes, whose samples are short and noisy, get more repetitions.
        burst = max(1, min(4, 16 // mib))
        for rep in range(max(reps, reps * 8 // mib)):
            for kind, t, g in (runs if rep % 2 == 0 else runs[::-1]):
                dist.barrier(group=sync)
                t0 = time.perf_counter()
                for _ in range(burst):
                    dist.all_reduce(t, group=g)
                times[kind].append((time.perf_counter() - t0) / burst)
        res[mib] = {k: statistics.median(v) for k, v in times.items()}
        for k in times:
            res[mib][k + "_busbw"] = 2 * (p - 1) / p * mib * MiB / res[mib][k]
            # bus bandwidth ratio to gloo = gloo's time / this variant's, per repetition
            res[mib][k + "_ratio"] = statistics.median(
                g / t for g, t in zip(times["gloo"], times[k]))
        del dev_t, cpu_t
    dist.destroy_process_group()
    return res


def _worker_ddp(steps: int) -> dict:
    """The same DDP training on neuron (neuron backend) and on CPU (a gloo group), steps
    alternating in the same processes so both see the same machine load."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, str(REPO / "tests" / "distributed"))
    import _models as M
    dist.init_process_group("neuron")
    gloo = dist.new_group(backend="gloo")
    sync = dist.new_group(backend="gloo")   # barriers only (see _worker_allreduce)
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {}
    for device, group in (("neuron", None), ("cpu", gloo)):
        torch.manual_seed(0)
        model = M.GPT(vocab=512, dim=256, heads=8, layers=4).to(device)
        ddp = DDP(model, process_group=group)
        runs[device] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), group)
    times = {"neuron": [], "cpu": []}
    order = list(runs.items())
    for step in range(steps):
        x, y = M.batch(step, 8 * world, 128, vocab=512)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        for device, (ddp, opt, group) in (order if step % 2 == 0 else order[::-1]):
            xd, yd = x.to(device), y.to(device)
            dist.barrier(group=sync)
            t0 = time.perf_counter()
            loss = M.lm_loss(ddp(xd), yd)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()  # the step is done when its result is on the host
            times[device].append(time.perf_counter() - t0)
    dist.destroy_process_group()
    ratio = statistics.median(n / c for n, c in zip(times["neuron"][2:], times["cpu"][2:]))
    return ({d: statistics.median(t[2:]) for d, t in times.items()}
            | {"steps": steps - 2, "ratio": ratio})


# --- driver ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs="*")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    ap.add_argument("--reps", type=int, default=9,
                    help="all_reduce repetitions per size (x8 at 1 MiB, x2 at 4 MiB)")
    ap.add_argument("--runs", type=int, default=3, help="whole runs; figures are their medians")
    a, rest = ap.parse_known_args()
    if a.worker is not None:
        kind = a.worker[0]
        if kind == "allreduce":
            out = _worker_allreduce([int(s) for s in a.worker[2].split(",")], int(a.worker[1]))
        else:
            out = _worker_ddp(int(a.worker[1]))
        if int(os.environ["RANK"]) == 0:
            print(json.dumps(out))
        return

    sizes = [1, 16, 64] if a.quick else [1, 4, 16, 64, 256]
    reps = 3 if a.quick else a.reps
    runs = 1 if a.quick else a.runs
    steps = 8 if a.quick else 22
    # Whole runs (fresh processes) repeat, interleaved, so that a burst of load from other
    # jobs spoils at most one of them; every figure is then the median over runs.
    allreduce = {2: [], 4: []}
    ddps = []
    for run in range(runs):
        for nproc in (2, 4):
            allreduce[nproc].append(
                _launch(nproc, ["allreduce", str(reps), ",".join(map(str, sizes))]))
        ddps.append(_launch(2, ["ddp", str(steps)]))
        print(f"run {run + 1}/{runs} done", flush=True)

    def med(results, key):
        return statistics.median(r[key] for r in results)

    lines = ["| ranks | size | neuron busbw (GB/s) | gloo CPU busbw (GB/s) | ratio (runs: min-max) | "
             "ratio, check over gloo | ratio, check off |", "|---|---|---|---|---|---|---|"]
    worst = float("inf")
    for nproc in (2, 4):
        for mib in sizes:
            rs = [res[str(mib)] for res in allreduce[nproc]]
            ratio = med(rs, "neuron_ratio")
            worst = min(worst, ratio)
            spread = [r["neuron_ratio"] for r in rs]
            lines.append(f"| {nproc} | {mib} MiB | {med(rs, 'neuron_busbw') / 1e9:.2f} | "
                         f"{med(rs, 'gloo_busbw') / 1e9:.2f} | {ratio:.2f}x "
                         f"({min(spread):.2f}-{max(spread):.2f}) | "
                         f"{med(rs, 'over_gloo_ratio'):.2f}x | {med(rs, 'unchecked_ratio'):.2f}x |")
            print(lines[-1], flush=True)
    ddp_ratio = med(ddps, "ratio")
    per_run = ", ".join(f"{d['ratio']:.2f}" for d in ddps)
    ddp_line = (f"DDP step, GPT (dim 256, 4 layers, seq 128, 8 sequences/rank, AdamW), 2 ranks: "
                f"neuron {med(ddps, 'neuron') * 1e3:.1f} ms vs CPU+gloo "
                f"{med(ddps, 'cpu') * 1e3:.1f} ms, ratio {ddp_ratio:.2f}x (per run: median over "
                f"{ddps[0]['steps']} alternating step pairs after 2 warm-up; runs: {per_run})")
    print(ddp_line)
    print(f"worst all_reduce ratio {worst:.2f}x (target >= 0.9x); DDP {ddp_ratio:.2f}x "
          "(target <= 1.1x)")
    if a.write:
        cmd = ("cd /work/main && .venv/bin/python bench/bench_distributed.py"
               + (" --quick" if a.quick else f" --reps {reps} --runs {runs}") + " --write")
        section = "\n".join([
            "## Distributed", "",
            f"Command: `{cmd}` ({os.cpu_count()} CPU cores shared with other jobs; ranks are "
            "local processes, gloo over loopback TCP).", "",
            f"all_reduce float32, bus bandwidth = 2(p-1)/p x bytes / time. In each run, each "
            "repetition times every variant back to back (order reversed every other "
            f"repetition; max({reps}, {reps * 8} / MiB) repetitions per size) and a run's ratio "
            "(to gloo on CPU tensors, higher is better) is the median of its per-repetition "
            f"ratios; the table gives medians over {runs} runs. \"check over gloo\": the "
            "agreement as a gloo round trip, as for a group spanning hosts "
            "(`TORCH_NEURONX_DIST_CHECK=gloo`); \"check off\": `TORCH_NEURONX_DIST_CHECK=0`.", "",
            *lines, "",
            f"Worst all_reduce ratio: {worst:.2f}x (target >= 0.9x).", "",
            ddp_line + " (target <= 1.1x).", ""])
        _write_section(REPO / "bench" / "RESULTS.md", "Distributed", section)


def _write_section(path: Path, title: str, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda m: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()
