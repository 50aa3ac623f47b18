"""Matmul written the ways AWS's tutorials write it, and the simulator's bf16 conversions."""
import ml_dtypes
import numpy as np
import pytest

import nki
import nki.language as nl
from nki.simulator.dtypes import bfloat16


@nki.jit
def _tutorial_matmul(lhsT, rhs):
    """AWS's tutorial form: a PSUM accumulator, `+=` of nl.matmul, nl.copy, nl.store."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // 128):
        for n in nl.affine_range(N // 512):
            res_psum = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // 128):
                a = nl.load(lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
                b = nl.load(rhs[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                res_psum += nl.matmul(a, b, transpose_x=True)
            nl.store(result[m * 128:(m + 1) * 128, n * 512:(n + 1) * 512],
                     value=nl.copy(res_psum, dtype=result.dtype))
    return result


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_psum_accumulate_form(dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 256)).astype(dtype)
    b = rng.standard_normal((512, 1024)).astype(dtype)
    want = a.astype(np.float32).T @ b.astype(np.float32)
    got = np.asarray(_tutorial_matmul(a, b), np.float32)
    tol = 1e-4 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    # and it is timed as matmuls accumulating into one PSUM tile
    r = nki.benchmark(_tutorial_matmul)(a, b)
    assert r.engine_busy_ns["tensor"] > 0


def test_accumulating_into_a_bf16_psum_tile_is_refused():
    @nki.jit
    def k(x):
        acc = nl.zeros((128, 128), nl.bfloat16, buffer=nl.psum)
        t = nl.load(x)
        acc += nl.matmul(t, t, transpose_x=True)
        return x
    with pytest.raises(nki.errors.DtypeLegalityError, match="accumulator is float32"):
        k(np.ones((128, 128), np.float32))


def test_bf16_conversions_are_exact():
    vals = np.array([0.0, -0.0, 1.0, -2.5, 3.0e38, 1e-40, np.inf, -np.inf, np.nan], np.float32)
    a = np.concatenate([vals, np.random.default_rng(0).standard_normal(1000, dtype=np.float32)])
    a = a.astype(ml_dtypes.bfloat16)
    stored = bfloat16.from_real(a)
    np.testing.assert_array_equal(stored, a.astype(np.float32))
    np.testing.assert_array_equal(bfloat16.to_real(stored).view(np.uint16), a.view(np.uint16))


def test_gather_flattened_picks_within_each_partition():
    @nki.jit
    def k(data, idx):
        out = nl.ndarray(idx.shape, dtype=data.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.gather_flattened(nl.load(data), nl.load(idx)))
        return out
    rng = np.random.default_rng(0)
    data = rng.standard_normal((128, 4, 64)).astype(np.float32)
    idx = rng.integers(0, 256, size=(128, 100)).astype(np.int32)
    want = np.take_along_axis(data.reshape(128, 256), idx, 1)
    np.testing.assert_array_equal(k(data, idx), want)
    with pytest.raises(nki.errors.IndexOutOfBoundsError, match="gather_flattened"):
        k(data, np.full((128, 4), 256, np.int32))
