"""NKI simulator speed: a bf16 2048^3 tiled matmul against numpy.matmul (float32) in the same
run, and the simulator's per-instruction overhead on small tiles.

    .venv/bin/python bench/bench_nki.py
"""
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402
from nki.examples.matmul import matmul_blocked  # noqa: E402


def median_time(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


@nki.jit
def small_ops(x, n):
    t = nl.ndarray((128, 64), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    u = nl.ndarray((128, 64), dtype=x.dtype, buffer=nl.sbuf)
    for _ in range(n):
        nisa.tensor_tensor(dst=u, data1=t, data2=t, op=nl.add)
        nisa.activation(dst=u, op=nl.exp, data=u)
        nisa.tensor_scalar(dst=t, data=u, op0=nl.multiply, operand0=0.5)


def main():
    n = 2048
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, n)).astype(ml_dtypes.bfloat16)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    # Paired runs: the machine's load changes over time, so each simulator run is compared
    # with the numpy run right after it and the median of the ratios is reported.
    matmul_blocked(a, b)
    sims, refs = [], []
    for _ in range(7):
        sims.append(median_time(lambda: matmul_blocked(a, b), 1))
        refs.append(median_time(lambda: a32.T @ b32, 1))
    ratio = statistics.median(s / r for s, r in zip(sims, refs))
    sim, ref = statistics.median(sims), statistics.median(refs)
    r = matmul_blocked(a, b)
    err = float(np.abs(r.astype(np.float32) - a32.T @ b32).max())
    print(f"matmul bf16 {n}^3: simulate {sim * 1e3:.1f} ms, numpy.matmul fp32 {ref * 1e3:.1f} ms "
          f"(medians of 7 paired runs), median ratio {ratio:.2f}x (target <= 3x); "
          f"max abs err vs fp32 {err:.3g}")

    x = rng.standard_normal((128, 64)).astype(np.float32)
    iters = 2000
    t_sim = median_time(lambda: small_ops(x, iters), 3)
    per = t_sim / (3 * iters + 1) * 1e6
    bm = nki.benchmark(small_ops)
    t_b = median_time(lambda: bm(x, iters), 3)
    per_b = t_b / (3 * iters + 1) * 1e6
    print(f"per-instruction overhead (128x64 tiles): simulate {per:.1f} us, benchmark (with timing) "
          f"{per_b:.1f} us (target < 50 us)")
    res = nki.benchmark(matmul_blocked)(a, b)
    print(f"modelled: {res.summary()}")
    torch_call_overhead()


@nki.jit
def _add_kernel(a, b):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.add(nl.load(a), nl.load(b)))
    return out


def torch_call_overhead():
    """A 4-instruction kernel called on neuron tensors (zero-copy in/out, timing model on,
    modelled time accounted), directly and as an nki_op, against torch.add on CPU."""
    import torch
    from torch_neuronx import nki_op
    a = torch.randn(128, 512)
    ad = a.to("neuron")
    op = nki_op("bench_nki::add", _add_kernel, mutates_args=(), schema="(Tensor a, Tensor b) -> Tensor")
    reps = 500
    t_jit = median_time(lambda: [_add_kernel(ad, ad) for _ in range(reps)], 3) / reps
    t_op = median_time(lambda: [op(ad, ad) for _ in range(reps)], 3) / reps
    t_cpu = median_time(lambda: [torch.add(a, a) for _ in range(reps)], 3) / reps
    print(f"kernel call on neuron tensors (128x512 fp32 add, 4 instructions): @nki.jit "
          f"{t_jit * 1e6:.0f} us, nki_op {t_op * 1e6:.0f} us, torch.add on CPU {t_cpu * 1e6:.1f} us")


if __name__ == "__main__":
    main()
