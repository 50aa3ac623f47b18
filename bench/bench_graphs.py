"""torch.accelerator.Graph replay against the same training step run eagerly, on neuron and
on plain CPU PyTorch, in one process with paired runs (medians of per-pair ratios).

Run: .venv/bin/python bench/bench_graphs.py [--pairs N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_neuronx  # noqa: F401
from torch_neuronx.demo.gpt import GPT, GPTConfig


def _setup(dev):
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=dev != "cpu")
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size)).to(dev)

    def step():
        opt.zero_grad(set_to_none=False)
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        return loss
    for _ in range(2):
        step()
    return step


def _timed(fn, sync, reps=5):
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=7)
    args = ap.parse_args()
    cpu_step, dev_step = _setup("cpu"), _setup("neuron")
    g = torch.accelerator.Graph()
    with g:
        dev_step()
    g.replay()
    nsync = torch.neuron.synchronize
    rows = {"replay / neuron eager": [], "replay / CPU eager": [], "neuron eager / CPU eager": []}
    times = {"cpu": [], "eager": [], "replay": []}
    for _ in range(args.pairs):
        tc = _timed(cpu_step, lambda: None)
        te = _timed(dev_step, nsync)
        tr = _timed(g.replay, nsync)
        times["cpu"].append(tc), times["eager"].append(te), times["replay"].append(tr)
        rows["replay / neuron eager"].append(tr / te)
        rows["replay / CPU eager"].append(tr / tc)
        rows["neuron eager / CPU eager"].append(te / tc)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"GPT train step (demo config, batch 4, AdamW): CPU eager {med['cpu']:.1f} ms, "
          f"neuron eager {med['eager']:.1f} ms, neuron graph replay {med['replay']:.1f} ms")
    for k, v in rows.items():
        print(f"  {k:<28} {statistics.median(v):.3f}")


if __name__ == "__main__":
    main()
