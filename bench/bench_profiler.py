"""Parquet export of a 100k-event trace (target < 5 s), the NKI simulator's per-instruction
cost with kernel source lines recorded (as while a NeuronProfiler collects) vs not, and
profiler overhead on the demo GPT train step: neuron with host ops only, with the Kineto
plugin's device events, and with stacks, vs CPU's own profiler overhead on CPU (medians of
rounds interleaving the modes; each device in a process of its own, since in a shared process
the device's OpenMP team slows the CPU side and the profiled modes unevenly, see
bench/_fresh_pairs.py)."""
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import torch_neuronx  # noqa: F401
from torch_neuronx.demo.gpt import GPT, GPTConfig, make_step
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler, export_parquet


def _export_100k():
    dev = [(i % 2, i % 4, ("add", "mm", "relu")[i % 3], "op", 1e-6 * (1 + i % 7), 1) for i in range(100_000)]
    times = []
    for _ in range(3):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            export_parquet(d, device_events=dev)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _nki_source_lines():
    """(us per instruction off, on, median on/off ratio) of nki.benchmark on small tiles,
    source-line recording alternating in one process."""
    import numpy as np
    from bench_nki import small_ops  # (bench/ is on the path when run as a script)

    import nki
    from nki.simulator import context

    x = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
    bm, iters = nki.benchmark(small_ops), 1000
    bm(x, 10)

    def one(flag):
        context.record_source = flag
        try:
            t0 = time.perf_counter()
            bm(x, iters)
            return (time.perf_counter() - t0) / (3 * iters + 1) * 1e6
        finally:
            context.record_source = False

    off, on = [], []
    for i in range(9):  # alternating which goes first
        pair = (one(True), one(False)) if i % 2 else (one(False), one(True))[::-1]
        on.append(pair[0])
        off.append(pair[1])
    return (statistics.median(off), statistics.median(on),
            statistics.median(a / b for a, b in zip(on, off)))


STEPS = 5  # per profiled session, so profiler start/stop is part of the cost but not all of it


# Modes: off; host ops only; with device events (on neuron: the Kineto plugin's kernels, the
# PrivateUse1 activity; on CPU its ops are its device work); the same with Python stacks.
MODES = ("off", "host", "events", "stack")


def _activities(device, mode):
    act = [torch.profiler.ProfilerActivity.CPU]
    if device == "neuron" and mode in ("events", "stack"):
        act.append(torch.profiler.ProfilerActivity.PrivateUse1)
    return act


def _timed(device, mode, step, x, y, tmp):
    def run():
        for _ in range(STEPS):
            loss = step(x, y)
        loss.item()
    t0 = time.perf_counter()
    if mode == "off":
        run()
    else:
        cfg = NeuronConfig(profile_output_dir=tmp)
        handler = NeuronProfiler(cfg) if device == "neuron" else None
        with torch.profiler.profile(activities=_activities(device, mode),
                                    with_stack=(mode == "stack"), experimental_config=cfg):
            run()
        if handler is not None:
            handler.close()
    return (time.perf_counter() - t0) / STEPS


def _overheads(device):
    """One process, one device: medians over rounds that interleave the modes."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = GPT(GPTConfig()).to(device)
        step = make_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        x = torch.randint(0, 256, (8, 64), device=device)
        setup = (step, x, x.roll(1, 1))
        t = {m: [] for m in MODES}
        for rep in range(9):
            for m, v in t.items():
                sec = _timed(device, m, *setup, tmp)
                if rep:  # the first round warms up
                    v.append(sec)
    med = {m: statistics.median(t[m]) for m in MODES}
    print(f"{device}: GPT train step {med['off'] * 1e3:.1f} ms; profiled/unprofiled: host ops "
          f"{med['host'] / med['off']:.2f}x, with device events "
          f"{med['events'] / med['off']:.2f}x, with stacks {med['stack'] / med['off']:.2f}x "
          f"(targets on neuron: events <= 1.3x, stacks <= 2x)", flush=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--device":
        return _overheads(sys.argv[2])
    print(f"parquet export, 100k events: median {_export_100k():.2f} s (target < 5 s)")
    off, on, ratio = _nki_source_lines()
    print(f"NKI simulator with timing, per instruction: {off:.1f} us, with kernel source lines "
          f"{on:.1f} us (median of paired ratios {ratio:.3f}x)", flush=True)
    for device in ("neuron", "cpu"):
        out = subprocess.run([sys.executable, __file__, "--device", device], check=True,
                             capture_output=True, text=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
