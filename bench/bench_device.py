"""Eager neuron device against plain CPU PyTorch, measured in the same process.

Each measurement alternates CPU and neuron runs (paired) and reports the median ratio, so
machine noise hits both sides alike. Run: .venv/bin/python bench/bench_device.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_neuronx
from torch_neuronx.demo.gpt import GPT, GPTConfig


def _time(fn, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def paired(make_cpu, make_dev, pairs, reps):
    """Median of per-pair (device time / CPU time) and the median times."""
    cpu_fn, dev_fn = make_cpu(), make_dev()
    cpu_fn(), dev_fn()  # warm-up
    ratios, tc, td = [], [], []
    for _ in range(pairs):
        c = _time(cpu_fn, reps)
        d = _time(dev_fn, reps)
        ratios.append(d / c)
        tc.append(c)
        td.append(d)
    return statistics.median(ratios), statistics.median(tc), statistics.median(td)


def gpt_step(device, autocast, hidden=256, layers=4, batch=16, block=128):
    cfg = GPTConfig(n_layer=layers, n_embd=hidden, n_head=8, block_size=block)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randint(0, 256, (batch, block), device=device)
    y = torch.randint(0, 256, (batch, block), device=device)

    def step():
        with torch.autocast(device.type if isinstance(device, torch.device) else device,
                            dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory-only", action="store_true")
    args = ap.parse_args()
    if args.memory_only:
        return memory(args)
    pairs = 3 if args.quick else 7
    rows = []

    for autocast in (False, True):
        r, c, d = paired(lambda: gpt_step("cpu", autocast), lambda: gpt_step("neuron", autocast),
                         pairs, 3)
        rows.append((f"GPT train step (h256, 4 layers, {'bf16 autocast' if autocast else 'fp32'})",
                     c, d, r, "<= 1.05"))

    def mm(dev):
        a = torch.randn(1024, 1024, device=dev)
        b = torch.randn(1024, 1024, device=dev)
        return lambda: torch.mm(a, b)
    r, c, d = paired(lambda: mm("cpu"), lambda: mm("neuron"), pairs, 10)
    rows.append(("matmul 1024x1024 fp32", c, d, r, "throughput >= 0.95 (ratio <= 1.053)"))

    def ew(dev):
        a = torch.randn(1 << 24, device=dev)
        b = torch.randn(1 << 24, device=dev)
        return lambda: torch.add(a, b).mul_(0.5).relu_()
    r, c, d = paired(lambda: ew("cpu"), lambda: ew("neuron"), pairs, 5)
    rows.append(("elementwise add+mul_+relu_, 16M fp32", c, d, r, "throughput >= 0.95 (ratio <= 1.053)"))

    def tiny(dev):
        a = torch.ones(1, device=dev)
        b = torch.ones(1, device=dev)
        return lambda: torch.add(a, b)
    r, c, d = paired(lambda: tiny("cpu"), lambda: tiny("neuron"), pairs, 20000)
    rows.append(("tiny op dispatch (add of 1 element)", c, d, r, "<= 2.0"))

    print(f"{'benchmark':<48}{'cpu':>12}{'neuron':>12}{'ratio':>8}  target")
    for name, c, d, r, target in rows:
        unit, k = ("us", 1e6) if c < 1e-3 else ("ms", 1e3)
        print(f"{name:<48}{c * k:>9.2f} {unit}{d * k:>9.2f} {unit}{r:>8.3f}  {target}")

    asynchronous(pairs)
    memory(args)


def _in_mode(make, blocking):
    def build():
        torch_neuronx.set_launch_blocking(blocking)
        fn = make()
        fn()

        def run():
            torch_neuronx.set_launch_blocking(blocking)
            fn()
            torch.neuron.synchronize()
        return run
    return build


def asynchronous(pairs):
    # Asynchronous launch against NEURON_LAUNCH_BLOCKING-style synchronous execution, both
    # on neuron: ratio = async time / blocking time (lower is better).
    def small_ops():
        a = torch.randn(64, device="neuron")
        b = torch.randn(64, device="neuron")

        def loop():
            x = a
            for _ in range(500):
                x = torch.add(x, b).mul_(0.5).relu_()
        return loop
    rows = []
    r, bl, asy = paired(_in_mode(small_ops, True), _in_mode(small_ops, False), pairs, 5)
    rows.append(("loop of 1500 small ops (64 elements)", bl, asy, r, "<= 1.0"))
    r, bl, asy = paired(_in_mode(lambda: gpt_step("neuron", False), True),
                        _in_mode(lambda: gpt_step("neuron", False), False), pairs, 3)
    rows.append(("GPT train step (h256, 4 layers, fp32)", bl, asy, r, "<= 1.0"))
    torch_neuronx.set_launch_blocking(False)
    print(f"{'async vs blocking':<48}{'blocking':>12}{'async':>12}{'ratio':>8}  target")
    for name, c, d, r, target in rows:
        print(f"{name:<48}{c * 1e3:>9.2f} ms{d * 1e3:>9.2f} ms{r:>8.3f}  {target}")
    step = gpt_step("neuron", False)
    step()
    torch_neuronx.queue_stats(reset=True)
    before = torch_neuronx.queue_stats()["launched"]
    step()
    st = torch_neuronx.queue_stats()
    print(f"GPT step: {st['launched'] - before} queued launches; ran synchronously: "
          f"{st['synchronous_ops']}")


def memory(args):
    # Memory: 1000 training steps return to baseline; reserved stays near the peak.
    steps = 200 if args.quick else 1000
    torch.neuron.empty_cache()  # forget the blocks the benchmarks above left cached
    step = gpt_step("neuron", False, hidden=128, layers=2, batch=8, block=64)
    for _ in range(3):
        step()
    base = torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    for _ in range(steps):
        step()
    after = torch.neuron.memory_allocated()
    peak = torch.neuron.max_memory_allocated()
    reserved = torch.neuron.max_memory_reserved()
    print(f"memory over {steps} steps: allocated {base} -> {after} bytes "
          f"({'no leak' if after == base else 'LEAK'}), peak reserved/peak allocated = "
          f"{reserved / peak:.3f} (target <= 1.25)")
    t = torch_neuronx.modelled_time(reset=True)
    print(f"modelled trn2 time of the memory run: {t.seconds * 1e3 / steps:.3f} ms/step")


if __name__ == "__main__":
    main()
