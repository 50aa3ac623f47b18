"""NKI simulator speed over several blockings of one matmul, written the ways users write it.

    .venv/bin/python bench/bench_nki_blockings.py [--n 2048] [--pairs 5]

Each kernel computes result[M, N] = lhsT[K, M].T @ rhs[K, N] in bf16 at n^3; each simulator
run is paired with `numpy.matmul` in fp32 on the same data right after it, and the median
of the ratios is reported (the machine is shared). The kernels: our examples' three stages
(`matmul_basic`: both tiles loaded per step; `matmul_hoisted`; `matmul_blocked`), and the
language-level form of AWS's tutorials (`nl.load` / `nl.matmul(..., transpose_x=True)` into
a PSUM accumulator with `+=` / `nl.copy` / `nl.store`), written here as a user would.
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import nki
import nki.language as nl
from nki.examples.matmul import matmul_basic, matmul_blocked, matmul_hoisted

TK, TM, TN = 128, 128, 512


@nki.jit
def matmul_language(lhsT, rhs):
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TM):
        for n in nl.affine_range(N // TN):
            res_psum = nl.zeros((TM, TN), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                lhsT_tile = nl.load(lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                rhs_tile = nl.load(rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                res_psum += nl.matmul(lhsT_tile, rhs_tile, transpose_x=True)
            res_sb = nl.copy(res_psum, dtype=result.dtype)
            nl.store(result[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], value=res_sb)
    return result


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    n = args.n
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, n)).astype(ml_dtypes.bfloat16)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    want = a32.T @ b32
    for kernel in (matmul_basic, matmul_hoisted, matmul_blocked, matmul_language):
        out = kernel(a, b)
        err = float(np.abs(np.asarray(out, np.float32) - want).max() / np.abs(want).max())
        ratios, sims = [], []
        for _ in range(args.pairs):
            s = _time(lambda: kernel(a, b))
            r = _time(lambda: a32.T @ b32)
            ratios.append(s / r)
            sims.append(s)
        print(f"{kernel.__name__:16s} bf16 {n}^3: simulate {statistics.median(sims) * 1e3:7.1f} ms, "
              f"median paired ratio to numpy fp32 {statistics.median(ratios):5.2f}x "
              f"(rel err {err:.1e})")


if __name__ == "__main__":
    main()
