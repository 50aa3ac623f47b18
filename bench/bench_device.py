"""Eager neuron device against plain CPU PyTorch.

Each measurement alternates CPU and neuron runs (paired) and reports the median ratio, so
machine noise hits both sides alike. The GPT training steps run each side in a fresh process
(``_fresh_pairs``: in a shared one the device's OpenMP team slows the CPU steps after it);
``--same-process`` times them back to back in this process, as the other rows are.
Run: .venv/bin/python bench/bench_device.py [--quick] [--same-process]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import torch_neuronx
from torch_neuronx.demo.gpt import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fresh_pairs  # noqa: E402  (bench/, this script's directory)


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


def _one_gpt(device, autocast, reps):
    """In a fresh process: the median of 3 timings of ``reps`` steps after 2 warm-up steps."""
    step = gpt_step(device, autocast)
    step(), step()
    return statistics.median(_time(step, reps) for _ in range(3))


def gpt_fresh(autocast, pairs, reps):
    def run(device):
        return _fresh_pairs.seconds_in_fresh_process(
            os.path.abspath(__file__), ["--one", device, "bf16" if autocast else "fp32", str(reps)])
    r, c, d, _ = _fresh_pairs.alternating(lambda: run("cpu"), lambda: run("neuron"), pairs)
    return r, c, d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--same-process", action="store_true",
                    help="GPT steps of both devices in this process (flatters neuron)")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        device, autocast, reps = args.one
        return print(_one_gpt(device, autocast == "bf16", int(reps)))
    if args.memory_only:
        return memory(args)
    pairs = 3 if args.quick else 7
    rows = []

    for autocast in (False, True):
        if args.same_process:
            r, c, d = paired(lambda: gpt_step("cpu", autocast),
                             lambda: gpt_step("neuron", autocast), pairs, 3)
        else:
            r, c, d = gpt_fresh(autocast, pairs, 3)
        rows.append((f"GPT train step (h256, 4 layers, {'bf16 autocast' if autocast else 'fp32'})",
                     c, d, r, "<= 1.05"))

    def done(dev):
        # Device work is asynchronous: a measurement ends when the device is idle.
        return torch.neuron.synchronize if dev == "neuron" else (lambda: None)

    def mm(dev):
        a = torch.randn(1024, 1024, device=dev)
        b = torch.randn(1024, 1024, device=dev)
        sync = done(dev)
        return lambda: (torch.mm(a, b), sync())
    r, c, d = paired(lambda: mm("cpu"), lambda: mm("neuron"), pairs, 10)
    rows.append(("matmul 1024x1024 fp32", c, d, r, "throughput >= 0.95 (ratio <= 1.053)"))

    def ew(dev):
        a = torch.randn(1 << 24, device=dev)
        b = torch.randn(1 << 24, device=dev)
        sync = done(dev)
        kept = []  # the result stays referenced, as a program's would

        def run():
            kept[:] = [torch.add(a, b).mul_(0.5).relu_()]
            sync()
        return run
    r, c, d = paired(lambda: ew("cpu"), lambda: ew("neuron"), pairs, 5)
    rows.append(("elementwise add+mul_+relu_, 16M fp32", c, d, r, "throughput >= 0.95 (ratio <= 1.053)"))

    def tiny(dev):
        a = torch.ones(1, device=dev)
        b = torch.ones(1, device=dev)
        sync = done(dev)

        def run():
            for _ in range(1000):
                torch.add(a, b)
            sync()
        return run
    r, c, d = paired(lambda: tiny("cpu"), lambda: tiny("neuron"), pairs, 20)
    rows.append(("tiny op (add of 1 element), per op", c / 1000, d / 1000, r, "<= 2.0"))

    def grouped(dev):
        # a small MoE layer's grouped GEMM: the per-call cost of the Python kernel's path
        a = torch.randn(32, 16, device=dev)
        b = torch.randn(4, 16, 16, device=dev)
        offs = torch.tensor([6, 16, 20, 32], dtype=torch.int32, device=dev)
        sync = done(dev)

        def run():
            for _ in range(200):
                torch._grouped_mm(a, b, offs=offs)
            sync()
        return run
    r, c, d = paired(lambda: grouped("cpu"), lambda: grouped("neuron"), pairs, 5)
    rows.append(("_grouped_mm 32x16 by 4x16x16 fp32, per call", c / 200, d / 200, r, "report"))

    print(f"{'benchmark':<48}{'cpu':>12}{'neuron':>12}{'ratio':>8}  target")
    for name, c, d, r, target in rows:
        unit, k = ("us", 1e6) if c < 1e-3 else ("ms", 1e3)
        print(f"{name:<48}{c * k:>9.2f} {unit}{d * k:>9.2f} {unit}{r:>8.3f}  {target}")

    asynchronous(pairs)
    adaptive_eager(pairs)
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
    def big_ops():
        # Memory-bound kernels run by the executor's parallel loop: a host spinning while it
        # waits would take a core from them.
        x = torch.randn(8192, 1024, device="neuron")
        m = x.amax(-1, keepdim=True)
        o = torch.empty_like(x)

        def ops():
            torch.sub(x, m, out=o)
            x.amax(-1, keepdim=True)
        return ops
    def mid_ops():
        # Work of tens of microseconds per op: a host that slept while waiting would pay a
        # wake-up per synchronize.
        x = torch.randn(64, 1024, device="neuron")

        def ops():
            for _ in range(20):
                e = torch.exp(x - x.amax(-1, keepdim=True))
                (e / e.sum(-1, keepdim=True)).sum().item()
        return ops
    rows = []
    r, bl, asy = paired(_in_mode(small_ops, True), _in_mode(small_ops, False), pairs, 5)
    rows.append(("loop of 1500 small ops (64 elements)", bl, asy, r, "<= 1.0"))
    r, bl, asy = paired(_in_mode(big_ops, True), _in_mode(big_ops, False), pairs, 10)
    rows.append(("memory-bound ops (32 MB sub + row max)", bl, asy, r, "<= 1.0"))
    r, bl, asy = paired(_in_mode(mid_ops, True), _in_mode(mid_ops, False), pairs, 3)
    rows.append(("20 x (softmax 64x1024 written out, .item())", bl, asy, r, "<= 1.0"))
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


def _with_aee(make, on):
    def build():
        torch_neuronx.set_adaptive_eager(on)
        fn = make()
        fn()
        fn()  # the first call of each signature runs synchronously

        def run():
            torch_neuronx.set_adaptive_eager(on)
            # The result stays referenced until the device is done, as a program's would:
            # a dropped result is an intermediate nobody reads, and fusion skips writing it.
            out = fn()
            torch.neuron.synchronize()
            del out
        return run
    return build


def _blocks():
    # Memory-bound eager blocks written as users write them (hidden size 1024, tens of MB).
    rows, hidden = 8192, 1024
    x = torch.randn(rows, hidden, device="neuron")
    w = torch.randn(hidden, device="neuron")
    cos = torch.randn(rows, hidden // 2, device="neuron")
    sin = torch.randn(rows, hidden // 2, device="neuron")

    def gelu():
        return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))

    def rmsnorm():
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def layernorm():
        mu = x.mean(-1, keepdim=True)
        d = x - mu
        return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w

    def rope():
        x1, x2 = x[:, : hidden // 2], x[:, hidden // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    def softmax():
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    short = x.view(-1, 128)  # attention-score-like rows of 128

    def softmax_short():
        e = torch.exp(short - short.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    params = [torch.randn(1 << 20, device="neuron") for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)

    def adamw():
        opt.step()
    return {"GELU (tanh form, 8M elements)": gelu, "RMSNorm (8192x1024)": rmsnorm,
            "LayerNorm written out (8192x1024)": layernorm, "RoPE (8192x1024)": rope,
            "softmax written out (8192x1024)": softmax, "softmax, short rows (65536x128)": softmax_short,
            "AdamW foreach step (8x4 MB)": adamw}


def adaptive_eager(pairs):
    # Adaptive Eager on vs off, both asynchronous on neuron: ratio = off time / on time
    # (speed-up; higher is better).
    print(f"{'Adaptive Eager (on vs off)':<48}{'off':>12}{'on':>12}{'speedup':>9}  launches")
    for name, fn in _blocks().items():
        r, on, off = paired(_with_aee(lambda fn=fn: fn, True), _with_aee(lambda fn=fn: fn, False),
                            pairs, 5)
        torch_neuronx.set_adaptive_eager(True)
        torch_neuronx.adaptive_eager_stats(reset=True)
        fn()
        torch.neuron.synchronize()
        st = torch_neuronx.adaptive_eager_stats()
        print(f"{name:<48}{off * 1e3:>9.2f} ms{on * 1e3:>9.2f} ms{r:>8.2f}x  "
              f"{st['ops']} -> {st['kernels']}")
    r, on, off = paired(_with_aee(lambda: gpt_step("neuron", False), True),
                        _with_aee(lambda: gpt_step("neuron", False), False), pairs, 3)
    step = gpt_step("neuron", False)
    step()
    for on_ in (False, True):
        torch_neuronx.set_adaptive_eager(on_)
        step()
        torch_neuronx.adaptive_eager_stats(reset=True)
        torch_neuronx.reset_modelled_time()
        step()
        st = torch_neuronx.adaptive_eager_stats()
        t = torch_neuronx.modelled_time()
        print(f"GPT step, Adaptive Eager {'on ' if on_ else 'off'}: {st['ops']} ops -> "
              f"{st['kernels']} kernels, modelled trn2 {t.seconds * 1e3:.3f} ms")
    print(f"GPT train step (h256, 4 layers, fp32): off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms, "
          f"on/off time {1 / r:.3f} (target <= 1/0.97 = 1.031)")
    torch_neuronx.set_adaptive_eager(True)


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
