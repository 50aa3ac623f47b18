"""Tiles placed by the kernel (``nl.ndarray(..., address=(partition, byte))``, AWS's direct
allocation), ``nki.dtype``, and the DMA transpose's permutations, as AWS's kernels use them."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

P = 128


def _ring_matmul(x, w, same_address):
    """out[i] = x[i].T @ w for each of x's tiles, through two SBUF slots and two PSUM banks
    placed by hand (slot i % 2), or all at one address."""
    @nki.jit
    def kernel(x, w):
        n = x.shape[0]
        out = nl.ndarray((n, P, P), dtype=nl.float32, buffer=nl.shared_hbm)
        wt = nl.ndarray((P, P), dtype=w.dtype, buffer=nl.sbuf, address=(0, 4 * P * 4))
        nisa.dma_copy(dst=wt, src=w)
        for i in range(n):
            slot = 0 if same_address else i % 2
            xt = nl.ndarray((P, P), dtype=x.dtype, buffer=nl.sbuf, address=(0, slot * P * 4))
            nisa.dma_copy(dst=xt, src=x[i])
            ps = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum, address=(0, slot * 2048))
            nisa.nc_matmul(dst=ps, stationary=xt, moving=wt)
            sb = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf,
                            address=(0, (2 + slot) * P * 4))
            nisa.activation(dst=sb, op=nl.exp, data=ps)
            nisa.dma_copy(dst=out[i], src=sb)
        return out
    return kernel


def test_placed_tiles_compute_as_allocated_ones():
    rng = np.random.default_rng(0)
    x = (0.05 * rng.standard_normal((4, P, P))).astype(np.float32)
    w = (0.05 * rng.standard_normal((P, P))).astype(np.float32)
    want = np.exp(np.einsum("nkm,kj->nmj", x.astype(np.float64), w))
    for same in (False, True):
        got = np.asarray(_ring_matmul(x, w, same)(x, w))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_a_shared_address_orders_its_tiles():
    """Tiles placed at one address wait for each other's readers (the timing model tracks
    dependencies by address); two slots let the next tile load while the last computes."""
    x = np.ones((6, P, P), np.float32)
    w = np.ones((P, P), np.float32)
    ring = nki.benchmark(_ring_matmul(x, w, False))(x, w).latency_ns
    one = nki.benchmark(_ring_matmul(x, w, True))(x, w).latency_ns
    assert one > 1.2 * ring, (one, ring)


def test_allocations_keep_clear_of_placed_tiles():
    seen = {}

    @nki.jit
    def kernel(x):
        a = nl.ndarray((P, 64), dtype=nl.float32, buffer=nl.sbuf)          # bytes 0-255
        big = nl.ndarray((P, 16384), dtype=nl.float32, buffer=nl.sbuf, address=(0, 1024))
        small = nl.ndarray((P, 64), dtype=nl.float32, buffer=nl.sbuf)      # fits below it
        t = nl.ndarray((P, 1024), dtype=nl.float32, buffer=nl.sbuf)        # does not
        seen.update(a=a.buf.addr, big=big.buf.addr, small=small.buf.addr, t=t.buf.addr)
        nisa.dma_copy(dst=t[:, 0:64], src=x)
        out = nl.ndarray((P, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t[:, 0:64])
        return out
    x = np.arange(P * 64, dtype=np.float32).reshape(P, 64)
    np.testing.assert_array_equal(np.asarray(kernel(x)), x)
    assert seen["big"] == 1024
    assert seen["small"] + 256 <= 1024
    assert seen["t"] >= 1024 + 16384 * 4, seen


def test_a_partition_offset_reaches_the_engine_rules():
    def kernel_at(p0):
        @nki.jit
        def kernel(x):
            t = nl.ndarray((32, 64), dtype=nl.float32, buffer=nl.sbuf, address=(p0, 0))
            nisa.dma_copy(dst=t, src=x)
            u = nl.ndarray((32, 64), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=u, data=t, op0=nl.multiply, operand0=2.0)
            out = nl.ndarray((32, 64), dtype=nl.float32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=u)
            return out
        return kernel
    x = np.ones((32, 64), np.float32)
    np.testing.assert_array_equal(np.asarray(kernel_at(32)(x)), 2 * x)
    with pytest.raises(E.PartitionAlignmentError, match="starts at partition 16"):
        kernel_at(16)(x)


@pytest.mark.parametrize("shape, address, error, match", [
    ((P, 64), (0, 229376 - 128), E.SbufCapacityError, "past the 229376"),
    ((64, 64), (96, 0), E.PartitionDimensionError, "runs past partition 127"),
    ((P, 64), (0, 2), E.UnsupportedError, "multiple of 4 \\(its dtype's size\\)"),
    ((P, 64), "0", E.UnsupportedError, "partition_offset, byte_offset"),
])
def test_bad_placements_are_refused(shape, address, error, match):
    @nki.jit
    def kernel(x):
        nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf, address=address)
        return x
    with pytest.raises(error, match=match):
        kernel(np.ones((1, 1), np.float32))


def test_a_placement_aligns_to_its_dtype():
    @nki.jit
    def kernel(x):
        t = nl.ndarray((P, 3), dtype=nl.bfloat16, buffer=nl.sbuf, address=(0, 502))
        nisa.dma_copy(dst=t, src=x)
        out = nl.ndarray((P, 3), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    import ml_dtypes
    x = np.arange(P * 3, dtype=np.float32).reshape(P, 3).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(kernel(x)), x)


def test_hbm_tensors_take_no_address():
    @nki.jit
    def kernel(x):
        return nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm, address=(0, 0))
    with pytest.raises(E.UnsupportedError, match="address= places SBUF and PSUM"):
        kernel(np.ones((1, 1), np.float32))


def test_placed_psum_banks_are_capacity_checked():
    @nki.jit
    def kernel(x):
        nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.psum, address=(0, 7 * 2048 + 4))
        return x
    with pytest.raises(E.PsumCapacityError, match="16384"):
        kernel(np.ones((1, 1), np.float32))


def test_nki_dtype_is_the_dtype_class():
    assert isinstance(nl.bfloat16, nki.dtype) and isinstance(nl.float32, nki.dtype)
    # AWS's kernels compare str(dtype) with bare names (nkilib's resolve_dtype_to_nki)
    assert [str(d) for d in (nl.bfloat16, nl.float32, nl.float8_e4m3)] == \
        ["bfloat16", "float32", "float8_e4m3"]
    assert repr(nl.bfloat16) == "nki.language.bfloat16"


def test_dma_transpose_permutations_are_aws_s():
    import ml_dtypes
    rng = np.random.default_rng(1)
    x4 = rng.standard_normal((16, 1, 4, 128)).astype(ml_dtypes.bfloat16)
    x3 = rng.standard_normal((8, 4, 128)).astype(ml_dtypes.bfloat16)

    @nki.jit
    def kernel(x4, x3):
        outs = []
        for x in (x4, x3):
            axes = (3, 1, 2, 0) if x.ndim == 4 else (2, 1, 0)
            shape = tuple(x.shape[a] for a in axes)
            t = nl.ndarray(shape, dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_transpose(dst=t, src=x)             # the default permutation
            out = nl.ndarray(shape, dtype=x.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=t)
            outs.append(out)
        return outs
    o4, o3 = kernel(x4, x3)
    np.testing.assert_array_equal(np.asarray(o4), np.transpose(x4, (3, 1, 2, 0)))
    np.testing.assert_array_equal(np.asarray(o3), np.transpose(x3, (2, 1, 0)))

    @nki.jit
    def reversed4(x):
        t = nl.ndarray((128, 4, 1, 16), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=x, axes=(3, 2, 1, 0))
        return x
    with pytest.raises(E.NkiRuleError, match=r"support \(3, 1, 2, 0\)"):
        reversed4(x4)


def test_tile_sizes_are_aws_s():
    """PSUM sizes per bank per partition (AWS's kernels place bank b at b * psum_fmax * 4)."""
    ts = nl.tile_size
    assert (ts.pmax, ts.psum_fmax, ts.psum_bank_fmax, ts.psum_fmax_bytes, ts.psum_num_banks,
            ts.gemm_stationary_fmax, ts.gemm_moving_fmax) == (128, 512, 512, 2048, 8, 128, 512)
    assert ts.psum_num_banks * ts.psum_fmax * 4 == ts.psum_partition_size


def test_empty_tiles_and_a_core_with_no_work():
    """A program of a grid may get no work (one query block over kernel[2]): its empty tiles
    (zero numpy strides) must not crash the simulator (Omni's diffusion step found it)."""
    from nkilib.core.attention.attention_cte import attention_cte
    rng = np.random.default_rng(0)
    q, v = (rng.standard_normal((1, 64, 32)).astype(np.float32) for _ in range(2))
    k = rng.standard_normal((1, 32, 64)).astype(np.float32)
    out = np.asarray(attention_cte[2](q, k, v, scale=0.2, causal_mask=False))
    s = 0.2 * q[0].astype(np.float64) @ k[0]
    p = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(out[0], (p / p.sum(1, keepdims=True)) @ v[0], rtol=1e-4, atol=1e-5)

    @nki.jit
    def kernel(x):
        t = nl.ndarray((P, 0), dtype=nl.float32, buffer=nl.sbuf)
        u = nl.ndarray((0, 4), dtype=nl.float32, buffer=nl.psum)
        assert t.pstart == 0 and u.pstart == 0 and t.box()[1][0] == t.box()[1][1]
        return x
    kernel(np.ones((1, 1), np.float32))
