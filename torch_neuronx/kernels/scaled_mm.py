"""``torch._scaled_mm`` and its kin on neuron: FP8 and MX matmuls with their scales.

CPU's ``_scaled_mm`` takes tensorwise and rowwise scales only; CUDA's also takes DeepSeek-style
blockwise scales (1x128 activations, 128x128 weights) and MX (MXFP8/MXFP4 with E8M0 scales
per 32 elements, in cuBLAS's swizzled layout), and ``_scaled_grouped_mm`` is CUDA's alone.
Trainium has FP8 matmuls (and Trainium3 MX ones), so neuron takes CUDA's FP8 and MX forms
(NVFP4, NVIDIA's own, is refused naming MXFP4):

* tensorwise and rowwise give CPU's bits: CPU's kernel on the device tensors' host memory,
  or, where CPU's is oneDNN's reference kernel, ``_C._scaled_mm_sequential`` in its order;
* blockwise and MX run ``csrc/aten/scaled_mm.cpp``'s kernel on the device queue: fp32
  accumulation (MX: exactly dequantized operands, in bf16 where the host has a BF16 GEMM;
  blockwise: per 128-wide block of K, then scaled), the bias added in fp32, one rounding to
  ``out_dtype``;
* scale shapes, strides and swizzles are checked as CUDA checks them, with CUDA's messages.

Each call is charged as one TensorE kernel at the chip's FP8 or MX rate
(``cost_model.scaled_matmul_seconds``).
"""
from __future__ import annotations


import torch

from .. import _C, _state, cost_model
from . import stochastic_rounding
from ._meta import to_meta

_lib = torch.library.Library("aten", "IMPL")

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_FP4 = torch.float4_e2m1fn_x2
_E8M0 = torch.float8_e8m0fnu
# ScalingType / SwizzleType values (torch.nn.functional.ScalingType, SwizzleType).
_TW, _RW, _B1x16, _B1x32, _B1x128, _B128x128 = range(6)
_NO_SWIZZLE, _SWIZZLE_32_4_4 = 0, 1
# float4_e2m1fn_x2 codes 0..15 (sign bit 3); two per byte, the even element in the low nibble.
_FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# Both elements of every byte, so unpacking is one gather.
_FP4_PAIRS = torch.stack((_FP4_VALUES.repeat(16), _FP4_VALUES.repeat_interleave(16)), 1)


def _cdiv(a, b):
    return -(-a // b)


def _round_up(a, b):
    return _cdiv(a, b) * b


def _is_fp8(t):
    return t.dtype in _FP8


# --- CUDA's scale recognisers (ScaledBlas.cpp), for _scaled_mm, which infers the recipe ---
def _size_stride(s, dim, size, stride):
    return s.size(dim) == size and (size <= 1 or s.stride(dim) == stride)


def _tensorwise(t, s):
    return _is_fp8(t) and s.dtype == torch.float32 and s.numel() == 1


def _rowwise(t, s):
    return (_is_fp8(t) and s.dtype == torch.float32 and s.dim() == 2 and s.size(0) == t.size(0)
            and s.size(1) == 1 and s.is_contiguous())


def _block1x128(t, s):
    return (_is_fp8(t) and s.dtype == torch.float32 and s.dim() == 2
            and _size_stride(s, 0, t.size(0), 1) and _size_stride(s, 1, _cdiv(t.size(1), 128), t.size(0)))


def _block128x128(t, s):
    return (_is_fp8(t) and s.dtype == torch.float32 and s.dim() == 2
            and _size_stride(s, 0, _cdiv(t.size(0), 128), _cdiv(t.size(1), 128))
            and _size_stride(s, 1, _cdiv(t.size(1), 128), 1))


def _mx_elems(rows, k):
    return _round_up(rows, 128) * _round_up(_cdiv(k, 32), 4)


def _block1x32(t, s):
    k = t.size(1) * (2 if t.dtype == _FP4 else 1)
    return ((_is_fp8(t) or t.dtype == _FP4) and s.dtype == _E8M0
            and s.numel() == _mx_elems(t.size(0), k) and s.is_contiguous())


def _block1x16(t, s):
    return (t.dtype == _FP4 and s.dtype == torch.float8_e4m3fn and s.is_contiguous()
            and s.numel() == _round_up(t.size(0), 128) * _round_up(_cdiv(t.size(1) * 2, 16), 4))


_RECOGNISE = {_TW: _tensorwise, _RW: _rowwise, _B1x128: _block1x128, _B128x128: _block128x128,
              _B1x32: _block1x32, _B1x16: _block1x16}
_JOINT = ((_TW, _TW), (_RW, _RW), (_B128x128, _B1x128), (_B1x128, _B128x128), (_B1x128, _B1x128),
          (_B1x32, _B1x32), (_B1x16, _B1x16))


def _fmt(dtype):
    return str(dtype).replace("torch.", "")


def _invalid_config(a, b, sa, sb, names=("a", "scale_a", "b", "scale_b")):
    m, k, n = a.size(0), a.size(1), b.size(1)
    na, nsa, nb, nsb = names
    return (
        "Invalid scaling configuration.\n"
        "- For TensorWise scaling, a and b should be float8, scales should be float and singletons.\n"
        f"- For RowWise scaling, a and b should be float8, scales should be float, scale_a should be ({m}, 1) "
        f"and scale_b should be (1, {n}), and both should be contiguous.\n"
        f"- For BlockWise 1x128 scaling, a and b should be float8, scales should be float, scale_a should be "
        f"({m}, {_cdiv(k, 128)}) and scale_b should be ({_cdiv(b.size(0), 128)}, {n}), and both should be "
        "outer-dim-major.\n"
        f"- For BlockWise 128x128 scaling, a and b should be float8, scales should be float, scale_a should be "
        f"({_cdiv(m, 128)}, {_cdiv(k, 128)}) and scale_b should be ({_cdiv(b.size(0), 128)}, {_cdiv(n, 128)}), "
        "and both should be near-inner-dim-major (with 16-byte aligned strides).\n"
        f"- For Blockwise 1x32 scaling, a and b should be float8, scales should be float8_e8m0fnu, scale_a "
        f"should have {_mx_elems(m, k)} elements and scale_b should have {_mx_elems(n, b.size(0))} elements, "
        "and both should be contiguous.\n"
        f"- For Blockwise 1x16 scaling, a and b should be float4 (packed 2x), scales should be float8_e4m3fn, "
        f"scale_a should have {_round_up(m, 128) * _round_up(_cdiv(k * 2, 16), 4)} elements and scale_b should "
        f"have {_round_up(n, 128) * _round_up(_cdiv(b.size(0) * 2, 16), 4)} elements, and both should be "
        "contiguous.\n"
        f"Got {na}.dtype()={_fmt(a.dtype)}, {nsa}.dtype()={_fmt(sa.dtype)}, {nsa}.size()={list(sa.shape)}, "
        f"{nsa}.stride()={list(sa.stride())}, {nb}.dtype()={_fmt(b.dtype)}, {nsb}.dtype()={_fmt(sb.dtype)}, "
        f"{nsb}.size()={list(sb.shape)} and {nsb}.stride()={list(sb.stride())}")


def _joint_scaling(a, b, sa, sb):
    for ra, rb in _JOINT:
        swizzled = rb in (_B1x16, _B1x32)
        if _RECOGNISE[ra](a, sa) and _RECOGNISE[rb](b.t(), sb if swizzled else sb.t()):
            return ra, rb
    raise RuntimeError(_invalid_config(a, b, sa, sb))


# --- the blockwise and MX product: csrc/aten/scaled_mm.cpp's kernel, on the device queue ---
# FP8 and FP4 values, and MX's dequantized ones (times a power of two), are exact in bf16, so
# a BF16 product that accumulates in fp32 computes them as an fp32 one does, at the host's
# BF16 rate: on AMX tiles, or by MKL's cblas_gemm_bf16bf16f32 (libtorch_cpu carries it; CPU's
# own matmuls give no fp32 result from bf16 operands).
def _bf16_gemm_address():
    if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return 0  # without BF16 instructions MKL converts to fp32 itself: no gain
    import ctypes
    import os
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return ctypes.cast(lib.cblas_gemm_bf16bf16f32, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):  # a torch built without MKL
        return 0


_BF16_GEMM = _bf16_gemm_address()
# Blockwise and MX products on AMX tiles (scaled_mm.cpp), where the host has them
_AMX = int(torch.cpu._is_amx_tile_supported())
_BLOCKED_MM = _C._scaled_blocked_mm_entry()
_CODE_TABLES = {}


def _code_table(dtype):
    """The fp32 value of every byte of ``dtype`` (FP4: both nibbles, low first); kept for the
    process, as the kernel reads it by address."""
    table = _CODE_TABLES.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = _FP4_PAIRS if dtype == _FP4 else codes.view(dtype).float()
        table = _CODE_TABLES[dtype] = table.float().contiguous()
    return table


def _codes(t):
    """Rows along K of an FP8/FP4 operand, as contiguous bytes, its table and how the kernel
    reads a byte (scaled_mm.cpp's Format: 1 a value, 2 a pair, FP4)."""
    return t.contiguous().view(torch.uint8), _code_table(t.dtype), 2 if t.dtype == _FP4 else 1


_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # scaled_mm.cpp's OutKind


def _launch_blocked_mm(dev, a, bt, k, sa=None, sb=None, rows=None, cols=None, rows_per=1, cols_per=1,
                       out_dtype=torch.float32, out=None):
    """(M, K) ``a`` times ``bt``, B's rows along K, -> a new (M, N) ``out_dtype`` device tensor
    (fp32, or the fp32 product rounded once to nearest even into bf16 or fp16), or into
    ``out``, contiguous, of one of those dtypes.
    MX: ``sa`` and ``sb`` E8M0 scales per 32 of K, swizzled as cuBLAS takes them; blockwise:
    fp32 ``rows`` (ceil(M / rows_per), K/128) and ``cols`` (K/128, ceil(N / cols_per)), any
    strides. The kernel reads the scales in place."""
    m, n = a.size(0), bt.size(0)
    if out is None:
        out = torch.empty(m, n, device=dev, dtype=out_dtype)
    args, kinds = [], ""
    for x, s in ((a, sa), (bt, sb)):
        codes, table, fmt = _codes(x)
        args.extend((codes, table.data_ptr(), fmt))
        kinds += "rii"
        if s is None:
            args.append(0)
            kinds += "i"
        else:
            args.append(s.view(torch.uint8))
            kinds += "r"
    args.extend((_code_table(_E8M0).data_ptr(), m, n, k, _BF16_GEMM, _AMX))
    kinds += "iiiiii"
    for s, per in ((rows, rows_per), (cols, cols_per)):
        if s is None:
            args.extend((0, 0, 0, 1))
            kinds += "iiii"
        else:  # read in place, strided
            args.extend((s, s.stride(0), s.stride(1), per))
            kinds += "riii"
    args.extend((out, _OUT_KINDS[out.dtype]))
    kinds += "wi"
    # A matmul's work far outweighs its operands' bytes: weighed as the bytes a memory-bound
    # op of about its duration moves, so the host sleeps rather than spin on a core it needs.
    args.append(m * n * k // 16)
    kinds += "h"
    _C._launch_kernel(_BLOCKED_MM, "scaled_mm_blocked", kinds, *args)
    return out


# --- checks shared by the entries ---
def _index(dev):
    return dev.index if dev.index is not None else torch.neuron.current_device()


def _same_device(op, dev, **tensors):
    for name, t in tensors.items():
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            if x is not None and x.device != dev:
                raise RuntimeError(f"aten::{op}: expected all tensors to be on {dev}, but {name} is on "
                                   f"{x.device}")


def _check_bias(bias, out_dtype, n, exc=RuntimeError):
    if bias is None:
        return
    if bias.numel() != n:
        raise exc(f"Bias must be size {n} but got {bias.numel()}")
    if out_dtype == torch.float32:
        raise exc("Bias is not supported when out_dtype is set to Float32")
    if bias.dtype not in (torch.bfloat16, torch.float16):
        raise exc(f"Bias must be BFloat16 or Half, but got {_scalar_name(bias.dtype)}")
    if out_dtype == torch.bfloat16 and bias.dtype != torch.bfloat16:
        raise exc(f"Bias must be BFloat16 to compute BFloat16 output, but got {_scalar_name(bias.dtype)}")
    if out_dtype == torch.float16 and bias.dtype != torch.float16:
        raise exc(f"Bias must be Float16 to compute Half output, but got {_scalar_name(bias.dtype)}")


def _scalar_name(dtype):
    return {torch.bfloat16: "BFloat16", torch.float16: "Half", torch.float32: "Float"}.get(dtype, _fmt(dtype))


def _check_out_dtype(op, out_dtype, ra):
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        kind = "MX" if ra == _B1x32 else "blockwise"
        raise ValueError(f"aten::{op}: {kind} scaling on neuron produces bfloat16, float16 or float32, got "
                         f"out_dtype={out_dtype}")


def _nvfp4(op):
    return NotImplementedError(
        f"aten::{op}: NVFP4 (float4_e2m1fn_x2 with float8_e4m3fn scales per 16 elements) is NVIDIA's "
        "format and Trainium has no matmul for it; use MXFP4 (float8_e8m0fnu scales per 32 elements, "
        "BlockWise1x32), which Trainium3 runs natively")


def _price(dims, tensors, kind):
    """(seconds, flops, HBM bytes) of one TensorE kernel of (batch, M, K, N) ``dims`` at the
    ``kind`` rate, moving ``tensors`` (operands, scales, bias, result) through HBM once."""
    cfg = _state.config()
    nbytes = sum(cost_model.priced_nbytes(t) for t in tensors if t is not None)
    seconds, flops = cost_model.scaled_matmul_seconds(cfg.profile, cfg.lnc, dims, kind, nbytes)
    return seconds, flops, nbytes


def _charge(dev, op, dims, tensors, kind):
    seconds, flops, nbytes = _price(dims, tensors, kind)
    cost_model._add_time(dev, op, seconds, engine="tensor", flops=flops, hbm_bytes=nbytes)


def _mm_dims(a, out):
    return (1, a.size(0), a.size(1) * (2 if a.dtype == _FP4 else 1), out.size(1))


def _adopt(out, dev):
    return _C._adopt_tensor(out, _index(dev))


def _finish(out, out_dtype, dev):
    """The host fp32 result ``out`` rounded once to ``out_dtype`` on ``dev``: to nearest even,
    or, with NEURON_RT_STOCHASTIC_ROUNDING_EN on, stochastically from the device's generator,
    as the hardware rounds the PSUM result when it writes it out."""
    if stochastic_rounding._applies(out_dtype):
        return stochastic_rounding._round(_adopt(out, dev), out_dtype)
    return _adopt(out.to(out_dtype), dev)


def _out_meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _sizes(t):
    return str(list(t.shape))


def _host(*ts):
    return [_C._cpu_alias(t) if t is not None else None for t in ts]


# --- torch._scaled_mm ---
def _scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
               use_fast_accum=False):
    op = "_scaled_mm"
    dev = self.device
    _same_device(op, dev, mat2=mat2, scale_a=scale_a, scale_b=scale_b, bias=bias, scale_result=scale_result)
    if self.dim() != 2:
        raise RuntimeError("mat1 must be a matrix")
    if mat2.dim() != 2:
        raise RuntimeError("mat2 must be a matrix")
    if self.size(1) != mat2.size(0):
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({self.size(0)}x{self.size(1)} and "
                           f"{mat2.size(0)}x{mat2.size(1)})")
    ra, rb = _joint_scaling(self, mat2, scale_a, scale_b)
    if ra in (_TW, _RW):
        host = _host(self, mat2, scale_a, scale_b, bias, scale_result)
        if stochastic_rounding._applies(out_dtype):
            # CPU's kernel rounds inside; the fp32 product plus the bias in fp32 rounds here.
            _check_bias(bias, out_dtype, mat2.size(1))
            wide = _cpu_scaled_mm(*host[:4], None, host[5], torch.float32, use_fast_accum)
            if bias is not None:
                wide += host[4].float()
            _charge(dev, op, _mm_dims(self, wide), (self, mat2, scale_a, scale_b, bias,
                                                     _out_meta(wide.shape, out_dtype)), "float8")
            return _finish(wide, out_dtype, dev)
        out = _cpu_scaled_mm(*host, out_dtype, use_fast_accum)
        _charge(dev, op, _mm_dims(self, out), (self, mat2, scale_a, scale_b, bias, out), "float8")
        return _adopt(out, dev)
    if ra == _B1x16:
        raise _nvfp4(op)
    out_dtype = out_dtype if out_dtype is not None else self.dtype
    if use_fast_accum and _FP4 in (self.dtype, mat2.dtype):
        raise RuntimeError("`use_fast_accum` is not supported when `mat1` or `mat2` tensors have the "
                           "`Float4_e2m1fn_x2` dtype.")
    _check_bias(bias, out_dtype, mat2.size(1))
    _check_out_dtype(op, out_dtype, ra)
    return _blocked(op, dev, self, mat2, scale_a, scale_b, ra, rb, bias, out_dtype, v2=False)


# --- CPU's tensorwise FP8 x FP8 product where oneDNN's reference kernel computes it ---
# On a host with AMX-int8, CPU's _scaled_mm hands a same-format product with per-tensor scales
# to oneDNN, which runs its reference matmul (0.1 GFLOPS). _C._scaled_mm_sequential makes the
# same roundings in the same order about a thousand times faster. Whether CPU runs that kernel
# is decided by what it computes: a probe per format pair, whose operands tell the reference
# order apart from the dequantize-then-matmul one that other hosts run.
_REFERENCE_ORDER = {}


def _cpu_runs_reference_order(dtype_a, dtype_b):
    verdict = _REFERENCE_ORDER.get((dtype_a, dtype_b))
    if verdict is None:
        g = torch.Generator().manual_seed(0)
        a = (torch.randn(4, 512, generator=g) * 100).clamp(-448, 448).to(dtype_a)
        b = (torch.randn(512, 4, generator=g) * 100).clamp(-448, 448).to(dtype_b)
        sa, sb = torch.tensor(0.0123), torch.tensor(0.037)
        try:
            cpu = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
        except RuntimeError:  # CPU refuses the formats: the caller's own call raises CPU's error
            cpu = None
        ours = _C._scaled_mm_sequential(a.float(), b.float(), 0.0123, 0.037)
        other = (a.float() * sa) @ (b.float() * sb)
        verdict = _REFERENCE_ORDER[(dtype_a, dtype_b)] = (cpu is not None and torch.equal(cpu, ours)
                                                           and not torch.equal(other, ours))
    return verdict


def _cpu_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum):
    """CPU's ``torch._scaled_mm`` on host tensors, bit for bit."""
    out_dtype = out_dtype if out_dtype is not None else a.dtype
    if (scale_a.numel() == 1 and scale_b.numel() == 1 and a.dtype == b.dtype and a.numel() and b.numel()
            and out_dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (bias is None or (out_dtype != torch.float32 and bias.dtype == out_dtype
                                  and bias.shape == (b.size(1),)))
            and torch._C._get_mkldnn_enabled() and _cpu_runs_reference_order(a.dtype, b.dtype)):
        out = _C._scaled_mm_sequential(a.float(), b.float(), scale_a.item(), scale_b.item())
        if bias is not None:
            out += bias.float()
        return out.to(out_dtype)
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result,
                            out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def _blocked(op, dev, a, b, scale_a, scale_b, ra, rb, bias, out_dtype, v2):
    """The blockwise and MX forms, scales as the entry (``v2`` or not) lays them out; queued
    on the device like any op."""
    from .nkilib_routes import charged_as
    # The device ops preparing the call (scale layouts, the output's cast) run unrecorded:
    # the call is charged as the one kernel it is on the chip.
    out_meta = _out_meta((a.size(0), b.size(1)), out_dtype)
    seconds, flops, nbytes = _price(_mm_dims(a, out_meta), (a, b, scale_a, scale_b, bias, out_meta),
                                    "mx" if ra == _B1x32 else "float8")
    with charged_as(dev, op, seconds, engine="tensor", flops=flops, hbm_bytes=nbytes):
        return _blocked_unrecorded(dev, a, b, scale_a, scale_b, ra, rb, bias, out_dtype, v2)


def _blocked_unrecorded(dev, a, b, scale_a, scale_b, ra, rb, bias, out_dtype, v2):
    m, n = a.size(0), b.size(1)
    k = a.size(1) * (2 if a.dtype == _FP4 else 1)
    kb = _cdiv(k, 128)
    sa, sb = scale_a, scale_b
    sr = stochastic_rounding._applies(out_dtype)
    # Without a bias or stochastic rounding the kernel rounds its fp32 result into out_dtype
    wide = torch.float32 if bias is not None or sr else out_dtype
    if m == 0 or n == 0 or k == 0:
        out = torch.zeros(m, n, device=dev)
    elif ra == _B1x32:
        out = _launch_blocked_mm(dev, a, b.t(), k, sa=sa, sb=sb, out_dtype=wide)
    else:
        if v2 and ra == _B128x128:   # (round_up(K/128, 4), M/128), K-block major
            sa = sa[:kb].t()
        if v2 and rb == _B1x128:     # (N, K/128), one row of scales per column of B
            sb = sb.t()
        if v2 and rb == _B128x128:   # (round_up(K/128, 4), N/128)
            sb = sb[:kb]
        # sa: (M or M/128, K/128), sb: (K/128, N or N/128)
        out = _launch_blocked_mm(dev, a, b.t(), k, rows=sa, cols=sb,
                                 rows_per=128 if ra == _B128x128 else 1,
                                 cols_per=128 if rb == _B128x128 else 1, out_dtype=wide)
    if bias is not None:
        out += bias.float()
    if sr:
        return stochastic_rounding._round(out, out_dtype)
    return out.to(out_dtype)


def _into(out, value):
    if out.dtype != value.dtype:
        raise RuntimeError("out_dtype must match output matrix type")
    if out.shape != value.shape:
        out.resize_(value.shape)
    return out.copy_(value)


def _scaled_mm_out(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                   use_fast_accum=False, *, out):
    if out_dtype is not None and out_dtype != out.dtype:
        raise RuntimeError("out_dtype must match output matrix type")
    r = _scaled_mm(self, mat2, scale_a, scale_b, bias, scale_result, out.dtype, use_fast_accum)
    return _into(out, r)


# --- torch._scaled_mm_v2 (torch.nn.functional.scaled_mm): recipes given explicitly ---
def _v2_recipe(a, b, sa, ra, sb, rb):
    """The implementation CUDA's dispatch table picks, or None."""
    if len(ra) == 1 and len(rb) == 1:
        pair, s0, s1 = (ra[0], rb[0]), sa[0], sb[0]
        fp32 = s0.dtype == torch.float32 and s1.dtype == torch.float32
        if pair in ((_TW, _TW), (_RW, _RW), (_B1x128, _B128x128), (_B128x128, _B1x128), (_B1x128, _B1x128)):
            return pair if fp32 and _is_fp8(a) and _is_fp8(b) else None
        if pair == (_B1x32, _B1x32) and s0.dtype == _E8M0 and s1.dtype == _E8M0:
            ok = (_is_fp8(a) and _is_fp8(b)) or (a.dtype == _FP4 and b.dtype == _FP4)
            return pair if ok else None
        if pair == (_B1x16, _B1x16) and a.dtype == _FP4:
            return pair
    if len(ra) == 2 and len(rb) == 2 and (ra[0], rb[0]) == (_B1x16, _B1x16) and a.dtype == _FP4:
        return _B1x16, _B1x16
    return None


def _check_v2_blockwise(a, b, sa, sb, ra, rb):
    m, k, n = a.size(0), a.size(1), b.size(1)
    kb, l4 = _cdiv(k, 128), _round_up(_cdiv(k, 128), 4)

    def rows_of(s, rows, stride_name, name):
        if not (s.size(0) == rows and s.size(1) == kb):
            raise ValueError(f"{name} must have shape {rows} x {kb} Float elements, got {list(s.shape)}")
        if not (s.stride(0) == 1 and (s.stride(1) == rows or (s.size(1) == 1 and s.stride(1) == 1))):
            raise ValueError(f"{name} {stride_name}(1, {rows}); got {list(s.stride())}")

    def tiles_of(s, rows, name):
        if not (s.size(0) == l4 and s.size(1) == _cdiv(rows, 128)):
            raise ValueError(f"{name} must have shape {l4} x {_cdiv(rows, 128)} Float elements, got "
                             f"{list(s.shape)}")
        if not (s.stride(0) == 1 and (s.stride(1) == l4 or (s.size(1) == 1 and s.stride(1) == 1))):
            raise ValueError(f"{name} must have strides (1, {l4}); got {list(s.stride())}")

    if ra == _B1x128:
        rows_of(sa, m, "strides must be " if rb == _B1x128 else "must have strides ", "scale_a")
    else:
        tiles_of(sa, m, "scale_a")
    if rb == _B1x128:
        rows_of(sb, n, "strides must be " if ra == _B1x128 else "must have strides ", "scale_b")
    else:
        tiles_of(sb, n, "scale_b")


def _check_v2_mx(a, b, sa, sb, swa, swb):
    k = a.size(1) * (2 if a.dtype == _FP4 else 1)
    for name, sw in (("swizzle_a", swa), ("swizzle_b", swb)):
        if len(sw) != 1:
            raise ValueError(f"{name} must have 1 value, got {len(sw)}")
    ea, eb = _mx_elems(a.size(0), k), _mx_elems(b.size(1), k)
    if sa.numel() != ea:
        raise ValueError(f"For Blockwise scaling scale_a should have {ea} elements, got: {sa.numel()}")
    if sb.numel() != eb:
        raise ValueError(f"For Blockwise scaling scale_b should have {eb} elements, got: {sb.numel()}")
    if swa[0] != _SWIZZLE_32_4_4:
        raise ValueError("scale_a must be swizzled to SWIZZLE_32_4_4 format")
    if swb[0] != _SWIZZLE_32_4_4:
        raise ValueError("scale_b must be swizzled to SWIZZLE_32_4_4 format")
    if not (sa.is_contiguous() and sb.is_contiguous()):
        raise ValueError("For Blockwise scaling both scales should be contiguous")


def _scaled_mm_v2(self, mat2, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias,
                  out_dtype, contraction_dim=(), use_fast_accum=False):
    op = "_scaled_mm_v2"
    dev = self.device
    _same_device(op, dev, mat2=mat2, scale_a=scale_a, scale_b=scale_b, bias=bias)
    if self.dim() != 2 or mat2.dim() != 2:
        raise RuntimeError(f"Inputs must be 2D but got self.dim()={self.dim()} and mat2.dim()={mat2.dim()}")
    for t, name in ((self, "mat_a"), (mat2, "mat_b")):
        if not (_is_fp8(t) or t.dtype == _FP4):
            raise ValueError(f"Expected {name} to be Float8 or Float4_x2 matrix got {_fmt(t.dtype)}")
    recipe = _v2_recipe(self, mat2, scale_a, recipe_a, scale_b, recipe_b)
    if recipe is None:
        raise ValueError(_invalid_config(self, mat2, scale_a[0], scale_b[0],
                                         ("mat_a", "scale_a[0]", "mat_b", "scale_b[0]")))
    ra, rb = recipe
    if ra in (_TW, _RW):
        ha, hb, hbias = _host(self, mat2, bias)
        sr = stochastic_rounding._applies(out_dtype)
        if sr:
            _check_bias(bias, out_dtype, mat2.size(1), ValueError)
        out = torch.ops.aten._scaled_mm_v2(ha, hb, _host(*scale_a), recipe_a, swizzle_a, _host(*scale_b),
                                           recipe_b, swizzle_b, None if sr else hbias,
                                           torch.float32 if sr else out_dtype, contraction_dim,
                                           use_fast_accum)
        if sr and bias is not None:
            out += hbias.float()
        _charge(dev, op, _mm_dims(self, out),
                (self, mat2, *scale_a, *scale_b, bias, _out_meta(out.shape, out_dtype if sr else out.dtype)),
                "float8")
        return _finish(out, out_dtype, dev) if sr else _adopt(out, dev)
    if ra == _B1x16:
        raise _nvfp4(op)
    out_dtype = out_dtype if out_dtype is not None else self.dtype
    if use_fast_accum and _FP4 in (self.dtype, mat2.dtype):
        raise ValueError("`use_fast_accum` is not supported when `mat_a` or `mat_b` tensors have the "
                         "`Float4_e2m1fn_x2` dtype.")
    _check_bias(bias, out_dtype, mat2.size(1), ValueError)
    _check_out_dtype(op, out_dtype, ra)
    if ra == _B1x32:
        _check_v2_mx(self, mat2, scale_a[0], scale_b[0], list(swizzle_a), list(swizzle_b))
    else:
        _check_v2_blockwise(self, mat2, scale_a[0], scale_b[0], ra, rb)
    return _blocked(op, dev, self, mat2, scale_a[0], scale_b[0], ra, rb, bias, out_dtype, v2=True)


def _scaled_mm_v2_out(self, mat2, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias,
                      out_dtype, contraction_dim=(), use_fast_accum=False, *, out):
    r = _scaled_mm_v2(self, mat2, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias,
                      out_dtype if out_dtype is not None else out.dtype, contraction_dim, use_fast_accum)
    return _into(out, r)


_lib.impl("_scaled_mm", _scaled_mm, "PrivateUse1")
_lib.impl("_scaled_mm.out", _scaled_mm_out, "PrivateUse1")
_lib.impl("_scaled_mm_v2", _scaled_mm_v2, "PrivateUse1")
_lib.impl("_scaled_mm_v2.out", _scaled_mm_v2_out, "PrivateUse1")


# --- torch._scaled_grouped_mm and _v2 (scaled_grouped_mm): FP8 rowwise and MX grouped GEMMs, for MoE ---
def _scaled_grouped_mm(self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None,
                       out_dtype=None, use_fast_accum=False):
    op = "_scaled_grouped_mm"
    dev = self.device
    _same_device(op, dev, mat2=mat2, scale_a=scale_a, scale_b=scale_b, offs=offs, bias=bias,
                 scale_result=scale_result)
    # PyTorch's meta function carries CUDA's checks (Blas.cpp) with CUDA's messages.
    torch.ops.aten._scaled_grouped_mm(*map(to_meta, (self, mat2, scale_a, scale_b, offs, bias, scale_result)),
                                      out_dtype, use_fast_accum)
    _check_multiple_of_16(self, mat2)  # CUDA's, past what the meta function checks
    if scale_a.dtype == _E8M0:
        _check_scales_blocked(self, scale_a, 0)
        _check_scales_blocked(mat2, scale_b, 1)
        return _mx_grouped(op, dev, self, mat2, scale_a, scale_b, offs)
    out = _rowwise_grouped(self, mat2, scale_a, scale_b, offs)
    out_dtype = out_dtype or torch.bfloat16
    _charge(dev, op, _grouped_dims(self, mat2), (self, mat2, scale_a, scale_b, _out_meta(out.shape, out_dtype)),
            "float8")
    return _finish(out, out_dtype, dev)


def _rowwise_grouped(a, b, scale_a, scale_b, offs):
    """The grouped product on host memory, in fp32: operands dequantized by their row (A) and
    column (B) scales, one grouped matmul (the caller rounds once)."""
    ha, hb, sa, sb, hoffs = _host(a, b, scale_a, scale_b, offs)
    af, bf = ha.float(), hb.float()
    if ha.dim() == 2 and hb.dim() == 2:  # K grouped: one scale per row of A and column of B per group
        g, m, n = hoffs.numel(), ha.size(0), hb.size(1)
        group = torch.searchsorted(hoffs, torch.arange(ha.size(1), dtype=hoffs.dtype), right=True)
        group = group.clamp_(max=g - 1)  # columns past the last offset belong to no group
        af.mul_(sa.view(g, m)[group].t())
        bf.mul_(sb.view(g, n)[group])
    else:
        af.mul_(sa[..., None])
        bf.mul_(sb[:, None, :] if hb.dim() == 3 else sb[None, :])
    return torch._grouped_mm(af, bf, hoffs)


def _check_rowwise_scale(mat, scale, dim, arg, multiplier):
    """CUDA's checks of rowwise grouped scales (GroupedBlas.cpp), with its messages."""
    if mat.dim() == 2:
        if scale.dim() != 1:
            raise RuntimeError(f"scale must be a 1D tensor, but got {scale.dim()}D, arg {arg}")
        if not scale.is_contiguous():
            raise RuntimeError(f"scale must be contiguous for arg {arg}")
        if scale.size(0) != mat.size(dim) * multiplier:
            raise RuntimeError(f"scale must have the same length as mat for arg {arg}")
        return
    if scale.dim() != 2:
        raise RuntimeError(f"scale must be a 2D tensor, but got {scale.dim()}D for arg {arg}")
    if scale.stride(1) != 1:
        raise RuntimeError(f"scale must be contiguous in the last dimension for arg {arg}")
    if scale.size(0) != mat.size(0):
        raise RuntimeError(f"scale must have the same batch dimension as mat for arg {arg}")
    if scale.size(1) != mat.size(1 + dim):
        raise RuntimeError(f"scale must have the same first dimension as mat for arg {arg}")


def _scaled_grouped_mm_v2(self, mat2, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b,
                          offs=None, bias=None, out_dtype=None, contraction_dim=(), use_fast_accum=False):
    op = "_scaled_grouped_mm_v2"
    dev = self.device
    _same_device(op, dev, mat2=mat2, scale_a=scale_a, scale_b=scale_b, offs=offs, bias=bias)
    if self.stride(-1) != 1:
        raise ValueError("Expected mat1 to not be transposed")
    if mat2.stride(-2) != 1:
        raise ValueError("Expected mat2 to be transposed")
    if self.dim() not in (2, 3):
        raise ValueError("mat_a has to be 2 or 3d")
    if mat2.dim() not in (2, 3):
        raise ValueError("mat_b has to be 2 or 3d")
    two_d = self.dim() == 2 or mat2.dim() == 2
    if not (self.dim() == 2 and mat2.dim() == 2) and self.size(-1) != mat2.size(-2):
        raise ValueError("contraction dimension of mat_a and mat_b must match")
    _check_multiple_of_16(self, mat2)
    if bias is not None:
        raise ValueError("Bias not supported yet")
    if (offs is not None) != two_d:
        raise ValueError("Have to provide offsets if there is a 2d matrix")
    if offs is not None and offs.dim() != 1:
        raise ValueError("offs has to be 1D")
    if offs is not None and offs.dtype != torch.int32:
        raise ValueError("Offsets have to be int32")
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype != torch.bfloat16:
        raise ValueError("Only bf16 high precision output types are supported for grouped gemm")
    rowwise = (list(recipe_a) == [_RW] and list(recipe_b) == [_RW] and _is_fp8(self) and _is_fp8(mat2)
               and scale_a[0].dtype == torch.float32 and scale_b[0].dtype == torch.float32)
    if not rowwise:
        kind = _mx_grouped_recipe(self, mat2, scale_a, recipe_a, scale_b, recipe_b)
        if kind is None:
            raise ValueError("No gemm implementation was found")
        if kind == "nvfp4":
            raise _nvfp4(op)
        _check_scales_blocked(self, scale_a[0], 0)
        _check_scales_blocked(mat2, scale_b[0], 1)
        if kind == "mxfp8" and not (list(swizzle_a)[:1] == [_SWIZZLE_32_4_4]
                                    and list(swizzle_b)[:1] == [_SWIZZLE_32_4_4]):
            raise ValueError("For CUDA MXFP8 grouped gemm, both scale swizzle types must be SWIZZLE_32_4_4")
        return _mx_grouped(op, dev, self, mat2, scale_a[0], scale_b[0], offs)
    multiplier = offs.size(0) if self.dim() == 2 and mat2.dim() == 2 else 1
    _check_rowwise_scale(self, scale_a[0], 0, 0, multiplier)
    _check_rowwise_scale(mat2, scale_b[0], 1, 1, multiplier)
    out = _rowwise_grouped(self, mat2, scale_a[0], scale_b[0], offs)
    _charge(dev, op, _grouped_dims(self, mat2),
            (self, mat2, scale_a[0], scale_b[0], _out_meta(out.shape, out_dtype)), "float8")
    return _finish(out, out_dtype, dev)


def _check_multiple_of_16(a, b):
    if a.size(-1) % 16 != 0:
        raise ValueError(f"Expected trailing dimension of mat_a to be divisible by 16 but got mat1 shape: "
                         f"({_sizes(a)}).")
    if b.size(-2) % 16 != 0 or b.size(-1) % 16 != 0:
        raise ValueError(f"Expected mat_b shape to be divisible by 16 but got mat_b shape: ({_sizes(b)}).")


def _mx_grouped_recipe(a, b, sa, ra, sb, rb):
    """CUDA's grouped dispatch past rowwise (check_mxfp8/mxfp4/nvfp4_recipe): the kind, or None."""
    ra, rb = list(ra), list(rb)
    single = len(sa) == len(ra) == len(sb) == len(rb) == 1
    if single and ra[0] == rb[0] == _B1x32 and sa[0].dtype == sb[0].dtype == _E8M0:
        if a.dtype == b.dtype == torch.float8_e4m3fn:
            return "mxfp8"
        if a.dtype == b.dtype == _FP4:
            return "mxfp4"
    if a.dtype == b.dtype == _FP4 and ra[:1] == rb[:1] == [_B1x16]:
        return "nvfp4"
    return None


def _check_scales_blocked(mat, scale, arg):
    """CUDA's shape checks of E8M0 grouped scales (GroupedBlas.cpp), with its messages: a 2-D
    operand's groups are only known from ``offs`` (checked in :func:`_mx_grouped`)."""
    if mat.dim() == 2:
        if scale.dim() != mat.dim():
            raise RuntimeError("for block-scaled, scale must have same number of dimensions as parent tensor, but "
                               f"got mat.dim() = {mat.dim()} and scale.dim() = {scale.dim()} for arg {arg}")
        d = 0 if arg == 0 else 1
        if scale.size(0) < mat.size(d):
            raise RuntimeError(f"for block-scaled, arg {arg} tensor shape ({mat.size(0)}, {mat.size(1)}) must have "
                               f"scale.shape[0] >= {mat.size(d)} but got scale.shape=({scale.size(0)}, "
                               f"{scale.size(1)})")
        return
    g, k, n = mat.shape
    k *= 2 if mat.dtype == _FP4 else 1
    bk, bn = _round_up(k // 32, 4), _round_up(n, 128)
    if scale.dim() != mat.dim() - 1:
        raise RuntimeError("for block-scaled 2d-3d grouped GEMM, the 3d tensor of shape (G,K,N) must have a 2d "
                           "scale of shape (G, blocked_scale_K * blocked_scale_N),but scale is "
                           f"{scale.dim()}D for arg {arg}")
    if not (scale.size(0) == g and scale.size(1) == bk * bn):
        raise RuntimeError(f"for block-scaled grouped GEMM, the tensor shape ({g}, {k}, {n}) must have scale shape "
                           f"({g},{bk},{bn}) for arg {arg}, got: {scale.size(0)}, {scale.size(1)}")


def _group_bounds(op, offs, size, what):
    ends = offs.tolist()
    if any(e < s for s, e in zip([0] + ends, ends)) or (ends and ends[-1] > size):
        raise RuntimeError(f"aten::{op}: offs must be non-decreasing and at most {what} = {size}, got {ends}")
    return list(zip([0] + ends[:-1], ends))


def _scale_segments(op, scale, name, sizes):
    """Splits a flat E8M0 scale tensor into the groups' blocked scales, group after group."""
    flat = scale.reshape(-1)
    if sum(sizes) > flat.numel():
        raise RuntimeError(
            f"aten::{op}: {name} has {flat.numel()} elements, but the groups in offs need {sum(sizes)}: each "
            "group's scales are blocked on their own, round_up(rows, 128) x round_up(ceil(K / 32), 4) per group")
    return flat[:sum(sizes)].split(sizes)


def _mx_grouped(op, dev, a, b, scale_a, scale_b, offs):
    """MXFP8/MXFP4 grouped GEMM, 2d-2d (groups along K) and 2d-3d (groups along M), as
    fbgemm's kernels behind CUDA's: every group's scales blocked (32x4x4-swizzled) on their
    own. Each group is the dense MX kernel's product (csrc/aten/scaled_mm.cpp) on the queue,
    written into its part of the result and rounded once to bf16; charged as one kernel."""
    from .nkilib_routes import charged_as
    kind = "MXFP8" if _is_fp8(a) else "MXFP4"
    if not (a.dim() == 2 and b.dim() in (2, 3)):
        raise ValueError(f"{kind} grouped GEMM currently only supports 2d-2d and 2d-3d cases")
    if offs is None:
        raise ValueError(f"{kind} 2d-2d and 2d-3d grouped GEMMs requires offsets")
    half = 2 if a.dtype == _FP4 else 1  # FP4 packs pairs along K
    k = a.size(1) * half
    if b.dim() == 3 and k % 32:
        # CUDA's scale shape for the (G, K, N) operand counts K // 32 blocks: none for the rest
        raise ValueError(f"{kind} grouped GEMM: K = {k} must be a multiple of 32, the E8M0 block size")
    (hoffs,) = _host(offs)  # the groups' bounds decide the launches
    m, n = a.size(0), b.size(-1)
    shape = (len(hoffs), m, n) if b.dim() == 2 else (m, n)
    sr = stochastic_rounding._applies(torch.bfloat16)
    wide = torch.float32 if sr else torch.bfloat16
    seconds, flops, nbytes = _price(_grouped_dims(a, b), (a, b, scale_a, scale_b, _out_meta(shape, torch.bfloat16)),
                                    "mx")
    with charged_as(dev, op, seconds, engine="tensor", flops=flops, hbm_bytes=nbytes):
        out = torch.zeros(shape, device=dev, dtype=wide)  # empty groups, rows past the last offset
        if b.dim() == 2:
            groups = _group_bounds(op, hoffs, k, "K")
            seg_a = _scale_segments(op, scale_a, "scale_a", [_mx_elems(m, e - s) for s, e in groups])
            seg_b = _scale_segments(op, scale_b, "scale_b", [_mx_elems(n, e - s) for s, e in groups])
            for g, ((s, e), ga, gb) in enumerate(zip(groups, seg_a, seg_b)):
                if e > s:
                    _launch_blocked_mm(dev, a[:, s // half:e // half], b[s // half:e // half].t(), e - s,
                                       sa=ga, sb=gb, out=out[g])
        else:
            groups = _group_bounds(op, hoffs, m, "M")
            seg_a = _scale_segments(op, scale_a, "scale_a", [_mx_elems(e - s, k) for s, e in groups])
            for g, ((s, e), ga) in enumerate(zip(groups, seg_a)):
                if e > s:
                    _launch_blocked_mm(dev, a[s:e], b[g].t(), k, sa=ga, sb=scale_b[g], out=out[s:e])
        if sr:
            return stochastic_rounding._round(out, torch.bfloat16)
        return out


def _grouped_dims(a, b):
    """One grouped kernel: every row of A meets one group's columns."""
    k = a.size(-1) * (2 if a.dtype == _FP4 else 1)
    if a.dim() == 3 and b.dim() == 3:
        return (a.size(0), a.size(1), k, b.size(2))
    return (1, a.size(-2), k, b.size(-1))


_lib.impl("_scaled_grouped_mm", _scaled_grouped_mm, "PrivateUse1")
_lib.impl("_scaled_grouped_mm_v2", _scaled_grouped_mm_v2, "PrivateUse1")
