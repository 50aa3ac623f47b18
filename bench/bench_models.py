"""Model families (examples/models) on neuron against the CPU, paired runs.

Per family: one fp32 training step, neuron eager / CPU eager, and with the forward compiled,
neuron ("neuron" backend) / CPU (Inductor); plus the modelled Trainium time of a neuron step
and the engine that bounds it. By default each pair is two fresh processes (``_fresh_pairs``:
CPU and neuron, the order alternating), each timing ``--steps`` warmed-up steps and reporting
their median; ratios are medians over pairs. ``--same-process`` times single steps back to
back in this process instead, which slows the CPU peer and so flatters neuron. Run: .venv/bin/python bench/bench_models.py
[--pairs N] [--steps S] [--eager-only] [--family NAME ...] [--same-process
[--autograd-device-thread]] [--modelled-only]

``--autograd-device-thread``: each pair also times the neuron step with backward on autograd's
device thread (the behaviour before the device ran it on the calling thread), before or
after the default one in turn, and prints that ratio too: baseline and change, same pairs.
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import sys
import time

import torch

import torch_neuronx

# CPU and neuron copies of a family run the same model code, so Dynamo keeps one compiled
# entry per device (and per train/eval mode) for each frame: the default limit of 8 makes the
# alternating pairs recompile and then fall back to eager, which would time neither compiler.
torch._dynamo.config.recompile_limit = 64
torch._dynamo.config.accumulated_recompile_limit = 4096

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "models"))
_harness = importlib.import_module("_harness")
import _fresh_pairs  # noqa: E402  (bench/, this script's directory)

FAMILIES = [("text_llama", "FAMILY"), ("vlm_llava", "FAMILY"), ("image_dit", "FAMILY"),
            ("video_wan", "FAMILY"), ("ssm_mamba", "FAMILY"), ("world_rssm", "FAMILY"),
            ("moe_mixtral", "FAMILY"), ("moe_mixtral", "GROUPED")]


def _timed(step, device, autograd_thread=False):
    t0 = time.perf_counter()
    with torch.autograd.set_multithreading_enabled(autograd_thread):
        step()
    if device != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - t0


def paired(fam, cpu_backend, dev_backend, pairs, warmup, baseline=False):
    _, _, _, cpu = _harness.trainer(fam, "cpu", compile_backend=cpu_backend)
    _, _, _, dev = _harness.trainer(fam, "neuron", compile_backend=dev_backend)
    for _ in range(warmup):
        cpu(), dev()
        if baseline:
            _timed(dev, "neuron", autograd_thread=True)
    ratios, tc, td, base = [], [], [], []
    for i in range(pairs):
        c = _timed(cpu, "cpu")
        if baseline and i % 2:  # the baseline goes first in every other pair: no order bias
            base.append(_timed(dev, "neuron", autograd_thread=True) / c)
        d = _timed(dev, "neuron")
        if baseline and not i % 2:
            base.append(_timed(dev, "neuron", autograd_thread=True) / c)
        ratios.append(d / c)
        tc.append(c)
        td.append(d)
    seconds, bound = modelled_step(dev)
    return (statistics.median(ratios), statistics.median(tc), statistics.median(td), seconds,
            bound, statistics.median(base) if base else None)


def _one(module, attr, device, backend, steps, warmup):
    """In a fresh process: the median of ``steps`` timed steps after ``warmup`` untimed ones."""
    fam = getattr(importlib.import_module(module), attr)
    _, _, _, step = _harness.trainer(fam, device, compile_backend=backend)
    for _ in range(warmup):
        step()
    return statistics.median(_timed(step, device) for _ in range(steps))


def paired_fresh(module, attr, cpu_backend, dev_backend, pairs, warmup, steps):
    def run(device, backend):
        return _fresh_pairs.seconds_in_fresh_process(
            __file__, ["--one", module, attr, device, backend or "none", str(steps), str(warmup)])
    r, c, d, _ = _fresh_pairs.alternating(lambda: run("cpu", cpu_backend),
                                          lambda: run("neuron", dev_backend), pairs)
    fam = getattr(importlib.import_module(module), attr)
    _, _, _, dev = _harness.trainer(fam, "neuron", compile_backend=dev_backend)
    for _ in range(warmup):
        dev()
    seconds, bound = modelled_step(dev)
    return r, c, d, seconds, bound, None


def modelled_step(dev):
    """The modelled time of one more step on neuron, and the engine charged most."""
    torch.accelerator.synchronize()
    torch_neuronx.reset_modelled_time()
    dev()
    torch.accelerator.synchronize()
    t = torch_neuronx.modelled_time()
    return t.seconds, (max(t.by_engine, key=t.by_engine.get) if t.by_engine else "-")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=9, help="timed steps per process (fresh-process pairs)")
    ap.add_argument("--same-process", action="store_true",
                    help="single steps back to back in this process (flatters neuron: see above)")
    ap.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--eager-only", action="store_true")
    ap.add_argument("--family", nargs="*", help="module names, e.g. image_dit")
    ap.add_argument("--autograd-device-thread", action="store_true",
                    help="also time backward on autograd's device thread (the baseline)")
    ap.add_argument("--modelled-only", action="store_true",
                    help="no host timing: the modelled time of a neuron step, eager and compiled "
                         "(deterministic; NEURON_PLATFORM_TARGET_OVERRIDE picks the chip)")
    args = ap.parse_args()
    if args.one:
        module, attr, device, backend, steps, warmup = args.one
        print(_one(module, attr, device, None if backend == "none" else backend, int(steps),
                   int(warmup)))
        return
    if args.autograd_device_thread and not args.same_process:
        ap.error("--autograd-device-thread needs --same-process")
    platform = torch_neuronx.modelled_time().platform
    if args.modelled_only:
        for module, attr in FAMILIES:
            if args.family and module not in args.family:
                continue
            fam = getattr(importlib.import_module(module), attr)
            row = []
            for backend, warm in ((None, 2), ("neuron", 3)):
                _, _, _, dev = _harness.trainer(fam, "neuron", compile_backend=backend)
                for _ in range(warm):
                    dev()
                seconds, bound = modelled_step(dev)
                row.append(f"{seconds * 1e3:.3f} ms ({bound})")
            print(f"{fam.name:36s} modelled {platform} eager / compiled: {row[0]} / {row[1]}",
                  flush=True)
        return
    print(f"{'family':36s} {'mode':9s} {'cpu ms':>9s} {'neuron ms':>10s} {'ratio':>7s} "
          f"{'modelled ' + platform + ' ms':>18s}  bound   target")
    for module, attr in FAMILIES:
        if args.family and module not in args.family:
            continue
        fam = getattr(importlib.import_module(module), attr)
        modes = [("eager", None, None, 2)]
        if not args.eager_only:
            modes.append(("compiled", "inductor", "neuron", 3))
        for label, cpu_b, dev_b, warm in modes:
            try:
                if args.same_process:
                    r, c, d, m, bound, base = paired(fam, cpu_b, dev_b, args.pairs, warm,
                                                     args.autograd_device_thread)
                else:
                    r, c, d, m, bound, base = paired_fresh(module, attr, cpu_b, dev_b,
                                                           args.pairs, warm, args.steps)
            except Exception as e:  # report and go on: one family must not hide the others
                print(f"{fam.name:36s} {label:9s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            print(f"{fam.name:36s} {label:9s} {c * 1e3:9.2f} {d * 1e3:10.2f} {r:7.3f} {m * 1e3:18.3f}  "
                  f"{bound:7s} <= 1.05"
                  + (f"  (autograd device thread: {base:.3f})" if base is not None else ""),
                  flush=True)


if __name__ == "__main__":
    main()
