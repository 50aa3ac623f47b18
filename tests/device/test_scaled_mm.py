"""torch._scaled_mm, _scaled_mm_v2 (torch.nn.functional.scaled_mm) and _scaled_grouped_mm on
neuron: CPU's bits where CPU has the form, otherwise a float64 reference of the dequantized
operands rounded once; CUDA's checks on scale shapes and layouts; charged at FP8/MX rates."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import ScalingType as S, SwizzleType as W
from torch.testing._internal.common_quantized import (_floatx_unpacked_to_f32, to_blocked,
                                                       to_mxfp)

import neuronhw
from torch_neuronx import cost_model

# trn2's one-time "no MX matmul path" warning: asserted once below, expected elsewhere.
pytestmark = pytest.mark.filterwarnings("ignore:.*no MX matmul path:UserWarning")

DEV = "neuron"
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def n(t):
    return None if t is None else t.to(DEV)


def _fp8(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(dtype)


def _operands(m, k, nn, da=E4, db=E4, seed=0):
    a = _fp8((m, k), da, seed)
    b = _fp8((nn, k), db, seed + 1).t()  # column-major, as cuBLAS wants it
    return a, b


# --- tensorwise and rowwise: CPU's kernel, CPU's bits ---
@pytest.mark.parametrize("dtypes", [(E4, E4), (E4, E5), (E5, E4)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16, None])
@pytest.mark.parametrize("rowwise", [False, True])
def test_tensorwise_rowwise_match_cpu_bitwise(dtypes, out_dtype, rowwise):
    a, b = _operands(48, 96, 80, *dtypes)
    if rowwise:
        sa, sb = torch.rand(48, 1) + 0.25, torch.rand(1, 80) + 0.25
    else:
        sa, sb = torch.tensor(0.75), torch.tensor(1.5)
    if rowwise and out_dtype is None:
        out_dtype = torch.bfloat16
    for fast in (False, True):
        want = torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype, use_fast_accum=fast)
        got = torch._scaled_mm(n(a), n(b), n(sa), n(sb), out_dtype=out_dtype, use_fast_accum=fast)
        assert got.device.type == DEV and got.dtype == want.dtype
        assert torch.equal(got.cpu().view(torch.uint8) if got.dtype.itemsize == 1 else got.cpu(),
                           want.view(torch.uint8) if want.dtype.itemsize == 1 else want)


def test_tensorwise_bias_scale_result_and_out_match_cpu():
    a, b = _operands(32, 64, 48)
    sa, sb, bias = torch.tensor(0.5), torch.tensor(2.0), torch.randn(48).bfloat16()
    want = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    got = torch._scaled_mm(n(a), n(b), n(sa), n(sb), bias=n(bias), out_dtype=torch.bfloat16)
    assert torch.equal(got.cpu(), want)
    want8 = torch._scaled_mm(a, b, sa, sb, scale_result=torch.tensor(4.0), out_dtype=E4)
    got8 = torch._scaled_mm(n(a), n(b), n(sa), n(sb), scale_result=n(torch.tensor(4.0)), out_dtype=E4)
    assert torch.equal(got8.cpu().view(torch.uint8), want8.view(torch.uint8))
    out = torch.empty(1, dtype=torch.bfloat16, device=DEV)
    r = torch._scaled_mm(n(a), n(b), n(sa), n(sb), out_dtype=torch.bfloat16, out=out)
    assert r is out and torch.equal(out.cpu(), torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16))


@pytest.mark.parametrize("recipe", [S.TensorWise, S.RowWise])
def test_v2_tensorwise_rowwise_match_cpu(recipe):
    a, b = _operands(32, 64, 48)
    if recipe == S.TensorWise:
        sa, sb = torch.tensor(0.5), torch.tensor(3.0)
    else:
        sa, sb = torch.rand(32, 1) + 0.5, torch.rand(1, 48) + 0.5
    want = F.scaled_mm(a, b, sa, recipe, sb, recipe)
    got = F.scaled_mm(n(a), n(b), n(sa), recipe, n(sb), recipe)
    assert got.dtype == torch.bfloat16 and torch.equal(got.cpu(), want)


# --- blockwise and MX: a float64 reference, rounded once ---
def _check_one_rounding(got, a64, b64, bias=None):
    """``got`` is the exact product of the dequantized operands up to fp32 accumulation error
    and one rounding to its dtype."""
    exact = a64 @ b64
    if bias is not None:
        exact = exact + bias.double()
    worst = a64.abs() @ b64.abs()
    bound = torch.finfo(got.dtype).eps * exact.abs() + 2.0 ** -20 * worst + 1e-30
    err = (got.cpu().double() - exact).abs()
    assert (err <= bound).all(), (err - bound).max()
    # and not merely close: a wrong block scale moves results by far more than the bound
    assert exact.abs().max() > 100 * bound.max()


def _blocks(s, rows, cols, br, bc):
    return s.double().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


M, K, N = 200, 320, 144   # ragged: 2 row tiles, 3 K blocks (the last half full), 2 column tiles
KB, MB, NB = 3, 2, 2


def _v1_scales(kind_a, kind_b, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.rand(*shape, generator=g) * 3 + 0.1
    # CUDA's layouts: 1x128 activation scales outer-dim-major, 128x128 weight scales
    # near-inner-dim-major; scale_b is given for mat2 (K x N).
    sa = r(KB, M).t() if kind_a == "1x128" else r(MB, KB)
    sb = r(KB, N) if kind_b == "1x128" else r(NB, KB).t()
    ref_a = _blocks(sa, M, K, 1, 128) if kind_a == "1x128" else _blocks(sa, M, K, 128, 128)
    ref_b = _blocks(sb, K, N, 128, 1) if kind_b == "1x128" else _blocks(sb, K, N, 128, 128)
    return sa, sb, ref_a, ref_b


@pytest.mark.parametrize("kinds", [("1x128", "128x128"), ("128x128", "1x128"), ("1x128", "1x128")])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_blockwise_v1(kinds, out_dtype):
    a, b = _operands(M, K, N)
    sa, sb, ra, rb = _v1_scales(*kinds)
    got = torch._scaled_mm(n(a), n(b), n(sa), n(sb), out_dtype=out_dtype)
    assert got.shape == (M, N) and got.dtype == out_dtype and got.device.type == DEV
    _check_one_rounding(got, a.double() * ra, b.double() * rb)


def test_blockwise_bias_and_fast_accum():
    a, b = _operands(M, K, N, E4, E5)
    sa, sb, ra, rb = _v1_scales("1x128", "128x128", seed=3)
    bias = torch.randn(N).bfloat16()
    got = torch._scaled_mm(n(a), n(b), n(sa), n(sb), bias=n(bias), out_dtype=torch.bfloat16,
                           use_fast_accum=True)
    _check_one_rounding(got, a.double() * ra, b.double() * rb, bias)


def test_blockwise_v2_layouts():
    a, b = _operands(256, 256, 256)
    g = torch.Generator().manual_seed(1)
    # v2 (CUDA's _scaled_mm_v2): 1x128 scales (rows, K/128) stride (1, rows); 128x128 scales
    # (round_up(K/128, 4), tiles) stride (1, round_up(K/128, 4)).
    sa = (torch.rand(2, 256, generator=g) + 0.5).t()
    sb128 = (torch.rand(2, 4, generator=g) + 0.5).t()
    got = F.scaled_mm(n(a), n(b), n(sa), S.BlockWise1x128, n(sb128), S.BlockWise128x128)
    _check_one_rounding(got, a.double() * _blocks(sa, 256, 256, 1, 128),
                        b.double() * _blocks(sb128[:2], 256, 256, 128, 128))
    sb1 = (torch.rand(2, 256, generator=g) + 0.5).t()   # (N, K/128), stride (1, N)
    got = F.scaled_mm(n(a), n(b), n(sa), S.BlockWise1x128, n(sb1), S.BlockWise1x128)
    _check_one_rounding(got, a.double() * _blocks(sa, 256, 256, 1, 128),
                        b.double() * _blocks(sb1.t(), 256, 256, 128, 1))
    sa128 = (torch.rand(2, 4, generator=g) + 0.5).t()
    got = F.scaled_mm(n(a), n(b), n(sa128), S.BlockWise128x128, n(sb1), S.BlockWise1x128)
    _check_one_rounding(got, a.double() * _blocks(sa128[:2].t(), 256, 256, 128, 128),
                        b.double() * _blocks(sb1.t(), 256, 256, 128, 1))


def _mx_reference(x, fmt):
    """(data, unswizzled scales, float64 dequantized) with PyTorch's MX helpers."""
    scale, data = to_mxfp(x, format=fmt)
    if fmt == "mxfp8":
        values = data.double()
    else:  # unpack the nibbles: element 2i in the low half of byte i
        u8 = data.view(torch.uint8)
        codes = torch.stack((u8 & 0xF, u8 >> 4), -1).flatten(-2)
        values = _floatx_unpacked_to_f32(codes, 2, 1).double()
    return data, scale, values * scale.double().repeat_interleave(32, 1)[:, :values.shape[1]]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8_e5m2", "mxfp4"])
@pytest.mark.parametrize("entry", ["v1", "v2"])
def test_mx(fmt, entry):
    m, k, nn = 160, 192, 96
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(nn, k, generator=g) * 4
    base = "mxfp4" if fmt == "mxfp4" else "mxfp8"
    if fmt == "mxfp4":
        x, w = x.bfloat16(), w.bfloat16()
    a, sa, a64 = _mx_reference(x, base)
    b, sb, b64 = _mx_reference(w, base)
    if fmt == "mxfp8_e5m2":  # E5M2 data, rescaled by the same E8M0 scales
        b = b.to(E5)
        b64 = b.double() * sb.double().repeat_interleave(32, 1)
    bsa, bsb = to_blocked(sa), to_blocked(sb)
    if entry == "v1":
        got = torch._scaled_mm(n(a), n(b).t(), n(bsa), n(bsb), out_dtype=torch.bfloat16)
    else:
        got = F.scaled_mm(n(a), n(b).t(), n(bsa), S.BlockWise1x32, n(bsb), S.BlockWise1x32,
                          swizzle_a=W.SWIZZLE_32_4_4, swizzle_b=W.SWIZZLE_32_4_4)
    assert got.shape == (m, nn) and got.dtype == torch.bfloat16
    _check_one_rounding(got, a64, b64.t())


# --- CUDA's errors ---
def test_v1_bad_scale_layouts_raise_cudas_error():
    a, b = _operands(M, K, N)
    sa, sb, _, _ = _v1_scales("1x128", "128x128")
    with pytest.raises(RuntimeError, match="Invalid scaling configuration"):  # row-major 1x128
        torch._scaled_mm(n(a), n(b), n(sa.contiguous()), n(sb), out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"scale_a should be \(200, 3\) and scale_b should be \(3, 144\)"):
        torch._scaled_mm(n(a), n(b), n(torch.ones(M, 2)), n(sb), out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Bias is not supported when out_dtype is set to Float32"):
        torch._scaled_mm(n(a), n(b), n(sa), n(sb), bias=n(torch.ones(N).bfloat16()), out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Bias must be BFloat16 to compute BFloat16 output"):
        torch._scaled_mm(n(a), n(b), n(sa), n(sb), bias=n(torch.ones(N).half()), out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(200x320 and 256x144\)"):
        torch._scaled_mm(n(a), n(b[:256]), n(sa), n(sb), out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="expected all tensors to be on neuron:0, but scale_b is on cpu"):
        torch._scaled_mm(n(a), n(b), n(sa), sb, out_dtype=torch.bfloat16)


def test_v2_bad_scales_raise_cudas_errors():
    a, b = _operands(256, 256, 256)
    with pytest.raises(ValueError, match=r"scale_a strides must be \(1, 256\); got \[2, 1\]"):
        F.scaled_mm(n(a), n(b), n(torch.ones(256, 2)), S.BlockWise1x128, n(torch.ones(2, 256).t()),
                    S.BlockWise1x128)
    with pytest.raises(ValueError, match="scale_b must have shape 4 x 2 Float elements"):
        F.scaled_mm(n(a), n(b), n(torch.ones(2, 256).t()), S.BlockWise1x128, n(torch.ones(2, 2).t()),
                    S.BlockWise128x128)
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        F.scaled_mm(n(a), n(b), n(torch.ones(256, 2)), S.BlockWise1x128, n(torch.ones(1)), S.TensorWise)
    x = torch.randn(256, 256)
    sa, qa = to_mxfp(x)
    bs = to_blocked(sa)
    with pytest.raises(ValueError, match="swizzle_a must have 1 value, got 0"):
        F.scaled_mm(n(qa), n(qa).t(), n(bs), S.BlockWise1x32, n(bs), S.BlockWise1x32)
    with pytest.raises(ValueError, match="scale_a must be swizzled to SWIZZLE_32_4_4 format"):
        F.scaled_mm(n(qa), n(qa).t(), n(bs), S.BlockWise1x32, n(bs), S.BlockWise1x32,
                    swizzle_a=W.NO_SWIZZLE, swizzle_b=W.SWIZZLE_32_4_4)
    with pytest.raises(ValueError, match="For Blockwise scaling scale_b should have 2048 elements, got: 1024"):
        F.scaled_mm(n(qa), n(qa).t(), n(bs), S.BlockWise1x32, n(bs[:1024]), S.BlockWise1x32,
                    swizzle_a=W.SWIZZLE_32_4_4, swizzle_b=W.SWIZZLE_32_4_4)


def test_nvfp4_is_refused_naming_mxfp4():
    a = torch.zeros(128, 64, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    s = torch.ones(128 * 8).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="NVFP4.*MXFP4"):
        torch._scaled_mm(n(a), n(a).t(), n(s), n(s), out_dtype=torch.bfloat16)


def test_no_autograd_as_on_cpu():
    a, b = _operands(16, 32, 16)
    outcomes = []
    for dev in ("cpu", DEV):
        x = a.to(dev).requires_grad_()
        y = torch._scaled_mm(x, b.to(dev), torch.tensor(1.0, device=dev), torch.tensor(1.0, device=dev),
                             out_dtype=torch.float32)
        with pytest.raises(RuntimeError) as e:
            y.sum().backward()
        outcomes.append(str(e.value))
    assert outcomes[0] == outcomes[1]


# --- _scaled_grouped_mm (MoE): rowwise FP8 scales, bf16 out ---
def _grouped_reference(a, b, sa, sb, offs):
    a64 = a.double() * sa.double()[..., None]
    b64 = b.double() * (sb.double()[:, None, :] if b.dim() == 3 else sb.double()[None, :])
    if a.dim() == 2 and b.dim() == 3:
        out, start = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64), 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = a64[start:end] @ b64[g]
            start = end
        return out
    if a.dim() == 3 and b.dim() == 3:
        return a64 @ b64
    raise AssertionError


def test_scaled_grouped_mm_2d_3d_and_3d_3d():
    g, m, k, nn = 4, 96, 128, 64
    a = _fp8((m, k), E4, 0)
    b = _fp8((g, nn, k), E4, 1).transpose(-2, -1)
    sa, sb = torch.rand(m) + 0.5, torch.rand(g, nn) + 0.5
    offs = torch.tensor([16, 16, 48, 96], dtype=torch.int32)   # one empty group
    got = torch._scaled_grouped_mm(n(a), n(b), n(sa), n(sb), n(offs), out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (m, nn)
    want = _grouped_reference(a, b, sa, sb, offs)
    torch.testing.assert_close(got.cpu().double(), want, rtol=2 ** -8, atol=1e-3)
    a3 = _fp8((g, 32, k), E4, 2)
    sa3 = torch.rand(g, 32) + 0.5
    got = torch._scaled_grouped_mm(n(a3), n(b), n(sa3), n(sb))
    torch.testing.assert_close(got.cpu().double(), _grouped_reference(a3, b, sa3, sb, None),
                               rtol=2 ** -8, atol=1e-3)


def test_scaled_grouped_mm_k_grouped():
    g, m, k, nn = 3, 32, 192, 48
    a = _fp8((m, k), E4, 0)
    b = _fp8((nn, k), E4, 1).t()
    offs = torch.tensor([64, 64, 192], dtype=torch.int32)
    sa, sb = torch.rand(g * m) + 0.5, torch.rand(g * nn) + 0.5
    got = torch._scaled_grouped_mm(n(a), n(b), n(sa), n(sb), n(offs))
    assert got.shape == (g, m, nn)
    start = 0
    for i, end in enumerate(offs.tolist()):
        want = (a[:, start:end].double() * sa[i * m:(i + 1) * m, None].double()) @ (
            b[start:end].double() * sb[i * nn:(i + 1) * nn][None, :].double())
        torch.testing.assert_close(got[i].cpu().double(), want, rtol=2 ** -8, atol=1e-3)
        start = end


def test_scaled_grouped_mm_errors_as_cuda():
    a = _fp8((64, 128), E4, 0)
    b = _fp8((2, 32, 128), E4, 1).transpose(-2, -1)
    sa, sb = torch.ones(64), torch.ones(2, 32)
    with pytest.raises(RuntimeError, match="Offsets tensor not provided, but is needed for 2D/3D"):
        torch._scaled_grouped_mm(n(a), n(b), n(sa), n(sb))
    offs = torch.tensor([32, 64], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Expected mat_b tensor to be column major"):
        torch._scaled_grouped_mm(n(a), n(b.contiguous()), n(sa), n(sb), n(offs))
    with pytest.raises(RuntimeError, match="Expected inputs of E4M3 FP8 type"):
        torch._scaled_grouped_mm(n(a.to(E5)), n(b), n(sa), n(sb), n(offs))
    with pytest.raises(RuntimeError, match="Expected scale_b non-batch dimension to be 32, got 16"):
        torch._scaled_grouped_mm(n(a), n(b), n(sa), n(torch.ones(2, 16)), n(offs))


def test_scaled_grouped_mm_v2_rowwise():
    g, m, k, nn = 4, 96, 128, 64
    a = _fp8((m, k), E4, 0)
    b = _fp8((g, nn, k), E4, 1).transpose(-2, -1)
    sa, sb = torch.rand(m) + 0.5, torch.rand(g, nn) + 0.5
    offs = torch.tensor([32, 32, 80, 96], dtype=torch.int32)
    got = F.scaled_grouped_mm(n(a), n(b), n(sa), S.RowWise, n(sb), S.RowWise, offs=n(offs))
    assert got.dtype == torch.bfloat16 and got.shape == (m, nn)
    torch.testing.assert_close(got.cpu().double(), _grouped_reference(a, b, sa, sb, offs),
                               rtol=2 ** -8, atol=1e-3)
    v1 = torch._scaled_grouped_mm(n(a), n(b), n(sa), n(sb), n(offs))
    assert torch.equal(got.cpu(), v1.cpu())
    with pytest.raises(ValueError, match="Only bf16 high precision output types are supported"):
        F.scaled_grouped_mm(n(a), n(b), n(sa), S.RowWise, n(sb), S.RowWise, offs=n(offs),
                            output_dtype=torch.float32)
    with pytest.raises(ValueError, match="Expected mat2 to be transposed"):
        F.scaled_grouped_mm(n(a), n(b.contiguous()), n(sa), S.RowWise, n(sb), S.RowWise, offs=n(offs))
    with pytest.raises(RuntimeError, match="scale must have the same first dimension as mat for arg 1"):
        F.scaled_grouped_mm(n(a), n(b), n(sa), S.RowWise, n(sb[:, :32]), S.RowWise, offs=n(offs))
    with pytest.raises(ValueError, match="No gemm implementation was found"):
        F.scaled_grouped_mm(n(a), n(b), n(sa), S.TensorWise, n(sb), S.TensorWise, offs=n(offs))


# --- MX grouped GEMMs: every group's E8M0 scales blocked on their own (fbgemm's layout) ---
def _mx_groups(x, bounds, fmt, dim):
    """Quantizes each group of ``x`` (slices along ``dim``) on its own, as CUDA's tests and
    torchao do: (data, flat blocked scales, float64 dequantized)."""
    datas, scales, deqs = [], [], []
    for s, e in bounds:
        part = x.narrow(dim, s, e - s).contiguous()
        if e > s:
            d, sc, deq = _mx_reference(part, fmt)
            datas.append(d), scales.append(to_blocked(sc).reshape(-1)), deqs.append(deq)
    data = torch.cat([d.view(torch.uint8) for d in datas], dim).view(datas[0].dtype)  # no fp4 cat on CPU
    return data, torch.cat(scales), torch.cat(deqs, dim)


def _bounds(ends):
    return list(zip([0] + ends[:-1], ends))


@pytest.mark.parametrize("fmt,entry", [("mxfp8", "v1"), ("mxfp8", "v2"), ("mxfp4", "v2")])  # v1: E4M3 only
def test_mx_grouped_2d_3d(fmt, entry):
    g, m, k, nn = 3, 192, 160, 48
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(g, nn, k, generator=gen) * 3
    if fmt == "mxfp4":
        x, w = x.bfloat16(), w.bfloat16()
    ends = [40, 40, 176]  # an empty group, rows past the last offset
    a, sa, a64 = _mx_groups(x[:176], _bounds(ends), fmt, 0)
    a = torch.cat((a.view(torch.uint8), a[:16].view(torch.uint8))).view(a.dtype)
    a64 = torch.cat((a64, a64[:16]))
    sa = torch.cat((sa, sa[:128 * _round4(k)]))  # the trailing rows' scales, which no group reads
    ws = [_mx_reference(w[i], fmt) for i in range(g)]
    b = torch.stack([d for d, _, _ in ws]).transpose(-2, -1)          # (G, K, N), column-major
    sb = torch.stack([to_blocked(sc).reshape(-1) for _, sc, _ in ws])  # (G, blocked K x N)
    offs = torch.tensor(ends, dtype=torch.int32)
    if entry == "v1":
        got = torch._scaled_grouped_mm(n(a), n(b), n(sa.reshape(-1, _round4(k))), n(sb), n(offs))
    else:
        got = F.scaled_grouped_mm(n(a), n(b), n(sa.reshape(-1, _round4(k))), S.BlockWise1x32, n(sb),
                                  S.BlockWise1x32, swizzle_a=W.SWIZZLE_32_4_4, swizzle_b=W.SWIZZLE_32_4_4,
                                  offs=n(offs))
    assert got.shape == (m, nn) and got.dtype == torch.bfloat16
    for i, (s, e) in enumerate(_bounds(ends)):
        if e > s:
            _check_one_rounding(got[s:e], a64[s:e], ws[i][2].t())


def _round4(k):
    return ((k // 32 + 3) // 4) * 4


@pytest.mark.parametrize("fmt,entry", [("mxfp8", "v1"), ("mxfp8", "v2"), ("mxfp4", "v2")])  # v1: E4M3 only
def test_mx_grouped_2d_2d_k_grouped(fmt, entry):
    m, k, nn = 64, 320, 144
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(m, k, generator=gen), torch.randn(nn, k, generator=gen) * 2
    if fmt == "mxfp4":
        x, w = x.bfloat16(), w.bfloat16()
    ends = [64, 64, 256, 320]
    a, sa, a64 = _mx_groups(x, _bounds(ends), fmt, 1)
    b, sb, b64 = _mx_groups(w, _bounds(ends), fmt, 1)
    offs = torch.tensor(ends, dtype=torch.int32)
    sa, sb = sa.reshape(128, -1), sb.reshape(256, -1)
    if entry == "v1":
        got = torch._scaled_grouped_mm(n(a), n(b).t(), n(sa), n(sb), n(offs))
    else:
        got = F.scaled_grouped_mm(n(a), n(b).t(), n(sa), S.BlockWise1x32, n(sb), S.BlockWise1x32,
                                  swizzle_a=W.SWIZZLE_32_4_4, swizzle_b=W.SWIZZLE_32_4_4, offs=n(offs))
    assert got.shape == (4, m, nn) and got.dtype == torch.bfloat16
    for i, (s, e) in enumerate(_bounds(ends)):
        if e > s:
            _check_one_rounding(got[i], a64[:, s:e], b64[:, s:e].t())
        else:
            assert torch.equal(got[i].cpu(), torch.zeros(m, nn, dtype=torch.bfloat16))


def test_mx_grouped_2d_3d_k_not_a_multiple_of_32_is_refused():
    # the (G, K, N) operand's scales (CUDA's shape) hold K // 32 blocks: none for a K tail
    a = torch.zeros(64, 144).to(E4)
    b = torch.zeros(2, 32, 144).to(E4).transpose(-2, -1)
    sa = torch.full((256, 8), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    sb = torch.full((2, 4 * 128), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="K = 144 must be a multiple of 32"):
        torch._scaled_grouped_mm(n(a), n(b), n(sa), n(sb), n(offs))
    assert torch.equal((torch.ones(2, device=DEV) + 1).cpu(), torch.full((2,), 2.0))


def test_mx_grouped_errors_as_cuda():
    x = torch.randn(64, 64)
    sa, qa = to_mxfp(x)
    bsa = to_blocked(sa).reshape(128, -1)
    b = torch.stack([qa, qa]).transpose(-2, -1)
    bsb = torch.stack([to_blocked(sa).reshape(-1)] * 2)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    kw = dict(swizzle_a=W.SWIZZLE_32_4_4, swizzle_b=W.SWIZZLE_32_4_4, offs=n(offs))
    with pytest.raises(ValueError, match="For CUDA MXFP8 grouped gemm, both scale swizzle types must be SWIZZLE_32_4_4"):
        F.scaled_grouped_mm(n(qa), n(b), n(bsa), S.BlockWise1x32, n(bsb), S.BlockWise1x32,
                            swizzle_a=W.NO_SWIZZLE, swizzle_b=W.SWIZZLE_32_4_4, offs=n(offs))
    with pytest.raises(RuntimeError, match=r"must have scale shape \(2,4,128\) for arg 1, got: 2, 256"):
        F.scaled_grouped_mm(n(qa), n(b), n(bsa), S.BlockWise1x32, n(bsb[:, :256]), S.BlockWise1x32, **kw)
    with pytest.raises(RuntimeError, match="scale must have same number of dimensions as parent tensor"):
        F.scaled_grouped_mm(n(qa), n(b), n(bsa.reshape(-1)), S.BlockWise1x32, n(bsb), S.BlockWise1x32, **kw)
    with pytest.raises(RuntimeError, match="scale_a has 512 elements, but the groups in offs need 1024"):
        torch._scaled_grouped_mm(n(qa), n(b), n(bsa), n(bsb), n(offs))
    with pytest.raises(ValueError, match="MXFP8 grouped GEMM currently only supports 2d-2d and 2d-3d cases"):
        F.scaled_grouped_mm(n(torch.stack([qa, qa])), n(b), n(bsb), S.BlockWise1x32, n(bsb), S.BlockWise1x32,
                            swizzle_a=W.SWIZZLE_32_4_4, swizzle_b=W.SWIZZLE_32_4_4)
    with pytest.raises(RuntimeError, match="Expected inputs of E4M3 FP8 type"):
        torch._scaled_grouped_mm(n(qa.to(E5)), n(b), n(bsa), n(bsb), n(offs))
    with pytest.raises(ValueError, match="No gemm implementation was found"):
        F.scaled_grouped_mm(n(qa.to(E5)), n(b.to(E5)), n(bsa), S.BlockWise1x32, n(bsb), S.BlockWise1x32, **kw)
    with pytest.raises(ValueError, match=r"Expected mat_b shape to be divisible by 16 but got mat_b shape: "
                                         r"\(\[2, 64, 40\]\)"):
        torch._scaled_grouped_mm(n(qa), n(b[:, :, :40]), n(bsa), n(bsb), n(offs))


# --- the cost model ---
def _modelled(fn):
    torch.neuron.synchronize()
    cost_model.reset_modelled_time()
    fn()
    torch.neuron.synchronize()
    return cost_model.modelled_time()


def test_fp8_scaled_mm_modelled_at_fp8_rate_on_trn2():
    p = neuronhw.TRN2
    assert p.core_tflops["float8"] * 8 == pytest.approx(1299, rel=0.03)
    assert p.core_tflops["bfloat16"] * 8 == pytest.approx(667, rel=0.06)
    m = k = nn = 2048
    a, b = n(_fp8((m, k), E4, 0)), n(_fp8((nn, k), E4, 1).t())
    abf, bbf = a.bfloat16(), b.bfloat16()
    one = n(torch.tensor(1.0))
    t8 = _modelled(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    t16 = _modelled(lambda: abf @ bbf)
    assert t8.launches == 1 and t8.flops == pytest.approx(2.0 * m * k * nn)
    fixed = (p.launch_overhead_ns + cost_model.kernel_latency_ns(p)) * 1e-9  # per launch, any dtype
    ratio = (t8.seconds - fixed) / (t16.seconds - fixed)
    assert ratio == pytest.approx(p.core_tflops["bfloat16"] / p.core_tflops["float8"], rel=0.05)


def test_scaled_matmul_rates_follow_the_profiles():
    dims, lnc, nbytes = (1, 4096, 4096, 4096), 2, 0
    flops = 2.0 * 4096 ** 3
    for p, kind, tflops_per_chip in ((neuronhw.TRN2, "float8", 1299), (neuronhw.TRN3, "float8", 2517),
                                     (neuronhw.TRN3, "mx", 2517)):
        seconds, f = cost_model.scaled_matmul_seconds(p, lnc, dims, kind, nbytes)
        assert f == flops
        seconds -= (p.launch_overhead_ns + cost_model.kernel_latency_ns(p)) * 1e-9
        # one logical core of lnc physical ones gets lnc / physical_cores of the chip
        peak = tflops_per_chip * 1e12 * lnc / p.physical_cores
        assert seconds == pytest.approx(flops / peak, rel=0.04)


def test_mx_on_trn2_warns_once_and_charges_bf16():
    cost_model._mx_warned.discard("trn2")
    dims = (1, 4096, 4096, 4096)
    with pytest.warns(UserWarning, match="no MX matmul path"):
        mx, _ = cost_model.scaled_matmul_seconds(neuronhw.TRN2, 2, dims, "mx", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = cost_model.scaled_matmul_seconds(neuronhw.TRN2, 2, dims, "mx", 0)
    fp8, _ = cost_model.scaled_matmul_seconds(neuronhw.TRN2, 2, dims, "float8", 0)
    assert mx == again
    assert mx / fp8 == pytest.approx(neuronhw.TRN2.core_tflops["float8"] / neuronhw.TRN2.core_tflops["bfloat16"],
                                     rel=0.02)
    tr3_mx, _ = cost_model.scaled_matmul_seconds(neuronhw.TRN3, 2, dims, "mx", 0)
    assert mx / tr3_mx == pytest.approx(2517 / 667, rel=0.06)


def test_mx_call_on_device_is_charged_once():
    x = torch.randn(128, 256)
    sa, qa = to_mxfp(x)
    bs, qa = n(to_blocked(sa)), n(qa)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trn2's one-time MX warning, tested above
        t = _modelled(lambda: torch._scaled_mm(qa, qa.t(), bs, bs, out_dtype=torch.bfloat16))
    assert t.launches == 1 and list(t.by_op) == ["_scaled_mm"]
    assert t.flops == pytest.approx(2.0 * 128 * 256 * 128)


def test_grouped_charged_as_one_fp8_kernel():
    a = n(_fp8((64, 128), E4, 0))
    b = n(_fp8((4, 32, 128), E4, 1).transpose(-2, -1))
    offs = n(torch.tensor([16, 32, 48, 64], dtype=torch.int32))
    sa, sb = n(torch.ones(64)), n(torch.ones(4, 32))
    t = _modelled(lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs))
    assert t.launches == 1 and list(t.by_op) == ["_scaled_grouped_mm"]
    assert t.flops == pytest.approx(2.0 * 64 * 128 * 32)


def test_mx_grouped_charged_as_one_mx_kernel():
    x = torch.randn(64, 128)
    sa, qa = to_mxfp(x)
    b = n(torch.stack([qa[:32]] * 4).transpose(-2, -1))
    bsb = n(torch.stack([to_blocked(sa[:32]).reshape(-1)] * 4))
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    bsa = torch.cat([to_blocked(sa[s:s + 16]).reshape(-1) for s in range(0, 64, 16)])
    qa, bsa, offs = n(qa), n(bsa.reshape(-1, 4)), n(offs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trn2's one-time MX warning, tested above
        t = _modelled(lambda: torch._scaled_grouped_mm(qa, b, bsa, bsb, offs))
    assert t.launches == 1 and list(t.by_op) == ["_scaled_grouped_mm"]
    assert t.flops == pytest.approx(2.0 * 64 * 128 * 32)


# --- CPU's bits on operands that tell summation orders apart ---
# Where CPU's tensorwise FP8 x FP8 product runs oneDNN's reference kernel (hosts with
# AMX-int8), neuron computes it with its own kernel in the same order; elsewhere it runs
# CPU's. Large operands and scales that are not powers of two make the orders disagree.
def _wide(m, k, nn, da, db, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 120).clamp(-448, 448).to(da)
    b = (torch.randn(nn, k, generator=g) * 120).clamp(-448, 448).to(db).t()
    return a, b


@pytest.mark.parametrize("mkldnn", [True, False])
@pytest.mark.parametrize("dtypes", [(E4, E4), (E5, E5), (E4, E5)])
def test_tensorwise_matches_cpu_where_summation_orders_differ(dtypes, mkldnn):
    a, b = _wide(70, 600, 130, *dtypes, seed=3)
    cases = [(0.0123, 0.037, None, torch.float32), (1.0, 0.037, None, torch.bfloat16),
             (0.0123, 1.0, torch.randn(130).half(), torch.float16),
             (0.0123, 0.037, torch.randn(130).bfloat16(), torch.bfloat16)]
    with torch.backends.mkldnn.flags(enabled=mkldnn):
        for sa, sb, bias, out_dtype in cases:
            sa, sb = torch.tensor(sa), torch.tensor(sb)
            want = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
            got = torch._scaled_mm(n(a), n(b), n(sa), n(sb), bias=n(bias), out_dtype=out_dtype)
            assert torch.equal(got.cpu(), want), (sa, sb, out_dtype)
    # The operands do discriminate: the two orders CPU may run give different fp32 sums.
    sa, sb = torch.tensor(0.0123), torch.tensor(0.037)
    dequantized = (a.float() * sa) @ (b.float() * sb)
    from torch_neuronx import _C
    assert not torch.equal(dequantized, _C._scaled_mm_sequential(a.float(), b.float(), 0.0123, 0.037))


def test_tensorwise_reference_order_kernel_handles_ragged_tiles_and_specials():
    from torch_neuronx import _C
    a, b = _wide(67, 301, 259, E4, E4, seed=4)
    a[0, 0] = float("nan")
    want = torch.zeros(67, 259)
    for k in range(301):  # the reference order, written out
        want = want + ((a[:, k].float()[:, None] * b[k, :].float()[None, :]) * 0.0123) * 0.037
    got = _C._scaled_mm_sequential(a.float(), b.float(), 0.0123, 0.037)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan()[0].all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("kernel", ["amx", "bf16 gemm", "fp32"])
def test_blockwise_and_mx_on_each_host_kernel(kernel, monkeypatch):
    # AMX hosts accumulate blockwise products in AMX tiles, rescaling per K block; hosts with
    # BF16 instructions multiply the FP8 values (exact in bf16) with MKL's bf16 x bf16 -> fp32
    # GEMM; others in fp32. Each must meet the one-rounding bound, on ragged shapes too.
    from torch_neuronx.kernels import scaled_mm as impl
    if kernel == "amx" and not impl._AMX:
        pytest.skip("this host has no AMX tiles")
    if kernel == "bf16 gemm" and not impl._BF16_GEMM:
        pytest.skip("this host has no BF16 GEMM")
    if kernel != "amx":
        monkeypatch.setattr(impl, "_AMX", 0)
    if kernel == "fp32":
        monkeypatch.setattr(impl, "_BF16_GEMM", 0)
    a, b = _operands(M, K, N)
    sa, sb, ra, rb = _v1_scales("1x128", "128x128", seed=5)
    got = torch._scaled_mm(n(a), n(b), n(sa), n(sb), out_dtype=torch.float32)
    _check_one_rounding(got, a.double() * ra, b.double() * rb)
    for m, k, nn in ((33, 256, 17), (1, 384, 1), (70, 176, 50)):   # blocks, tiles, K not filled
        a, b = _operands(m, k, nn, seed=m)
        kb = (k + 127) // 128
        g = torch.Generator().manual_seed(k)
        sa = torch.rand(kb, m, generator=g).t() + 0.5
        sb = torch.rand(kb, nn, generator=g) + 0.5
        got = torch._scaled_mm(n(a), n(b), n(sa), n(sb), out_dtype=torch.float32)
        a64 = a.double() * sa.double().repeat_interleave(128, 1)[:, :k]
        b64 = b.double() * sb.double().repeat_interleave(128, 0)[:k]
        _check_one_rounding(got, a64, b64)
    x, w = torch.randn(96, 256) * 3, torch.randn(80, 256) * 3
    xa, xs, x64 = _mx_reference(x, "mxfp8")
    wa, ws, w64 = _mx_reference(w, "mxfp8")
    got = torch._scaled_mm(n(xa), n(wa).t(), n(to_blocked(xs)), n(to_blocked(ws)), out_dtype=torch.float32)
    _check_one_rounding(got, x64, w64.t())
    # The kernel rounds into bf16/fp16 itself: exactly as the fp32 result rounds (fp16 with
    # values beyond its range too)
    a, b = _operands(M, K, N)
    sa, sb, _, _ = _v1_scales("1x128", "128x128", seed=6)
    for dtype in (torch.bfloat16, torch.float16):
        for args in ((n(a), n(b), n(sa * 300), n(sb)),
                     (n(xa), n(wa).t(), n(to_blocked(xs)), n(to_blocked(ws)))):
            wide = torch._scaled_mm(*args, out_dtype=torch.float32)
            assert torch.equal(torch._scaled_mm(*args, out_dtype=dtype).cpu(), wide.cpu().to(dtype))


@pytest.mark.parametrize("code", [1, 4, 30, 100, 254])
def test_mx_scales_at_the_ends_of_e8m0(code):
    # Tiny scales put dequantized values among bf16's subnormals, or their products among
    # fp32's, which BF16 GEMMs flush to zero (the kernel then multiplies in fp32); huge ones
    # overflow fp32, where dequantized values live, so that row's results are not finite.
    # Other rows are unaffected.
    g = torch.Generator().manual_seed(code)
    x, w = torch.randn(64, 64, generator=g), torch.randn(48, 64, generator=g)
    xa, xs, _ = _mx_reference(x, "mxfp8")
    wa, ws, w64 = _mx_reference(w, "mxfp8")
    xs = xs.view(torch.uint8).clone()
    xs[5] = code                      # one row's scales
    xs = xs.view(torch.float8_e8m0fnu)
    x64 = xa.double() * xs.double().repeat_interleave(32, 1)
    got = torch._scaled_mm(n(xa), n(wa).t(), n(to_blocked(xs)), n(to_blocked(ws)),
                           out_dtype=torch.float32).cpu().double()
    exact, worst = x64 @ w64.t(), x64.abs() @ w64.t().abs()
    rows = torch.arange(64) != 5
    if code == 254:
        assert not got[5].isfinite().any()
    else:
        rows[5] = True
        assert (exact[5] != 0).all()
    bound = 2.0 ** -23 * exact.abs() + 2.0 ** -20 * worst + 2.0 ** -149 * 64
    assert ((got - exact).abs()[rows] <= bound[rows]).all()


def test_mx_products_among_fp32_subnormals_are_kept():
    # Normal dequantized values whose products are fp32 subnormals (2^-126 * 0.25): a BF16
    # GEMM would flush each to zero; the exact fp32 sum of 64 of them is 2^-122.
    e8 = torch.float8_e8m0fnu
    a = torch.ones(32, 64).to(torch.float8_e4m3fn)
    b = torch.full((16, 64), 0.25).to(torch.float8_e4m3fn)
    sa = torch.full((32, 2), 127, dtype=torch.uint8)
    sa[5] = 1                                                     # 2^-126
    sb = torch.full((16, 2), 127, dtype=torch.uint8)
    got = torch._scaled_mm(n(a), n(b).t(), n(to_blocked(sa.view(e8))), n(to_blocked(sb.view(e8))),
                           out_dtype=torch.float32).cpu()
    assert torch.equal(got[5], torch.full((16,), 2.0 ** -122))
    assert torch.equal(got[0], torch.full((16,), 16.0))


def test_formats_cpu_refuses_raise_cpus_error_with_the_callers_shapes():
    # fnuz operands: CPU's oneDNN refuses them on some hosts (Intel) and computes them on
    # others (AMD); the device does what CPU does on this host, error or result.
    a = torch.randn(6, 64).to(torch.float8_e4m3fnuz)
    b = torch.randn(10, 64).to(torch.float8_e4m3fnuz).t()
    one = torch.tensor(1.0)
    try:
        want = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
    except RuntimeError as cpu:
        with pytest.raises(RuntimeError) as dev:
            torch._scaled_mm(n(a), n(b), n(one), n(one), out_dtype=torch.float32)
        assert str(dev.value) == str(cpu)
    else:
        got = torch._scaled_mm(n(a), n(b), n(one), n(one), out_dtype=torch.float32)
        assert torch.equal(got.cpu(), want)
    x = torch.ones(2, 2, device=DEV)
    assert torch.equal((x + 1).cpu(), torch.full((2, 2), 2.0))  # the device is still usable


@pytest.mark.parametrize("dtype", [E4, E5])
def test_mx_operand_decoding_of_every_code(dtype):
    # MX with unit scales times the identity returns each operand value: every finite code of
    # the format (subnormals included) decodes as CPU converts it.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).float()
    finite = codes[values.isfinite()]
    k = 32 * (finite.numel() // 32)
    a = finite[:k].repeat(4, 1).view(dtype)                       # (4, K)
    eye = torch.eye(k).to(dtype)                                  # (K, K): B, column-major below
    ones = torch.full((4, k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    ones_b = torch.full((k, k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = torch._scaled_mm(n(a), n(eye).t(), n(to_blocked(ones)), n(to_blocked(ones_b)),
                           out_dtype=torch.float32)
    assert torch.equal(got.cpu(), a.float())
    # a NaN (and for E5M2 an infinity) in a row makes the row NaN, as the product does
    special = codes[~values.isfinite()][:1].view(dtype)
    a2 = a.clone()
    a2[1, 0] = special[0]
    got = torch._scaled_mm(n(a2), n(eye).t(), n(to_blocked(ones)), n(to_blocked(ones_b)),
                           out_dtype=torch.float32).cpu()
    assert got[1].isnan().any() and not got[0].isnan().any()
