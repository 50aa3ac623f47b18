"""Indirect DMA (AWS's ``.ap(vector_offset=..., indirect_dim=...)`` / ``scalar_offset``): gathers
and scatters of HBM rows at runtime offsets, against NumPy."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def _gather(data, indices):
    P, F = indices.shape[0], data.shape[1]
    output = nl.ndarray((P, F), dtype=data.dtype, buffer=nl.shared_hbm)
    idx = nl.ndarray((P, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    dst = nl.ndarray((P, F), dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=dst, src=data.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0))
    nisa.dma_copy(dst=output, src=dst)
    return output


@nki.jit
def _scatter(src_data, indices, output):
    P, F = src_data.shape
    src = nl.ndarray((P, F), dtype=src_data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=src_data)
    idx = nl.ndarray((P, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    nisa.dma_copy(dst=output.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0), src=src)
    return output


def test_gather_rows_at_runtime_offsets():
    rng = np.random.default_rng(0)
    data = rng.standard_normal((1000, 64)).astype(np.float32)
    idx = rng.integers(0, 1000, size=(128, 1)).astype(np.uint32)
    np.testing.assert_array_equal(_gather(data, idx), data[idx[:, 0]])


def test_scatter_rows_at_runtime_offsets():
    rng = np.random.default_rng(1)
    src = rng.standard_normal((96, 32)).astype(np.float32)
    idx = rng.permutation(500)[:96].astype(np.uint32)[:, None]
    out = np.zeros((500, 32), np.float32)
    _scatter(src, idx, out)
    want = np.zeros((500, 32), np.float32)
    want[idx[:, 0]] = src
    np.testing.assert_array_equal(out, want)


def test_out_of_range_offsets_error_or_skip():
    data = np.arange(20 * 8, dtype=np.float32).reshape(20, 8)
    idx = np.array([[1], [25], [3]], np.uint32)
    with pytest.raises(nki.errors.IndexOutOfBoundsError, match="indirect src offset"):
        _gather(data, idx)

    @nki.jit
    def skip(data, indices):
        P, F = indices.shape[0], data.shape[1]
        out = nl.ndarray((P, F), dtype=data.dtype, buffer=nl.shared_hbm)
        i = nl.ndarray((P, 1), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=indices)
        t = nl.ndarray((P, F), dtype=data.dtype, buffer=nl.sbuf)
        nisa.memset(dst=t, value=-1.0)
        nisa.dma_copy(dst=t, src=data.ap(pattern=[[F, P], [1, F]], vector_offset=i, indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip)
        nisa.dma_copy(dst=out, src=t)
        return out
    got = skip(data, idx)
    np.testing.assert_array_equal(got[[0, 2]], data[[1, 3]])
    np.testing.assert_array_equal(got[1], np.full(8, -1.0, np.float32))


def test_scalar_offset_from_a_register():
    @nki.jit
    def k(data, row):
        out = nl.ndarray((4, 16), dtype=data.dtype, buffer=nl.shared_hbm)
        r = nisa.register_alloc(0)
        nisa.register_load(r, row)
        t = nl.ndarray((4, 16), dtype=data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=data.ap(pattern=[[16, 4], [1, 16]], scalar_offset=r, indirect_dim=0))
        nisa.dma_copy(dst=out, src=t)
        return out
    data = np.arange(50 * 16, dtype=np.float32).reshape(50, 16)
    np.testing.assert_array_equal(k(data, np.array([[7]], np.int32)), data[7:11])


def test_indirect_access_needs_an_hbm_tensor():
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 8), dtype=x.dtype, buffer=nl.sbuf)
        i = nl.ndarray((128, 1), dtype=nl.uint32, buffer=nl.sbuf)
        t.ap(pattern=[[8, 128], [1, 8]], vector_offset=i, indirect_dim=0)
        return x
    with pytest.raises(nki.errors.MemoryLegalityError, match="indexes an HBM tensor"):
        k(np.zeros((128, 8), np.float32))


def test_offsets_count_rows_of_the_tensor_not_pattern_steps():
    """AWS: an indirect offset moves indirect_dim of the tensor, i.e. by the accumulated shape
    right of it, whatever the pattern's step there (AWS's moe_cte reads a row's columns with
    pattern [[1, n], [1, 1]] and scalar_offset=block_idx)."""
    @nki.jit
    def k(data, row, idx):
        r = nisa.register_alloc(0)
        nisa.register_load(r, row)
        a = nl.ndarray((8, 1), dtype=data.dtype, buffer=nl.sbuf)     # row `row`, one per partition
        nisa.dma_copy(dst=a, src=data.ap(pattern=[[1, 8], [1, 1]], offset=2, scalar_offset=r,
                                         indirect_dim=0))
        i = nl.ndarray((4, 1), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=idx)
        b = nl.ndarray((4, 1), dtype=data.dtype, buffer=nl.sbuf)     # element 0 of rows idx
        nisa.dma_copy(dst=b, src=data.ap(pattern=[[1, 4], [1, 1]], vector_offset=i, indirect_dim=0))
        outs = []
        for t in (a, b):
            o = nl.ndarray(t.shape, dtype=data.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=o, src=t)
            outs.append(o)
        return outs
    data = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    idx = np.array([[3], [0], [5], [1]], np.uint32)
    a, b = k(data, np.array([[4]], np.int32), idx)
    np.testing.assert_array_equal(np.asarray(a)[:, 0], data[4, 2:10])
    np.testing.assert_array_equal(np.asarray(b)[:, 0], data[idx[:, 0], 0])
