"""The instructions added after the first set: MX matmul and quantization (trn3), cumulative
tensor-scalar, Activation2, gathers and scans on GpSimd, stream shuffle, XORWOW random
numbers and DMA compute -- each against a NumPy reference written from AWS's documentation,
and the rule errors each raises."""
import ml_dtypes as mld
import numpy as np
import pytest

import nki
import nki.errors as E
import nki.isa as nisa
import nki.language as nl

from helpers import run_instr

RNG = np.random.default_rng(11)
BF16 = mld.bfloat16


def sbuf(x, dtype=None):
    """An SBUF copy of HBM tensor x (optionally as another dtype, e.g. bits as an x4 type)."""
    t = nl.ndarray(x.shape, dtype=dtype or x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    return t


def hbm_out(t, dtype=None):
    out = nl.ndarray(t.shape, dtype=dtype or t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# ----------------------------------------------------------------------------------------
# MX: a NumPy model of the formats, from AWS's MX tutorial (values four to a word, 8x4
# scaling groups, scales in the first 4 partitions of each 32-partition quadrant).

ELEM = {"float8_e4m3fn_x4": mld.float8_e4m3fn, "float8_e5m2_x4": mld.float8_e5m2,
        "float4_e2m1fn_x4": mld.float4_e2m1fn}


def rand_elems(P, F, x4):
    """(values float32 [P, 4F], packed words) of random finite MX elements."""
    elem = ELEM[x4]
    if x4 == "float4_e2m1fn_x4":
        codes = RNG.integers(0, 16, (P, 4 * F)).astype(np.uint8)
        vals = codes.view(elem).astype(np.float32)
        c = codes.astype(np.uint16).reshape(P, F, 4)
        words = c[..., 0] | c[..., 1] << 4 | c[..., 2] << 8 | c[..., 3] << 12
        return vals, words.astype(np.uint16)
    vals = RNG.uniform(-4, 4, (P, 4 * F)).astype(elem)
    return vals.astype(np.float32), vals.view(np.uint32)


def hw_scales(codes, oversize=None):
    """Scale codes [P/8, F] placed as the hardware reads them: group g at partition
    (g // 4) * 32 + g % 4."""
    G, F = codes.shape
    rows = oversize or (G if G <= 4 else (G // 4 - 1) * 32 + 4)
    hw = np.zeros((rows, F), np.uint8)
    for g in range(G):
        hw[(g // 4) * 32 + g % 4] = codes[g]
    return hw


def dequant(vals, codes):
    """float64 [P, F, 4]: every value times 2**(code - 127) of its 8-partition group."""
    P = vals.shape[0]
    s = np.repeat(2.0 ** (codes.astype(np.float64) - 127), 8, axis=0)
    return vals.astype(np.float64).reshape(P, -1, 4) * s[:, :, None]


def mx_operand(P, F, x4):
    vals, words = rand_elems(P, F, x4)
    codes = RNG.integers(118, 136, (P // 8, F)).astype(np.uint8)
    return vals, words, codes


def run_mx_matmul(st, mv, dst_dtype="float32", scale_dtype="uint8", target="trn3", **kw):
    (sx4, sw, sc), (mx4, mw, mc) = st, mv
    M, N = sw.shape[1], mw.shape[1]
    shw, mhw = hw_scales(sc), hw_scales(mc)
    if scale_dtype != "uint8":            # the same scales as E8M0 values
        shw, mhw = (np.ldexp(1.0, h.astype(np.int32) - 127).astype(mld.float8_e8m0fnu) for h in (shw, mhw))

    @nki.jit(platform_target=target)
    def k(sw, shw, mw, mhw):
        p = nl.ndarray((M, N), dtype=getattr(nl, dst_dtype), buffer=nl.psum)
        nisa.nc_matmul_mx(dst=p, stationary=sbuf(sw, getattr(nl, sx4)), moving=sbuf(mw, getattr(nl, mx4)),
                          stationary_scale=sbuf(shw), moving_scale=sbuf(mhw), **kw)
        o = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=p)
        return hbm_out(o)
    return k(sw, shw, mw, mhw)


def operand(x4, P, F):
    vals, words, codes = mx_operand(P, F, x4)
    return (x4, words, codes), vals


@pytest.mark.parametrize("x4s,x4m,K", [("float8_e4m3fn_x4", "float8_e4m3fn_x4", 128),
                                       ("float8_e5m2_x4", "float8_e5m2_x4", 64),
                                       ("float4_e2m1fn_x4", "float4_e2m1fn_x4", 32),
                                       ("float8_e4m3fn_x4", "float4_e2m1fn_x4", 128)])
def test_nc_matmul_mx_equals_dequantized_matmul(x4s, x4m, K):
    (s, sv), (m, mv) = operand(x4s, K, 64), operand(x4m, K, 256)
    r = run_mx_matmul(s, m)
    ref = np.einsum("kiq,kjq->ij", dequant(sv, s[2]), dequant(mv, m[2]))
    np.testing.assert_allclose(r, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_nc_matmul_mx_bf16_psum_and_e8m0_scales():
    (s, sv), (m, mv) = operand("float8_e5m2_x4", 128, 128), operand("float8_e4m3fn_x4", 128, 512)
    r = run_mx_matmul(s, m, dst_dtype="bfloat16", scale_dtype="float8_e8m0fnu")
    ref = np.einsum("kiq,kjq->ij", dequant(sv, s[2]), dequant(mv, m[2]))
    np.testing.assert_array_equal(r, r.astype(BF16).astype(np.float32))      # bf16 in PSUM
    np.testing.assert_allclose(r, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


def test_nc_matmul_mx_accumulates_and_row_tiles():
    (s, sv), (m, mv) = operand("float8_e4m3fn_x4", 32, 32), operand("float8_e4m3fn_x4", 32, 64)

    @nki.jit(platform_target="trn3")
    def k(sw, shw, mw, mhw):
        p = nl.ndarray((32, 64), dtype=nl.float32, buffer=nl.psum)
        args = dict(stationary=sbuf(sw, nl.float8_e4m3fn_x4), moving=sbuf(mw, nl.float8_e4m3fn_x4),
                    stationary_scale=sbuf(shw), moving_scale=sbuf(mhw))
        nisa.nc_matmul_mx(dst=p, tile_position=(32, 0), tile_size=(32, 128), **args)
        nisa.nc_matmul_mx(dst=p, accumulate=True, **args)
        o = nl.ndarray((32, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=p)
        return hbm_out(o)
    r = k(s[1], hw_scales(s[2]), m[1], hw_scales(m[2]))
    ref = 2 * np.einsum("kiq,kjq->ij", dequant(sv, s[2]), dequant(mv, m[2]))
    np.testing.assert_allclose(r, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_nc_matmul_mx_reads_scales_packed_at_an_offset():
    """Two operands' scales share one tile: stationary's at quadrant offset 0, moving's at 4."""
    (s, sv), (m, mv) = operand("float8_e4m3fn_x4", 128, 64), operand("float8_e5m2_x4", 128, 64)
    packed = np.zeros((128, 64), np.uint8)
    packed[:100] = hw_scales(s[2])
    packed[4:104] |= hw_scales(m[2])

    @nki.jit(platform_target="trn3")
    def k(sw, mw, pk):
        sc = sbuf(pk)
        p = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=p, stationary=sbuf(sw, nl.float8_e4m3fn_x4), moving=sbuf(mw, nl.float8_e5m2_x4),
                          stationary_scale=sc[0:128, :], moving_scale=sc[4:128, :])
        o = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=p)
        return hbm_out(o)
    r = k(s[1], m[1], packed)
    ref = np.einsum("kiq,kjq->ij", dequant(sv, s[2]), dequant(mv, m[2]))
    np.testing.assert_allclose(r, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def _mx_call(K=128, M=64, N=128, sx4=nl.float8_e4m3fn_x4, mx4=nl.float8_e4m3fn_x4, scale=nl.uint8,
             dst=nl.float32, dst_buf=nl.psum, srows=None, soff=0, target="trn3", **kw):
    @nki.jit(platform_target=target)
    def k():
        st = nl.ndarray((K, M), dtype=sx4, buffer=nl.sbuf)
        mv = nl.ndarray((K, N), dtype=mx4, buffer=nl.sbuf)
        rows = srows or 128
        ss = nl.ndarray((rows, M), dtype=scale, buffer=nl.sbuf)
        ms = nl.ndarray((128, N), dtype=scale, buffer=nl.sbuf)
        for t in (st, mv, ss, ms):
            nisa.memset(dst=t, value=0)
        p = nl.ndarray((M, N), dtype=dst, buffer=dst_buf)
        nisa.nc_matmul_mx(dst=p, stationary=st, moving=mv, stationary_scale=ss[soff:rows, :],
                          moving_scale=ms, **kw)
        return hbm_out(nl.zeros((1, 1), dtype=nl.float32, buffer=nl.sbuf))
    return k()


@pytest.mark.parametrize("kw,err,match", [
    (dict(target="trn2"), E.NkiRuleError, "NeuronCore-v4"),
    (dict(sx4=nl.bfloat16), E.DtypeLegalityError, "stationary dtype"),
    (dict(scale=nl.float32), E.DtypeLegalityError, "float8_e8m0fnu or uint8"),
    (dict(dst=nl.float16), E.DtypeLegalityError, "dst dtype"),
    (dict(K=96), E.MatmulTileError, "32, 64 or 128"),
    (dict(M=63), E.MatmulTileError, "even"),
    (dict(N=4097, dst_buf=nl.sbuf), E.MatmulTileError, "4096"),    # more than PSUM holds
    (dict(dst_buf=nl.sbuf), E.MemoryLegalityError, "PSUM"),
    (dict(soff=2), E.PartitionAlignmentError, "0, 4, 8 or 12"),
    (dict(srows=64), E.ShapeMismatchError, "at least 100 partitions"),
    (dict(K=32, tile_position=(0, 0), tile_size=(32, 64)), E.MatmulTileError, "row tiling"),
    (dict(K=64, tile_position=(0, 0), tile_size=(32, 128)), E.MatmulTileError, "32-row tile"),
    (dict(K=32, tile_position=(16, 0), tile_size=(32, 128)), E.MatmulTileError, "multiple"),
    (dict(tile_position=(0, 0)), E.MatmulTileError, "both"),
])
def test_nc_matmul_mx_rules(kw, err, match):
    with pytest.raises(err, match=match) as ei:
        _mx_call(**kw)
    assert "nc_matmul_mx" in str(ei.value)


def test_mx_dtypes_exist_with_their_sizes():
    assert (nl.float8_e5m2_x4.itemsize, nl.float8_e4m3fn_x4.itemsize, nl.float4_e2m1fn_x4.itemsize) == (4, 4, 2)
    assert nl.float8_e8m0fnu.itemsize == 1 and nl.float8_e8m0fnu.is_float
    assert not nl.float8_e4m3fn_x4.is_int and not nl.float8_e4m3fn_x4.is_float
    assert nl.as_dtype(mld.float8_e8m0fnu) == nl.float8_e8m0fnu
    assert nl.as_dtype("float4_e2m1fn_x4") == nl.float4_e2m1fn_x4


def quantize_reference(x, x4):
    """AWS's quantize_mx: X = 2**(floor(log2 amax) - (Emax - 1)) per 8x4 group."""
    P, F4 = x.shape
    g = x.astype(np.float64).reshape(P // 8, 8, F4 // 4, 4)
    amax = np.abs(g).max(axis=(1, 3))
    emax = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15}[x4]
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - (emax - 1), -127)
    q = (g / 2.0 ** e[:, None, :, None]).reshape(P, F4).astype(ELEM[x4])
    return q.view(np.uint32), (e + 127).astype(np.uint8)


def run_quantize(x, x4, scale_rows, scale_dtype=nl.uint8, scale_off=0):
    P, F4 = x.shape

    @nki.jit(platform_target="trn3")
    def k(x):
        d = nl.ndarray((P, F4 // 4), dtype=getattr(nl, x4), buffer=nl.sbuf)
        s = nl.ndarray((scale_rows, F4 // 4), dtype=scale_dtype, buffer=nl.sbuf)
        if scale_dtype == nl.uint8:
            nisa.memset(dst=s, value=0)
        nisa.quantize_mx(dst=d, src=sbuf(x), dst_scale=s[scale_off:scale_rows, :])
        return hbm_out(d, nl.uint32), hbm_out(s)
    return k(x)


@pytest.mark.parametrize("x4", ["float8_e4m3fn_x4", "float8_e5m2_x4"])
@pytest.mark.parametrize("P", [32, 96, 128])
def test_quantize_mx_equals_aws_formula(x4, P):
    mag = 10.0 ** RNG.integers(-4, 4, (P, 1))
    x = (RNG.standard_normal((P, 256)) * mag).astype(BF16)
    x[8:16, 4:8] = 0                                       # an all-zero group
    words, scales = run_quantize(x, x4, P // 8 if P <= 32 else P)
    ref_words, ref_codes = quantize_reference(x, x4)
    np.testing.assert_array_equal(words, ref_words)
    np.testing.assert_array_equal(scales, hw_scales(ref_codes, scales.shape[0]))
    assert ref_codes[1, 1] == 0                            # the zero group's scale is 2**-127


def test_quantize_mx_float16_e8m0_scales_at_offset_and_roundtrip():
    x = RNG.standard_normal((64, 128)).astype(np.float16)
    words, scales = run_quantize(x, "float8_e4m3fn_x4", 64, nl.float8_e8m0fnu, scale_off=8)
    ref_words, ref_codes = quantize_reference(x, "float8_e4m3fn_x4")
    np.testing.assert_array_equal(words, ref_words)
    assert scales.dtype == mld.float8_e8m0fnu
    got = scales.view(np.uint8)
    np.testing.assert_array_equal(got[8:12], ref_codes[0:4])
    np.testing.assert_array_equal(got[40:44], ref_codes[4:8])
    # Dequantized MXFP8 is within fp8's relative precision (3 mantissa bits) of the input.
    back = dequant(words.view(mld.float8_e4m3fn).astype(np.float32), ref_codes).reshape(64, 128)
    np.testing.assert_allclose(back, x.astype(np.float64), rtol=2 ** -3, atol=2 ** -9 * np.abs(x).max())


def test_quantize_then_matmul_mx_approximates_the_float_matmul():
    a = RNG.standard_normal((128, 4 * 64)).astype(BF16)
    b = RNG.standard_normal((128, 4 * 128)).astype(BF16)

    @nki.jit(platform_target="trn3")
    def k(a, b):
        qs = []
        for t in (a, b):
            F = t.shape[1] // 4
            d = nl.ndarray((128, F), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
            s = nl.ndarray((128, F), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.quantize_mx(dst=d, src=sbuf(t), dst_scale=s)
            qs += [d, s]
        p = nl.ndarray((64, 128), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=p, stationary=qs[0], moving=qs[2], stationary_scale=qs[1], moving_scale=qs[3])
        o = nl.ndarray((64, 128), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=p)
        return hbm_out(o)
    r = k(a, b)
    a64, b64 = a.astype(np.float64).reshape(128, 64, 4), b.astype(np.float64).reshape(128, 128, 4)
    ref = np.einsum("kiq,kjq->ij", a64, b64)
    assert np.abs(r - ref).max() < 0.1 * np.abs(ref).max()


def _quantize_call(src_dtype=nl.bfloat16, dst_dtype=nl.float8_e4m3fn_x4, P=32, F=16, src_buf=nl.sbuf,
                   scale_at=0, target="trn3"):
    @nki.jit(platform_target=target)
    def k():
        s = nl.ndarray((P, 4 * F), dtype=src_dtype, buffer=src_buf)
        nisa.memset(dst=s, value=1.0)
        d = nl.ndarray((P, F), dtype=dst_dtype, buffer=nl.sbuf)
        sc = nl.ndarray((128, F), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=d, src=s, dst_scale=sc[scale_at:128, :])
        return hbm_out(nl.zeros((1, 1), dtype=nl.float32, buffer=nl.sbuf))
    return k()


@pytest.mark.parametrize("kw,err,match", [
    (dict(target="trn2"), E.NkiRuleError, "NeuronCore-v4"),
    (dict(src_dtype=nl.float32), E.DtypeLegalityError, "float16 or bfloat16"),
    (dict(dst_dtype=nl.float4_e2m1fn_x4), E.DtypeLegalityError, "float8_e5m2_x4 or float8_e4m3fn_x4"),
    (dict(P=16), E.ShapeMismatchError, "multiple of 32"),
    (dict(src_buf=nl.psum), E.MemoryLegalityError, "SBUF"),
    (dict(scale_at=32), E.PartitionAlignmentError, "quadrant"),
    (dict(scale_at=6), E.PartitionAlignmentError, "0, 4, 8 or 12"),
])
def test_quantize_mx_rules(kw, err, match):
    with pytest.raises(err, match=match) as ei:
        _quantize_call(**kw)
    assert "quantize_mx" in str(ei.value)


def test_nc_matmul_mx_costs_a_bf16_matmul_of_the_same_tile():
    """4x the contraction in the cycles nc_matmul takes for the same [K, M] x [K, N] tile."""
    def busy(mx):
        @nki.jit
        def k():
            p = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            dt = nl.float8_e4m3fn_x4 if mx else nl.bfloat16
            st, mv = (nl.ndarray(s, dtype=dt, buffer=nl.sbuf) for s in ((128, 128), (128, 512)))
            sc = [nl.ndarray((128, n), dtype=nl.uint8, buffer=nl.sbuf) for n in (128, 512)]
            for t in [st, mv] + sc:
                nisa.memset(dst=t, value=0)
            if mx:
                nisa.nc_matmul_mx(dst=p, stationary=st, moving=mv, stationary_scale=sc[0], moving_scale=sc[1])
            else:
                nisa.nc_matmul(dst=p, stationary=st, moving=mv)
            return hbm_out(nl.zeros((1, 1), dtype=nl.float32, buffer=nl.sbuf))
        return nki.benchmark(k, target="trn3")().engine_busy_ns["tensor"]
    assert busy(True) == pytest.approx(busy(False))


# ----------------------------------------------------------------------------------------
# tensor_scalar_cumulative


def run_cumulative(x, op0, op1, imm0, imm1=None, cmd=nisa.reduce_cmd.reset_reduce, chain=False, dtype=None):
    vec = [isinstance(v, np.ndarray) for v in (imm0, imm1)]

    @nki.jit
    def k(x, *imms):
        it = iter(imms)
        i0 = sbuf(next(it)) if vec[0] else imm0
        i1 = sbuf(next(it)) if vec[1] else imm1
        d = nl.ndarray(x.shape, dtype=dtype or x.dtype, buffer=nl.sbuf)
        src = sbuf(x)
        nisa.tensor_scalar_cumulative(dst=d, src=src, op0=op0, op1=op1, imm0=i0, imm1=i1, reduce_cmd=cmd)
        if chain:
            nisa.tensor_scalar_cumulative(dst=d, src=src, op0=op0, op1=op1, imm0=i0, imm1=i1,
                                          reduce_cmd=nisa.reduce_cmd.reduce)
        return hbm_out(d)
    return np.asarray(k(x, *[v for v, is_vec in zip((imm0, imm1), vec) if is_vec]), np.float32)


@pytest.mark.parametrize("op1,acc", [(nl.add, np.add), (nl.multiply, np.multiply),
                                     (nl.maximum, np.maximum), (nl.min, np.minimum)])
def test_tensor_scalar_cumulative_scans_like_numpy(op1, acc):
    x = RNG.uniform(0.5, 1.5, (128, 48)).astype(np.float32)
    imm0 = RNG.uniform(-0.2, 0.2, (128, 1)).astype(np.float32)
    r = run_cumulative(x, nl.add, op1, imm0)
    np.testing.assert_allclose(r, acc.accumulate(x + imm0, axis=1), rtol=1e-6)


def test_tensor_scalar_cumulative_subtract_alternates():
    x = RNG.standard_normal((32, 9)).astype(np.float32)
    r = run_cumulative(x, nl.multiply, nl.subtract, 2.0)
    reg, ref = np.zeros(32, np.float32), np.empty_like(x)
    for i in range(9):
        reg = 2 * x[:, i] - reg
        ref[:, i] = reg
    np.testing.assert_allclose(r, ref, rtol=1e-6)


def test_tensor_scalar_cumulative_load_reduce_and_chained_reduce():
    x = np.ones((128, 64), np.float32)
    imm1 = RNG.uniform(-3, 3, (128, 1)).astype(np.float32)
    r = run_cumulative(x, nl.add, nl.add, 0.0, imm1, cmd=nisa.reduce_cmd.load_reduce)
    np.testing.assert_allclose(r, np.cumsum(x, axis=1) + imm1, rtol=1e-6)
    r = run_cumulative(x, nl.add, nl.add, 0.0, 1.0, cmd=nisa.reduce_cmd.load_reduce, chain=True)
    np.testing.assert_array_equal(r, np.cumsum(x, axis=1) + 65)       # AWS's chain example
    r = run_cumulative(x, nl.add, nl.multiply, 1.0, 0.0, cmd=nisa.reduce_cmd.load_reduce)
    np.testing.assert_array_equal(r, 0 * x)


def test_tensor_scalar_cumulative_rounds_into_bf16():
    x = RNG.standard_normal((16, 200)).astype(BF16)
    r = run_cumulative(x, nl.multiply, nl.add, 0.5, dtype=nl.bfloat16)
    ref = np.add.accumulate(x.astype(np.float32) * np.float32(0.5), axis=1)
    np.testing.assert_array_equal(r, ref.astype(BF16).astype(np.float32))


@pytest.mark.parametrize("kw,err,match", [
    (dict(dtype=nl.int32), E.DtypeLegalityError, "int32"),
    (dict(op1=nl.divide), E.NkiRuleError, "op1"),
    (dict(cmd=nisa.reduce_cmd.load_reduce), E.NkiRuleError, "imm1"),
    (dict(cmd=nisa.reduce_cmd.idle), E.NkiRuleError, "reduce_cmd"),
])
def test_tensor_scalar_cumulative_rules(kw, err, match):
    args = dict(op1=nl.add, cmd=nisa.reduce_cmd.reset_reduce, dtype=None)
    args.update(kw)
    x = np.ones((8, 8), np.float32)
    with pytest.raises(err, match=match) as ei:
        run_cumulative(x, nl.add, args["op1"], 0.0, cmd=args["cmd"], dtype=args["dtype"])
    assert "tensor_scalar_cumulative" in str(ei.value)


def test_tensor_scalar_cumulative_imm_must_be_float32():
    x = np.ones((8, 8), np.float32)
    with pytest.raises(E.DtypeLegalityError, match="imm0 must be float32"):
        run_cumulative(x, nl.add, nl.add, np.ones((8, 1), BF16))


# ----------------------------------------------------------------------------------------
# activate2 (trn3 ScalarE)


def run_act2(x, target="trn3", reduce_res=False, chain=False, **kw):
    @nki.jit(platform_target=target)
    def k(x):
        d = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        rr = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf) if reduce_res else None
        t = sbuf(x)
        if chain:
            nisa.activate2(dst=d, data=t, **dict(kw, reduce_cmd=nisa.reduce_cmd.reset_reduce))
            kw["reduce_cmd"] = nisa.reduce_cmd.reduce
        nisa.activate2(dst=d, data=t, reduce_res=rr, **kw)
        return (hbm_out(d), hbm_out(rr)) if reduce_res else hbm_out(d)
    return k(x)


def test_activate2_scale_bias_gelu_like_aws_example():
    x = RNG.standard_normal((128, 64)).astype(np.float32)
    r = run_act2(x, op=nl.gelu, imm0=2.0, imm1=0.5, op0=nl.multiply, op1=nl.add)
    from math import erf
    v = x.astype(np.float64) * 2 + 0.5
    np.testing.assert_allclose(r, 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2))), rtol=1e-5, atol=1e-6)


def test_activate2_reversed_subtract_vector_imm_and_bypass():
    x = RNG.standard_normal((64, 32)).astype(np.float32)
    imm = RNG.standard_normal((64, 1)).astype(np.float32)

    @nki.jit(platform_target="trn3")
    def k(x, imm):
        d1 = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        d2 = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        t, i = sbuf(x), sbuf(imm)
        nisa.activate2(dst=d1, op=nl.exp, data=t, imm0=i, imm1=0.0, op0=nl.subtract, op1=nl.bypass, reverse0=True)
        nisa.activate2(dst=d2, op=nl.copy, data=t, imm0=0.0, imm1=0.0, op0=nl.bypass, op1=nl.bypass)
        return hbm_out(d1), hbm_out(d2)
    r1, r2 = k(x, imm)
    np.testing.assert_allclose(r1, np.exp(imm - x), rtol=1e-6)
    np.testing.assert_array_equal(r2, x)


def _signed_absmax(y):
    return np.take_along_axis(y, np.abs(y).argmax(1)[:, None], 1)


@pytest.mark.parametrize("rop,ref", [(nl.maximum, lambda y: y.max(1, keepdims=True)),
                                     (nl.minimum, lambda y: y.min(1, keepdims=True)),
                                     (nl.add, lambda y: y.sum(1, keepdims=True)),
                                     (nl.abs_max, _signed_absmax)])
def test_activate2_reduces_into_reduce_res(rop, ref):
    x = RNG.standard_normal((128, 40)).astype(np.float32)
    d, rr = run_act2(x, reduce_res=True, op=nl.tanh, imm0=3.0, imm1=1.0, op0=nl.multiply, op1=nl.subtract,
                     reduce_op=rop, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    y = np.tanh(x * np.float32(3) - np.float32(1))
    np.testing.assert_allclose(d, y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rr, ref(y), rtol=1e-5, atol=1e-6)


def test_activate2_reduce_continues_across_calls():
    x = RNG.standard_normal((32, 16)).astype(np.float32)
    _, rr = run_act2(x, reduce_res=True, chain=True, op=nl.copy, imm0=1.0, imm1=0.0, op0=nl.multiply,
                     op1=nl.bypass, reduce_op=nl.add)
    np.testing.assert_allclose(rr, 2 * x.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw,err,match", [
    (dict(target="trn2"), E.NkiRuleError, "NeuronCore-v4"),
    (dict(op0=nl.add, op1=nl.add), E.NkiRuleError, r"\(add, add\)"),
    (dict(op0=nl.bypass, op1=nl.bypass, reverse0=True), E.NkiRuleError, "reverse0"),
    (dict(reduce_cmd=nisa.reduce_cmd.reset_reduce), E.NkiRuleError, "reduce_op"),
    (dict(reduce_op=nl.multiply, reduce_cmd=nisa.reduce_cmd.reduce), E.NkiRuleError, "reduce_op"),
])
def test_activate2_rules(kw, err, match):
    args = dict(op=nl.exp, imm0=1.0, imm1=0.0, op0=nl.multiply, op1=nl.add)
    args.update(kw)
    with pytest.raises(err, match=match) as ei:
        run_act2(np.ones((8, 8), np.float32), **args)
    assert "activate2" in str(ei.value)


# ----------------------------------------------------------------------------------------
# GpSimd: nc_n_gather, sequence_bounds, nonzero_with_count


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32])
def test_nc_n_gather_flattens_data_free_dims(dtype):
    data = RNG.integers(-100, 100, (64, 8, 130)).astype(dtype)     # 1040 elements: 3 groups of 512
    idx = RNG.integers(0, 1040, (64, 3, 50)).astype(np.uint32)
    r = run_instr(lambda d, a, i: nisa.nc_n_gather(dst=d, data=a, indices=i), [data, idx], (64, 3, 50),
                  data.dtype)
    ref = np.take_along_axis(data.reshape(64, -1), idx.reshape(64, -1).astype(np.int64), 1).reshape(64, 3, 50)
    np.testing.assert_array_equal(r, ref.astype(np.float32) if dtype is not np.int32 else ref)


@pytest.mark.parametrize("idx_dtype,dst_dtype,hi,err,match", [
    (np.uint32, np.float32, 17, E.IndexOutOfBoundsError, r"\[0, 16\)"),
    (np.int32, np.float32, 16, E.DtypeLegalityError, "uint32"),
    (np.uint32, BF16, 16, E.DtypeLegalityError, "must equal data dtype"),
])
def test_nc_n_gather_rules(idx_dtype, dst_dtype, hi, err, match):
    data = np.zeros((4, 16), np.float32)
    idx = np.full((4, 2), hi - 1).astype(idx_dtype)
    with pytest.raises(err, match=match) as ei:
        run_instr(lambda d, a, i: nisa.nc_n_gather(dst=d, data=a, indices=i), [data, idx], (4, 2), dst_dtype)
    assert "nc_n_gather" in str(ei.value)


def bounds_reference(s):
    """AWS's compute_sequence_bounds (test_nki_isa_sequence_bounds.py), for one row."""
    n = len(s)
    lo, hi = np.zeros(n), np.zeros(n)
    lo[0] = 0 if s[0] != 0 else n
    for i in range(1, n):
        lo[i] = n if s[i] == 0 else (lo[i - 1] if s[i] == s[i - 1] else i)
    hi[-1] = n if s[-1] != 0 else -1
    for i in range(n - 2, -1, -1):
        hi[i] = -1 if s[i] == 0 else (hi[i + 1] if s[i] == s[i + 1] else i + 1)
    return np.stack([lo, hi])[None]


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_sequence_bounds_matches_aws_reference(dtype):
    ex = np.array([[0, 1, 1, 2, 2, 2, 0, 3, 3]], dtype)
    r = run_instr(lambda d, s: nisa.sequence_bounds(dst=d, segment_ids=s), [ex], (1, 2, 9), dtype)
    np.testing.assert_array_equal(r, [[[9, 1, 1, 3, 3, 3, 9, 7, 7], [-1, 3, 3, 6, 6, 6, -1, 9, 9]]])
    s = np.sort(RNG.integers(0, 40, 512))[None].astype(dtype)
    s[0, 300:310] = 0
    r = run_instr(lambda d, x: nisa.sequence_bounds(dst=d, segment_ids=x), [s], (1, 2, 512), dtype)
    np.testing.assert_array_equal(r, bounds_reference(s[0]))


@pytest.mark.parametrize("shape,dtype,err,match", [((2, 8), np.float32, E.ShapeMismatchError, "must be"),
                                                   ((1, 8), BF16, E.DtypeLegalityError, "float32 or int32")])
def test_sequence_bounds_rules(shape, dtype, err, match):
    with pytest.raises(err, match=match) as ei:
        run_instr(lambda d, s: nisa.sequence_bounds(dst=d, segment_ids=s), [np.ones(shape, dtype)],
                  (shape[0], 2, shape[1]), np.float32)
    assert "sequence_bounds" in str(ei.value)


def run_nonzero(x, target=None, dst_dtype=nl.int32, extra=1, **kw):
    @nki.jit(platform_target=target)
    def k(x):
        d = nl.ndarray((x.shape[0], x.shape[1] + extra), dtype=dst_dtype, buffer=nl.sbuf)
        nisa.memset(dst=d, value=7)
        nisa.nonzero_with_count(dst=d, src=sbuf(x), **kw)
        return hbm_out(d)
    return k(x)


def test_nonzero_with_count_aws_example_and_only_core_partitions():
    r = run_nonzero(np.array([[0, 1, 1, 0, 0, 1, 0, 0]], np.float32), index_offset=16, padding_val=-1)
    np.testing.assert_array_equal(r, [[17, 18, 21, -1, -1, -1, -1, -1, 3]])
    x = (RNG.random((128, 40)) < 0.3).astype(np.int32) * RNG.integers(1, 9, (128, 40)).astype(np.int32)
    r = run_nonzero(x, padding_val=-5)
    for p in range(128):
        if p % 16:
            assert (r[p] == 7).all()                       # untouched: only core partition 0 works
            continue
        nz = np.flatnonzero(x[p])
        ref = np.r_[nz, np.full(40 - len(nz), -5), len(nz)]
        np.testing.assert_array_equal(r[p], ref)


@pytest.mark.parametrize("kw,err,match", [
    (dict(target="trn1"), E.NkiRuleError, "NeuronCore-v3"),
    (dict(dst_dtype=nl.float32), E.DtypeLegalityError, "int32"),
    (dict(extra=0), E.ShapeMismatchError, "elements per partition"),
    (dict(index_offset=1.5), E.DtypeLegalityError, "index_offset"),
])
def test_nonzero_with_count_rules(kw, err, match):
    with pytest.raises(err, match=match) as ei:
        run_nonzero(np.ones((16, 8), np.float32), **kw)
    assert "nonzero_with_count" in str(ei.value)


# ----------------------------------------------------------------------------------------
# nc_stream_shuffle


def test_nc_stream_shuffle_per_quadrant_with_unmodified_partitions():
    x = RNG.standard_normal((128, 24)).astype(np.float32)
    mask = list(RNG.permutation(32))
    mask[5] = 255

    @nki.jit
    def k(x):
        t, d = sbuf(x), nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=d, value=-1.0)
        nisa.nc_stream_shuffle(dst=d, src=t, shuffle_mask=mask)
        nisa.nc_stream_shuffle(dst=t, src=t, shuffle_mask=[31 - i for i in range(32)])   # in place
        return hbm_out(d), hbm_out(t)
    d, t = k(x)
    for q in range(4):
        for i in range(32):
            want = -1.0 if mask[i] == 255 else x[q * 32 + mask[i]]
            np.testing.assert_array_equal(d[q * 32 + i], want)
            np.testing.assert_array_equal(t[q * 32 + i], x[q * 32 + 31 - i])


def test_nc_stream_shuffle_between_quadrants():
    x = RNG.standard_normal((64, 8)).astype(BF16)

    @nki.jit
    def k(x):
        t = sbuf(x)
        d = nl.ndarray((64, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(dst=d[0:32], src=t[32:64], shuffle_mask=list(range(32)))
        nisa.nc_stream_shuffle(dst=d[32:64], src=t[0:32], shuffle_mask=list(range(32)))
        return hbm_out(d)
    np.testing.assert_array_equal(k(x), np.r_[x[32:], x[:32]])


@pytest.mark.parametrize("mask,P,dst_dtype,err,match", [
    (list(range(31)), 32, nl.float32, E.NkiRuleError, "32 source partitions"),
    ([40] * 32, 32, nl.float32, E.NkiRuleError, "32 source partitions"),
    (list(range(32)), 32, nl.bfloat16, E.DtypeLegalityError, "dtype"),
    ([0] * 31 + [20], 16, nl.float32, E.IndexOutOfBoundsError, "partition 20"),
])
def test_nc_stream_shuffle_rules(mask, P, dst_dtype, err, match):
    with pytest.raises(err, match=match) as ei:
        run_instr(lambda d, s: nisa.nc_stream_shuffle(dst=d, src=s, shuffle_mask=mask),
                  [np.ones((P, 4), np.float32)], (32, 4), dst_dtype)
    assert "nc_stream_shuffle" in str(ei.value)


# ----------------------------------------------------------------------------------------
# XORWOW random numbers: rand_set_state / rand_get_state / rand2 (and rng after a state load)


def xorwow(state, n):
    """Marsaglia's xorwow on one lane's (x0..x4, counter): n outputs and the new state."""
    x, d = [int(v) for v in state[:5]], int(state[5])
    out, m = [], 0xFFFFFFFF
    for _ in range(n):
        t, s = x[4], x[0]
        x = [0, s, x[1], x[2], x[3]]
        t ^= t >> 2
        t = (t ^ (t << 1)) & m
        t ^= s ^ ((s << 4) & m)
        x[0] = t
        d = (d + 362437) & m
        out.append((t + d) & m)
    return out, x + [d]


def test_gpsimd_state_roundtrips_and_drives_rng():
    seeds = RNG.integers(1, 2 ** 32, (128, 6), dtype=np.uint64).astype(np.uint32)

    @nki.jit
    def k(seeds):
        nisa.rand_set_state(src_seeds=sbuf(seeds))
        bits = nl.ndarray((128, 5), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.rng(dst=bits, engine=nisa.engine.gpsimd)
        st = nl.ndarray((128, 6), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.rand_get_state(dst=st)
        return hbm_out(bits), hbm_out(st)
    bits, st = k(seeds)
    for p in (0, 77, 127):
        ref, new = xorwow(seeds[p], 5)
        assert list(bits[p]) == ref and list(st[p]) == new


def test_rand2_is_uniform_in_range_and_reproducible_from_a_state():
    seeds = RNG.integers(1, 2 ** 32, (128, 24), dtype=np.uint64).astype(np.uint32)
    lo = RNG.uniform(-5, 0, (128, 1)).astype(np.float32)

    @nki.jit(platform_target="trn3")
    def k(seeds, lo):
        s, l = sbuf(seeds), sbuf(lo)
        outs = []
        for dt, mn, mx in ((nl.float32, -2.0, 3.0), (nl.float32, -2.0, 3.0), (nl.float32, l, 10.0),
                           (nl.int32, 0.0, 9.0)):
            nisa.rand_set_state(src_seeds=s, engine=nisa.engine.vector)
            d = nl.ndarray((128, 256), dtype=dt, buffer=nl.sbuf)
            nisa.rand2(dst=d, min=mn, max=mx)
            outs.append(hbm_out(d))
        return tuple(outs)
    a, b, c, i = k(seeds, lo)
    np.testing.assert_array_equal(a, b)
    assert a.min() >= -2 and a.max() < 3 and abs(a.mean() - 0.5) < 0.05
    assert (c >= lo).all() and (c < 10).all()
    assert set(np.unique(i)) <= set(range(10))
    # Element j of a lane comes from its state j % 4, a 24-bit fraction of the 32-bit draw.
    ref, _ = xorwow(seeds[3, 6:12], 2)
    np.testing.assert_allclose(a[3, [1, 5]], -2 + 5 * (np.array(ref) >> 8) / 2 ** 24, rtol=1e-6)


def test_set_rng_seed_makes_rand2_reproducible():
    @nki.jit(platform_target="trn3")
    def k():
        outs = []
        for _ in range(2):
            nisa.set_rng_seed(src_seeds=nl.full((1, 1), 1234, dtype=nl.uint32, buffer=nl.sbuf))
            d = nl.ndarray((32, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.rand2(dst=d, min=0.0, max=1.0)
            outs.append(hbm_out(d))
        return tuple(outs)
    a, b = k()
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fn,target,err,match", [
    (lambda t: nisa.rand2(dst=t, min=0.0, max=1.0), "trn2", E.NkiRuleError, "rand2 needs NeuronCore-v4"),
    (lambda t: nisa.rand2(dst=t, min=1.0, max=1.0), "trn3", E.NkiRuleError, "less than max"),
    (lambda t: nisa.rand_get_state(dst=t, engine=nisa.engine.vector), "trn2", E.NkiRuleError, "on vector"),
    (lambda t: nisa.rand_get_state(dst=t), "trn1", E.NkiRuleError, "NeuronCore-v3"),
    (lambda t: nisa.rand_get_state(dst=t, engine=nisa.engine.vector), "trn3", E.ShapeMismatchError, "24"),
    (lambda t: nisa.rand_set_state(src_seeds=t, engine=nisa.engine.scalar), "trn3", E.NkiRuleError, "engine"),
])
def test_random_state_rules(fn, target, err, match):
    @nki.jit(platform_target=target)
    def k():
        t = nl.ndarray((8, 6), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1)
        fn(t)
        return hbm_out(t)
    with pytest.raises(err, match=match):
        k()


def test_rand_state_tiles_must_be_uint32():
    @nki.jit(platform_target="trn3")
    def k():
        t = nl.ndarray((8, 6), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1)
        nisa.rand_set_state(src_seeds=t)
        return hbm_out(t)
    with pytest.raises(E.DtypeLegalityError, match="rand_set_state: src_seeds must be uint32"):
        k()


# ----------------------------------------------------------------------------------------
# dma_compute


def test_dma_compute_sums_sources_in_float32():
    a = RNG.standard_normal((64, 32)).astype(np.float32)
    b = RNG.standard_normal((64, 32)).astype(BF16)
    c = RNG.standard_normal((64, 32)).astype(np.float32)

    @nki.jit
    def k(a, b, c):
        d = nl.ndarray((64, 32), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_compute(dst=d, srcs=[a, sbuf(b), c], reduce_op=nl.add, scales=[1.0, 1.0, 1.0])
        out = nl.ndarray((64, 32), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_compute(dst=out, srcs=[d, d], reduce_op=nl.add)
        return out
    ref = (a + b.astype(np.float32) + c).astype(BF16).astype(np.float32)
    np.testing.assert_array_equal(k(a, b, c), 2 * ref)


@pytest.mark.parametrize("kw,err,match", [
    (dict(reduce_op=nl.multiply), E.NkiRuleError, "nl.add"),
    (dict(scales=[2.0, 1.0]), E.NkiRuleError, "scales"),
    (dict(n=17), E.NkiRuleError, "1 to 16"),
    (dict(shape=(8, 9)), E.ShapeMismatchError, "numbers of elements"),
])
def test_dma_compute_rules(kw, err, match):
    a = np.ones((8, 8), np.float32)
    b = np.ones(kw.pop("shape", (8, 8)), np.float32)
    n = kw.pop("n", 2)

    @nki.jit
    def k(a, b):
        d = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(dst=d, srcs=[a] * (n - 1) + [b], **dict(dict(reduce_op=nl.add), **kw))
        return hbm_out(d)
    with pytest.raises(err, match=match) as ei:
        k(a, b)
    assert "dma_compute" in str(ei.value)


# ----------------------------------------------------------------------------------------
# What stays missing says why.


@pytest.mark.parametrize("name,match", [("tensor_copy_dynamic_src", "removed in NKI 0.4.0"),
                                        ("tensor_copy_dynamic_dst", "removed in NKI 0.4.0")])
def test_unsupported_instructions_say_why(name, match):
    with pytest.raises(E.UnsupportedError, match=f"nki.isa.{name}.*{match}"):
        getattr(nisa, name)


def test_unary_arithmetic_operators_in_alu_slots():
    """AWS's arithmetic-operator table lists abs, reciprocal, rsqrt and logical_not for the
    ALUs: in an operator slot they act on the data and ignore the operand (AWS's
    rmsnorm_quant: |x| and its row maximum in one tensor_scalar_reduce)."""
    x = np.random.default_rng(3).standard_normal((128, 64)).astype(np.float32)

    @nki.jit
    def k(x):
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        outs = []
        a = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        m = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=a, data=t, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum,
                                  reduce_res=m)
        r = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=r, data=t, op0=nl.reciprocal, operand0=7.0, op1=nl.multiply,
                           operand1=2.0)
        for s in (a, m, r):
            o = nl.ndarray(s.shape, dtype=nl.float32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=o, src=s)
            outs.append(o)
        return outs
    a, m, r = (np.asarray(o) for o in k(x))
    np.testing.assert_array_equal(a, np.abs(x))
    np.testing.assert_array_equal(m[:, 0], np.abs(x).max(1))
    np.testing.assert_allclose(r, 2 / x, rtol=1e-6)

    @nki.jit
    def exp_in_alu(x):
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.exp, operand0=0.0)
        return x
    with pytest.raises(E.NkiRuleError, match="exp is an activation function, not an ALU"):
        exp_in_alu(x)
