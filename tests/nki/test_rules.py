"""Each hardware rule, broken by a kernel: the right error, naming the kernel's line."""
import os

import numpy as np
import pytest

import nki
import nki.errors as E
import nki.isa as nisa
import nki.language as nl

HERE = os.path.abspath(__file__)
SRC = open(HERE).read().splitlines()


def line_of(marker):
    return next(i + 1 for i, s in enumerate(SRC) if s.rstrip().endswith(f"# {marker}"))


def expect(cls, marker, fn, *args, target=None):
    with pytest.raises(cls) as ei:
        nki.simulate(fn, platform_target=target)(*args)
    err = ei.value
    assert isinstance(err, (ValueError, RuntimeError, TypeError, IndexError, MemoryError))
    assert err.filename == HERE and err.lineno == line_of(marker), str(err)
    assert f"{HERE}:{line_of(marker)}" in str(err)
    return err


A = np.ones((128, 512), np.float32)


@nki.jit
def k_partition_dim(a):
    t = nl.ndarray((256, 4), dtype=nl.float32, buffer=nl.sbuf)  # PDIM
    return t


@nki.jit
def k_alignment(a):
    t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    u = nl.ndarray((32, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=u, src=t[16:48, :])  # ALIGN
    return t


@nki.jit
def k_alignment_span(a):
    t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t[32:96, :], value=0.0)  # SPAN


@nki.jit
def k_sbuf_capacity(a):
    keep = []
    for i in range(8):
        keep.append(nl.ndarray((128, 8192), dtype=nl.float32, buffer=nl.sbuf))  # SBUF
    return a


@nki.jit
def k_psum_capacity(a):
    keep = []
    for i in range(9):
        keep.append(nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum))  # PSUM
    return a


def _mm_kernel(m, n, dst_buffer=nl.psum, dst_cols=None, dtype=nl.float32):
    @nki.jit
    def k(a):
        s = nl.ndarray((128, m), dtype=dtype, buffer=nl.sbuf)
        mv = nl.ndarray((128, n), dtype=dtype, buffer=nl.sbuf)
        d = nl.ndarray((min(m, 128), dst_cols or n), dtype=nl.float32, buffer=dst_buffer)
        nisa.nc_matmul(dst=d[:, 0:n] if dst_cols is None else d[:, 256:256 + n], stationary=s, moving=mv)  # MM
    return k


@nki.jit
def k_accumulate_first(a):
    s = nl.zeros((128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
    d = nl.zeros((128, 128), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=s, moving=s, accumulate=True)  # ACC


@nki.jit
def k_dma_psum(a):
    d = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
    nisa.dma_copy(dst=d, src=a)  # DMAPSUM


@nki.jit
def k_gpsimd_psum(a):
    d = nl.ndarray((128, 16), dtype=nl.float32, buffer=nl.psum)
    nisa.iota(dst=d, pattern=[[1, 16]], offset=0)  # GPSIMD


@nki.jit
def k_bitvec_float(a):
    t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.bitwise_and)  # BITVEC


@nki.jit
def k_int_matmul(a):
    s = nl.zeros((128, 128), dtype=nl.int8, buffer=nl.sbuf)
    d = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=s, moving=s)  # INTMM


@nki.jit  # OUTPUT
def k_output_sbuf(a):
    t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    return t


@nki.jit
def k_oob(a):
    t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[:, 256:768])  # OOB


@nki.jit
def k_shape(a):
    t = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)  # SHAPE


@nki.jit
def k_psum_both(a):
    p1 = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.psum)
    p2 = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.psum)
    o = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=o, data1=p1, data2=p2, op=nl.add)  # BOTHPSUM


@nki.jit
def k_bn_stats_fmax(a):
    t = nl.zeros((128, 1024), dtype=nl.float32, buffer=nl.sbuf)
    s = nl.ndarray((128, 6), dtype=nl.float32, buffer=nl.sbuf)
    nisa.bn_stats(dst=s, data=t)  # BNFMAX


def test_partition_dim():
    expect(E.PartitionDimensionError, "PDIM", k_partition_dim, A)


def test_partition_start_alignment():
    expect(E.PartitionAlignmentError, "ALIGN", k_alignment, A)
    expect(E.PartitionAlignmentError, "SPAN", k_alignment_span, A)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_sbuf_capacity_per_target(target):
    e = expect(E.SbufCapacityError, "SBUF", k_sbuf_capacity, A, target=target)
    assert "SBUF" in str(e)


def test_sbuf_capacity_follows_target_profile():
    # 8 x 32 KiB per partition: fits trn3 (256 KiB), not trn2 (224 KiB); 7 fit trn2, not trn1 (192 KiB).
    def make(n):
        @nki.jit
        def k(a):
            keep = [nl.ndarray((128, 8192), dtype=nl.float32, buffer=nl.sbuf) for _ in range(n)]
            return a
        return k
    nki.simulate(make(8), platform_target="trn3")(A)
    nki.simulate(make(7), platform_target="trn2")(A)
    with pytest.raises(E.SbufCapacityError):
        nki.simulate(make(7), platform_target="trn1")(A)


def test_psum_capacity():
    expect(E.PsumCapacityError, "PSUM", k_psum_capacity, A)


def test_matmul_tile_limits():
    expect(E.MatmulTileError, "MM", _mm_kernel(129, 64), A)       # stationary free > 128
    expect(E.MatmulTileError, "MM", _mm_kernel(128, 513), A)      # moving free > 512
    expect(E.MemoryLegalityError, "MM", _mm_kernel(128, 128, nl.sbuf), A)   # TensorE writes PSUM
    expect(E.PsumBankError, "MM", _mm_kernel(128, 512, nl.psum, dst_cols=1024), A)   # straddles banks
    expect(E.DtypeLegalityError, "INTMM", k_int_matmul, A)


def test_psum_accumulate_rule():
    expect(E.PsumAccumulateError, "ACC", k_accumulate_first, A)
    nki.simulate(k_accumulate_first, platform_target="trn1")(A)     # allowed on NeuronCore-v2


def test_engine_buffer_legality():
    expect(E.MemoryLegalityError, "DMAPSUM", k_dma_psum, A)
    expect(E.MemoryLegalityError, "GPSIMD", k_gpsimd_psum, A)
    expect(E.MemoryLegalityError, "BOTHPSUM", k_psum_both, A)


def test_dtype_rules():
    expect(E.DtypeLegalityError, "BITVEC", k_bitvec_float, A)


def test_output_and_index_and_shape_rules():
    expect(E.OutputBufferError, "OUTPUT", k_output_sbuf, A)
    expect(E.IndexOutOfBoundsError, "OOB", k_oob, A)
    expect(E.ShapeMismatchError, "SHAPE", k_shape, A)
    expect(E.ShapeMismatchError, "BNFMAX", k_bn_stats_fmax, A)


def test_uninitialised_memory_reads_nan():
    @nki.jit
    def k(a):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:, 0:256], src=a[:, 0:256])
        nisa.dma_copy(dst=out, src=t)
        return out
    r = k(A)
    assert (r[:, :256] == 1).all() and np.isnan(r[:, 256:]).all()


def test_errors_are_value_errors():
    assert issubclass(E.PartitionDimensionError, ValueError)
    assert issubclass(E.SbufCapacityError, MemoryError) and issubclass(E.SbufCapacityError, ValueError)
    assert issubclass(E.UnsupportedError, NotImplementedError)
