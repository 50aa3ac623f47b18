"""Low-precision matmuls on neuron, measured in the same process as their peers.

Each measurement alternates the two sides (paired) and reports median times and the median
per-pair ratio, so machine noise hits both alike:

* FP8 tensorwise ``torch._scaled_mm`` on neuron against CPU's ``torch._scaled_mm``, at 512^3
  (target <= 1.1x). Neuron's results are CPU's bits: it runs CPU's kernel on the device
  tensors' memory, except where CPU's is oneDNN's reference kernel (hosts with AMX-int8,
  0.05-0.1 GFLOPS), whose summation order neuron's own kernel repeats much faster;
* blockwise (1x128 x 128x128) and MX (MXFP8, MXFP4) ``_scaled_mm`` on neuron, which CPU does
  not have, against a BF16 matmul of the same shape on neuron (target <= 3x host time; at
  512^3, since a BF16 matmul on a host without BF16 instructions takes seconds at 1024^3),
  and against an FP32 one for scale;
* the modelled trn2/trn3 time of each, from the cost model.
* a TorchAO float8 training step (tensorwise, rowwise) against the bf16 step, host time and
  modelled trn2 time, eager and compiled (``bench_torchao``); with ``--large`` also at
  a larger shape (Linear 1024->4096->1024, 2048 tokens: the bf16 step's matmuls are 57% of
  its modelled time), to see how the casts' HBM traffic and the FP8 matmul saving scale;
  with ``--matmul-bound`` at shapes where the FP8 saving outgrows the casts (contraction dims
  of several thousand). On a host without BF16 instructions, where that bf16 step takes
  hours, ``--bf16-from-fp32`` runs it in fp32 under ``torch_neuronx.price_as(torch.bfloat16)``:
  charged as the bf16 step (tests/device/test_price_as.py), its host time fp32's.

Run: .venv/bin/python bench/bench_precision.py [--quick] [--large] [--matmul-bound [--bf16-from-fp32]]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.functional import ScalingType as S, SwizzleType as W
from torch.testing._internal.common_quantized import to_blocked, to_mxfp

import neuronhw
import torch_neuronx
from torch_neuronx import cost_model

DEV = "neuron"
# Linear d->ffn->d over tokens, matmul-bound: each dim large enough for FP8's TensorE saving
# to outgrow the casts' traffic (bench/RESULTS.md, "Low precision")
MATMUL_BOUND = ((4096, 16384, 4096),)


def _time(fn, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def paired(make_ref, make_dev, pairs, reps):
    """Median of per-pair (device time / reference time) and the median times."""
    ref_fn, dev_fn = make_ref(), make_dev()
    ref_fn(), dev_fn()  # warm-up
    ratios, tr, td = [], [], []
    for _ in range(pairs):
        r = _time(ref_fn, reps)
        d = _time(dev_fn, reps)
        ratios.append(d / r)
        tr.append(r)
        td.append(d)
    return statistics.median(ratios), statistics.median(tr), statistics.median(td)


def _done(dev):
    # Device work is asynchronous: a measurement ends when the device is idle.
    return torch.neuron.synchronize if dev == DEV else (lambda: None)


def _report(rows, header):
    print(f"{'benchmark':<58}{header[0]:>12}{header[1]:>12}{'ratio':>8}  target")
    for name, r, d, ratio, target in rows:
        print(f"{name:<58}{r * 1e3:>9.2f} ms{d * 1e3:>9.2f} ms{ratio:>8.3f}  {target}")


def _fp8_operands(m, k, n, dev):
    a = torch.randn(m, k).to(torch.float8_e4m3fn).to(dev)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).to(dev).t()
    return a, b


def tensorwise_vs_cpu(pairs, size):
    """FP8 tensorwise _scaled_mm: neuron against CPU."""
    def make(dev):
        a, b = _fp8_operands(size, size, size, dev)
        one = torch.tensor(1.0, device=dev)
        sync = _done(dev)
        return lambda: (torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), sync())
    r, c, d = paired(lambda: make("cpu"), lambda: make(DEV), pairs, 5)
    return [(f"_scaled_mm tensorwise e4m3 {size}^3 -> bf16 vs CPU", c, d, r, "<= 1.1")]


def _mm(size, dtype):
    a = torch.randn(size, size, device=DEV, dtype=dtype)
    b = torch.randn(size, size, device=DEV, dtype=dtype)
    return lambda: (torch.mm(a, b), torch.neuron.synchronize())


def _blockwise(size):
    a, b = _fp8_operands(size, size, size, DEV)
    kb = size // 128
    sa = (torch.rand(kb, size) + 0.5).t().to(DEV)          # 1x128, outer-dim-major
    sb = (torch.rand(kb, kb) + 0.5).t().to(DEV)            # 128x128 for (K, N), column-major
    return lambda: (torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16), torch.neuron.synchronize())


def _mx(size, fmt):
    x, w = torch.randn(size, size), torch.randn(size, size)
    if fmt == "mxfp4":
        x, w = x.bfloat16(), w.bfloat16()
    sa, qa = to_mxfp(x, format=fmt)
    sb, qb = to_mxfp(w, format=fmt)
    qa, qb = qa.to(DEV), qb.to(DEV).t()
    bsa, bsb = to_blocked(sa).to(DEV), to_blocked(sb).to(DEV)

    def run():
        F.scaled_mm(qa, qb, bsa, S.BlockWise1x32, bsb, S.BlockWise1x32,
                    swizzle_a=W.SWIZZLE_32_4_4, swizzle_b=W.SWIZZLE_32_4_4)
        torch.neuron.synchronize()
    return run


def blockwise_and_mx_vs_bf16(pairs, size):
    """Blockwise and MX _scaled_mm on neuron against a BF16 matmul on neuron (the target) and
    an FP32 one (for scale: this host's BF16 matmul is far slower than its FP32 one)."""
    rows = []
    cases = {"blockwise 1x128 x 128x128 e4m3": lambda: _blockwise(size),
             "MXFP8 e4m3 (E8M0 per 32, swizzled)": lambda: _mx(size, "mxfp8"),
             "MXFP4 e2m1 (E8M0 per 32, swizzled)": lambda: _mx(size, "mxfp4")}
    for name, make in cases.items():
        r, c, d = paired(lambda: _mm(size, torch.bfloat16), make, pairs, 3)
        rows.append((f"{name} {size}^3 vs bf16 mm", c, d, r, "<= 3"))
        r, c, d = paired(lambda: _mm(size, torch.float32), make, pairs, 3)
        rows.append((f"{name} {size}^3 vs fp32 mm", c, d, r, "(for scale)"))
    return rows


def grouped_mx_vs_bf16(pairs, groups=8, m=2048, k=1024, n=1024):
    """MXFP8 _scaled_grouped_mm (2d-3d, a MoE layer's experts) against a bf16 _grouped_mm of
    the same shape, both on neuron."""
    g = torch.Generator().manual_seed(0)
    ends = [(i + 1) * m // groups for i in range(groups)]
    x = torch.randn(m, k, generator=g)
    parts = [to_mxfp(x[s:e]) for s, e in zip([0] + ends[:-1], ends)]
    a = torch.cat([d.view(torch.uint8) for _, d in parts]).view(torch.float8_e4m3fn)
    sa = torch.cat([to_blocked(sc).reshape(-1) for sc, _ in parts]).reshape(-1, ((k // 32 + 3) // 4) * 4)
    ws = [to_mxfp(torch.randn(n, k, generator=g)) for _ in range(groups)]
    b = torch.stack([d for _, d in ws]).transpose(-2, -1)                # (G, K, N), column-major
    sb = torch.stack([to_blocked(sc).reshape(-1) for sc, _ in ws])
    offs = torch.tensor(ends, dtype=torch.int32).to(DEV)
    a, b, sa, sb = (t.to(DEV) for t in (a, b, sa, sb))
    wa = torch.randn(m, k, generator=g).bfloat16().to(DEV)
    wb = torch.randn(groups, k, n, generator=g).bfloat16().to(DEV)

    def mx():
        return lambda: (torch._scaled_grouped_mm(a, b, sa, sb, offs), torch.neuron.synchronize())

    def bf16():
        return lambda: (torch._grouped_mm(wa, wb, offs), torch.neuron.synchronize())
    r, c, d = paired(bf16, mx, pairs, 3)
    return [(f"MXFP8 grouped 2d-3d, {groups} groups, {m}x{k}x{n} vs bf16 _grouped_mm", c, d, r, "(for scale)")]


def modelled(size):
    """Modelled time of one call on each chip, per kind, against BF16 (ratios < 1 are gains)."""
    dims = (1, size, size, size)
    print(f"\nmodelled TensorE time of one {size}^3 matmul (lnc=2):")
    print(f"{'chip':<6}{'bf16':>12}{'fp8':>12}{'mx':>12}{'fp8/bf16':>10}{'mx/bf16':>10}")
    for p in (neuronhw.TRN2, neuronhw.TRN3):
        nbytes = 3 * size * size
        bf16, _, _ = cost_model.op_seconds(p, 2, "mm", [(size, size), (size, size)], torch.bfloat16,
                                           4 * size * size, 2 * size * size)
        fp8, _ = cost_model.scaled_matmul_seconds(p, 2, dims, "float8", nbytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # trn2 has no MX path: charged at BF16, said elsewhere
            mx, _ = cost_model.scaled_matmul_seconds(p, 2, dims, "mx", nbytes)
        print(f"{p.name:<6}{bf16 * 1e3:>9.3f} ms{fp8 * 1e3:>9.3f} ms{mx * 1e3:>9.3f} ms"
              f"{fp8 / bf16:>10.3f}{mx / bf16:>10.3f}")


def bench_torchao(pairs, d, ffn, tokens, priced=False):
    """TorchAO float8 training (tensorwise, rowwise) against the bf16 step, all on neuron:
    host time and the modelled trn2 time of one step, eager and compiled, with the matmuls'
    share (mm or _scaled_mm) apart from the casts around them. ``pairs`` > 0: host time is the
    median of interleaved warm runs; 0 (the larger shape, where one bf16 step takes
    minutes on a host without BF16 instructions): one run per recipe and mode, the eager one
    without warm-up (modelled time does not depend on it). ``priced``: the bf16 step runs
    in fp32 priced as bf16 (``price_as``), and no step upcasts its output for the loss
    (an explicit upcast cannot be told from an fp32 run)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipes = (None, "tensorwise", "rowwise")

    def make(recipe, compiled=False):
        torch.manual_seed(0)
        dtype = torch.float32 if priced and recipe is None else torch.bfloat16
        model = torch.nn.Sequential(torch.nn.Linear(d, ffn, bias=False), torch.nn.GELU(),
                                    torch.nn.Linear(ffn, d, bias=False))
        model = model.to(device=DEV, dtype=dtype)
        if recipe is not None:
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
        run = torch.compile(model, backend="neuron") if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(tokens, d, dtype=dtype).to(DEV)

        def step():
            with (torch_neuronx.price_as(torch.bfloat16) if dtype == torch.float32
                  else contextlib.nullcontext()):
                out = run(x) if priced else run(x).float()
                out.square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.neuron.synchronize()
        if compiled or pairs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torchao's float64 scales: neuron warns once
                step()  # warm-up (and compilation)
        return step

    def modelled_step(step):
        torch_neuronx.reset_modelled_time()
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()
        host = time.perf_counter() - t0
        t = torch_neuronx.modelled_time(reset=True)
        return t.seconds, t.by_op.get("mm", 0.0) + t.by_op.get("_scaled_mm", 0.0), host

    eager = {r: modelled_step(make(r)) for r in recipes}
    compiled = {r: modelled_step(make(r, compiled=True)) for r in recipes}
    if pairs:
        steps = {r: make(r) for r in recipes}
        host = {r: [] for r in recipes}
        for _ in range(pairs):  # interleaved, so machine noise hits every recipe alike
            for r in recipes:
                t0 = time.perf_counter()
                steps[r]()
                host[r].append(time.perf_counter() - t0)
        host_s = {r: statistics.median(host[r]) for r in recipes}
        ratio = {r: statistics.median(f / b for f, b in zip(host[r], host[None])) for r in recipes}
        how = f"median of {pairs} interleaved runs"
    else:
        host_s = {r: eager[r][2] for r in recipes}
        ratio = {r: host_s[r] / host_s[None] for r in recipes}
        how = "one eager run"

    print(f"\nTorchAO float8 training step vs the bf16 step on neuron (Linear {d}->{ffn}, GELU, "
          f"Linear {ffn}->{d}; {tokens} tokens; SGD); host: {how}; "
          "trn2: modelled step (its matmuls alone in brackets)"
          + ("; bf16: run in fp32, priced as bf16 (host time fp32's)" if priced else ""))
    print(f"{'recipe':<12}{'host':>11}{'/bf16':>7}{'trn2 eager':>22}{'/bf16':>7}"
          f"{'trn2 compiled':>22}{'/bf16':>7}")
    for r in recipes:
        (e, em, _), (c, cm, _) = eager[r], compiled[r]
        print(f"{r or 'bf16':<12}{host_s[r] * 1e3:>8.1f} ms{ratio[r]:>7.2f}"
              f"{e * 1e6:>9.0f} us ({em * 1e6:>5.0f} us){e / eager[None][0]:>7.2f}"
              f"{c * 1e6:>9.0f} us ({cm * 1e6:>5.0f} us){c / compiled[None][0]:>7.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--large", action="store_true",
                    help="also the float8 step at a larger shape (bf16 steps take minutes on a "
                         "host without BF16 instructions)")
    ap.add_argument("--matmul-bound", action="store_true",
                    help="also the float8 step at matmul-bound shapes (minutes of host time)")
    ap.add_argument("--bf16-from-fp32", action="store_true",
                    help="with --matmul-bound: run the bf16 step in fp32, priced as bf16 (for "
                         "hosts without BF16 instructions)")
    args = ap.parse_args()
    pairs = 3 if args.quick else 7
    print("host time, paired medians:")
    _report(tensorwise_vs_cpu(pairs, 512), ("cpu", "neuron"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trn2's one-time "no MX matmul path" (modelled below)
        for size in (512, 1024, 2048):
            _report(blockwise_and_mx_vs_bf16(pairs, size), ("mm", "scaled"))
        _report(grouped_mx_vs_bf16(pairs), ("bf16", "mx"))
    modelled(4096)
    bench_torchao(min(pairs, 3), *((256, 1024, 512) if args.quick else (512, 2048, 1024)))
    if args.large:
        bench_torchao(0, 1024, 4096, 2048)
    if args.matmul_bound:
        for d, ffn, tokens in MATMUL_BOUND:
            bench_torchao(0, d, ffn, tokens, priced=args.bf16_from_fp32)
    torch_neuronx.modelled_time(reset=True)


if __name__ == "__main__":
    main()
