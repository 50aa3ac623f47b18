"""The gated MLP of Llama-style decoders: AWS's ``mlp``.

    out = (act(x @ Wg + bg) * (x @ Wu + bu)) @ Wd + bd

with x the hidden states, optionally plus a residual (``fused_add_tensor``) and then
RMS-normalised. Layouts are AWS's: hidden_tensor [B, S, H]; gate and up weights [H, I]; down
weights [I, H]; normalization weights [1, H]; biases [1, I] (gate, up) and [1, H] (down);
fused_add_tensor [B, S, H]. Returns a list, as AWS's kernel does: ``[out]`` with out
[B, S, H], or ``[out, x + fused_add]`` with ``store_fused_add_result=True``.

Tokens go in blocks of up to 512 (the moving operand of a matmul). Per block, x is
normalised with tokens on partitions, then transposed so the hidden dim is on partitions.
The gate and up projections keep the weights stationary and stream the tokens, which leaves
their result as h^T [I, tokens]: exactly the stationary operand the down projection needs,
so no transpose of the intermediate. The down projection streams 512 hidden columns of Wd
per matmul and accumulates each I block's contribution in an fp32 SBUF accumulator. Weights
stream through SBUF in I blocks sized to the target's SBUF; each (token block, I block) is a
unit whose weight load, gate/up and down stages ``nkilib.core.utils.pipeline`` interleaves
with its neighbours', so TensorE works on one unit while another's weights arrive and a
third's activations are computed. The fp32 accumulator holds a token's whole output row,
which bounds H on one core (16384 in bf16, 8192 in fp32; larger raises UnsupportedError).
"""
from __future__ import annotations

from enum import Enum

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E
from nki.language import as_dtype

from ..utils.common_types import ActFnType, NormType, QuantizationType
from ..utils.pipeline import pipeline as _pipeline
from ..utils.refuse import unsupported

_ACT = {"SiLU": nl.silu, "GELU": nl.gelu, "GELU_Tanh_Approx": nl.gelu_apprx_tanh,
        "Swish": nl.gelu_apprx_sigmoid}
_NORMS = ("NO_NORM", "RMS_NORM", "RMS_NORM_SKIP_GAMMA")
# SBUF bytes per partition for a token block's x^T and output accumulator; for one I
# block's three weight tiles (two blocks' are live at once); and for everything together
# (short of the 192 KiB NKI grants a kernel, for fragmentation).
_TOKEN_BUDGET = 64 * 1024
_WEIGHT_BUDGET = 48 * 1024
_SBUF_BUDGET = 176 * 1024


@nki.jit
def mlp(hidden_tensor, gate_proj_weights_tensor, up_proj_weights_tensor,
        down_proj_weights_tensor, normalization_weights_tensor=None, gate_proj_bias_tensor=None,
        up_proj_bias_tensor=None, down_proj_bias_tensor=None, normalization_bias_tensor=None,
        fused_add_tensor=None, store_fused_add_result=False, activation_fn=ActFnType.SiLU,
        normalization_type=NormType.NO_NORM, quantization_type=QuantizationType.NONE,
        gate_w_scale=None, up_w_scale=None, down_w_scale=None, gate_up_in_scale=None,
        down_in_scale=None, quant_clipping_bound=0.0, output_dtype=None,
        store_output_in_sbuf=False, eps=1e-6, skip_gate_proj=False,
        use_tkg_gate_up_proj_column_tiling=True, use_tkg_down_proj_column_tiling=True,
        use_tkg_down_proj_optimized_layout=False, gate_clamp_upper_limit=None,
        gate_clamp_lower_limit=None, up_clamp_upper_limit=None, up_clamp_lower_limit=None,
        force_cte_mode=False, sbm=None):
    # The column-tiling / layout / mode flags choose between AWS's implementations; this one
    # kernel serves every token count, so they are accepted and have no effect.
    c = _check(hidden_tensor, gate_proj_weights_tensor, up_proj_weights_tensor,
               down_proj_weights_tensor, normalization_weights_tensor, normalization_type,
               normalization_bias_tensor, activation_fn, quantization_type,
               (gate_w_scale, up_w_scale, down_w_scale, gate_up_in_scale, down_in_scale),
               store_output_in_sbuf, skip_gate_proj, fused_add_tensor, output_dtype)
    c.eps = float(eps)
    c.clamp_g = (gate_clamp_lower_limit, gate_clamp_upper_limit)
    c.clamp_u = (up_clamp_lower_limit, up_clamp_upper_limit)
    B, S, H = hidden_tensor.shape
    out = nl.ndarray((B, S, H), dtype=c.out_dtype, buffer=nl.shared_hbm)
    c.out = out.reshape((c.T, H))
    fused = None
    if store_fused_add_result:
        if fused_add_tensor is None:
            raise E.ShapeMismatchError("mlp: store_fused_add_result=True needs a fused_add_tensor")
        fused = nl.ndarray((B, S, H), dtype=hidden_tensor.dtype, buffer=nl.shared_hbm)
    c.fused_out = fused.reshape((c.T, H)) if fused is not None else None
    c.res = fused_add_tensor.reshape((c.T, H)) if fused_add_tensor is not None else None
    _constants(c, normalization_weights_tensor, gate_proj_bias_tensor, up_proj_bias_tensor,
               down_proj_bias_tensor)
    n_prog, pid = nl.num_programs(0), nl.program_id(0)
    units = []
    for k, t0 in enumerate(range(0, c.T, c.TB)):
        if k % n_prog != pid:
            continue
        blk = _TokenBlock(t0=t0, tw=min(c.TB, c.T - t0))
        units.append(_x_unit(c, blk))
        i_blocks = list(range(0, c.I, c.IB))
        for j, i0 in enumerate(i_blocks):
            units.append(_block_unit(c, blk, i0, min(c.IB, c.I - i0), j == 0,
                                     j == len(i_blocks) - 1))
    _pipeline(units)
    return [out, fused] if fused is not None else [out]


class _TokenBlock:
    """A block of tokens: its x^T tile and its fp32 output accumulator."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _name(x):
    return x.name if isinstance(x, Enum) else str(x)


def _check(x, wg, wu, wd, norm_w, norm_type, norm_b, act, quant, scales, in_sbuf, skip_gate,
           res, output_dtype):
    """Shapes, dtypes and the options this kernel covers, with errors naming them."""
    if x.ndim != 3:
        raise E.ShapeMismatchError(f"mlp: hidden_tensor must be [B, S, H], got {tuple(x.shape)}")
    B, S, H = x.shape
    if wg.ndim != 2 or wg.shape[0] != H:
        raise E.ShapeMismatchError(f"mlp: gate_proj_weights_tensor {tuple(wg.shape)} must be [H, I] "
                                   f"with H = {H} (hidden_tensor {tuple(x.shape)})")
    I = wg.shape[1]
    for name, t, want in (("up_proj_weights_tensor", wu, (H, I)),
                          ("down_proj_weights_tensor", wd, (I, H))):
        if tuple(t.shape) != want:
            raise E.ShapeMismatchError(f"mlp: {name} {tuple(t.shape)} must be {want} for "
                                       f"hidden_tensor {tuple(x.shape)} and gate weights "
                                       f"{tuple(wg.shape)}")
    if res is not None and tuple(res.shape) != (B, S, H):
        raise E.ShapeMismatchError(f"mlp: fused_add_tensor {tuple(res.shape)} must be {(B, S, H)}")
    if _name(quant) != "NONE" or any(s is not None for s in scales):
        unsupported("mlp", "quantized weights (quantization_type, *_scale)")
    if in_sbuf:
        raise E.UnsupportedError("mlp: store_output_in_sbuf needs a caller kernel's SBUF; this "
                                 "standalone kernel returns HBM tensors")
    if skip_gate:
        unsupported("mlp", "skip_gate_proj")
    norm = _name(norm_type)
    if norm not in _NORMS:
        raise E.UnsupportedError(f"mlp: normalization_type {norm} is not implemented "
                                 f"(supported: {', '.join(_NORMS)})")
    if norm_b is not None:
        unsupported("mlp", "normalization_bias_tensor (LayerNorm)")
    if norm == "RMS_NORM":
        if norm_w is None:
            raise E.ShapeMismatchError("mlp: normalization_type RMS_NORM needs normalization_weights_tensor")
        if norm_w.size != H:
            raise E.ShapeMismatchError(f"mlp: normalization_weights_tensor {tuple(norm_w.shape)} must "
                                       f"be [1, {H}]")
    fn = _ACT.get(_name(act))
    if fn is None:
        raise E.UnsupportedError(f"mlp: activation_fn {_name(act)} is not implemented "
                                 f"(supported: {', '.join(_ACT)})")
    dt = x.dtype
    for name, t in (("gate_proj_weights_tensor", wg), ("up_proj_weights_tensor", wu),
                    ("down_proj_weights_tensor", wd)):
        if t.dtype != dt:
            raise E.DtypeLegalityError(f"mlp: {name} is {t.dtype.name}, hidden_tensor is {dt.name}; "
                                       f"the kernel needs one dtype")
    if dt.name not in ("float32", "bfloat16", "float16"):
        raise E.DtypeLegalityError(f"mlp: dtype {dt.name} is not supported (float32, bfloat16, float16)")
    P = nl.tile_size.pmax
    item = dt.itemsize
    T = B * S
    # Token block: a multiple of 128 (the down projection's stationary width) up to 512 (the
    # gate/up moving width), with x^T and the fp32 accumulator within budget; fewer tokens
    # only for a very large H.
    TB = _fit(_TOKEN_BUDGET * P // (H * (item + 4)), 512)
    TB = min(TB, -(-T // P) * P)
    # accumulator, x (while transposed), x^T, the squares' scratch and an output row tile
    tw = min(TB, T)
    token_bytes = -(-tw // P) * H * (4 + item) + tw * H * item // P + min(H, 2048) * item + \
        H * (as_dtype(output_dtype).itemsize if output_dtype is not None else item)
    # I block: up to 512 columns of Wg/Wu (rows of Wd) within what the tokens leave; under
    # 128 (fewer contraction rows for the down projection) only when H is too large for 128.
    budget = min(_WEIGHT_BUDGET, (_SBUF_BUDGET - token_bytes) // 2)
    IB = _fit(budget * P // (3 * H * item), 512) if budget > 0 else 0
    if IB < 16 or TB < 16:
        raise E.UnsupportedError(f"mlp: hidden size {H} in {dt.name} leaves no room in SBUF for "
                                 f"a block of weights (the fp32 accumulator of a token takes "
                                 f"{4 * H} bytes per partition); shard H across programs")
    return _Cfg(x=x.reshape((T, H)), wg=wg, wu=wu, wd=wd, T=T, H=H, I=I, TB=TB, IB=min(IB, I),
                dt=dt, act=fn, norm=norm, out_dtype=dt if output_dtype is None else output_dtype)


def _fit(n, top):
    """The largest size <= n, and <= top, that is a multiple of 128 or a power of two."""
    if n >= 128:
        return min(top, n // 128 * 128)
    return 1 << (max(n, 1).bit_length() - 1)


def _chunks(n, size=128):
    return [(a, min(size, n - a)) for a in range(0, n, size)]


def _load_rows(dst, src, r0, rows, c0, cw):
    """dst[p, k, 0:cw] = src[r0 + 128k + p, c0:c0 + cw]: full 128-row chunks in two DMAs of
    64 partitions (each DMA takes 4 of the 16 queues, so a block's three weight loads keep
    all of them busy), a partial last chunk in one more."""
    P = nl.tile_size.pmax
    C = src.shape[1]
    kf, tail = divmod(rows, P)
    for p0 in range(0, P if kf else 0, P // 2):
        nisa.dma_copy(dst=dst[p0:p0 + P // 2, 0:kf, 0:cw],
                      src=src.ap([[C, P // 2], [P * C, kf], [1, cw]], offset=(r0 + p0) * C + c0))
    if tail:
        nisa.dma_copy(dst=dst[0:tail, kf, 0:cw], src=src[r0 + kf * P:r0 + rows, c0:c0 + cw])


def _load_cols(dst, vec, n, off=0):
    """dst[p, k] = vec[off + 128k + p] for elements off .. off + n of a [1, N] vector:
    per-partition operands of the transposed layouts (one 128-slice per column)."""
    P = nl.tile_size.pmax
    kf, tail = divmod(n, P)
    flat = vec.reshape((1, vec.size))
    if kf:
        nisa.dma_copy(dst=dst[:, 0:kf], src=flat.ap([[1, P], [P, kf]], offset=off))
    if tail:
        nisa.dma_copy(dst=dst[0:tail, kf:kf + 1], src=flat[0:1, off + kf * P:off + n])


def _constants(c, norm_w, bg, bu, bd):
    """Per-partition columns of the norm weight (x^T rows) and the gate/up biases (h^T
    rows), and the down bias repeated on every partition (output rows are tokens)."""
    P = nl.tile_size.pmax
    c.w_cols = c.bg = c.bu = c.bd = None
    if c.norm == "RMS_NORM":
        c.w_cols = nl.ndarray((P, -(-c.H // P)), dtype=nl.float32, buffer=nl.sbuf)
        _load_cols(c.w_cols, norm_w, c.H)
    for name, t in (("bg", bg), ("bu", bu)):      # loaded per I block, partition-aligned
        if t is not None and t.size != c.I:
            raise E.ShapeMismatchError(f"mlp: {'gate' if name == 'bg' else 'up'}_proj_bias_tensor "
                                       f"{tuple(t.shape)} must be [1, {c.I}]")
        setattr(c, name, t)
    if bd is not None:
        if bd.size != c.H:
            raise E.ShapeMismatchError(f"mlp: down_proj_bias_tensor {tuple(bd.shape)} must be [1, {c.H}]")
        c.bd = nl.ndarray((P, c.H), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=c.bd, src=bd.reshape((1, c.H)).ap([[0, P], [1, c.H]], offset=0))


def _x_unit(c, blk):
    """Loads a token block, adds the residual, RMS-normalises it and transposes it to
    x^T [H (128-row chunks), tokens]."""
    P = nl.tile_size.pmax
    H, dt = c.H, c.dt
    subs = _chunks(blk.tw)
    xs = []
    for s0, ts in subs:
        x = nl.ndarray((P, H), dtype=dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=x[0:ts, :], src=c.x[blk.t0 + s0:blk.t0 + s0 + ts, :])
        if c.res is not None:
            r = nl.ndarray((P, H), dtype=c.res.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=r[0:ts, :], src=c.res[blk.t0 + s0:blk.t0 + s0 + ts, :])
            nisa.tensor_tensor(dst=x[0:ts, :], data1=x[0:ts, :], data2=r[0:ts, :], op=nl.add)
            if c.fused_out is not None:
                nisa.dma_copy(dst=c.fused_out[blk.t0 + s0:blk.t0 + s0 + ts, :], src=x[0:ts, :])
        xs.append(x)
    yield 1
    if c.norm != "NO_NORM":     # x * rsqrt(mean(x^2) + eps); the weight is applied on x^T
        sq = nl.ndarray((P, min(H, 2048)), dtype=dt, buffer=nl.sbuf)   # squares: only their sum is kept
        for (s0, ts), x in zip(subs, xs):
            parts = _chunks(H, 2048)
            ss = nl.ndarray((P, len(parts)), dtype=nl.float32, buffer=nl.sbuf)
            for j, (h0, hw) in enumerate(parts):     # the sum is taken in fp32 before rounding
                nisa.activation(dst=sq[0:ts, 0:hw], op=nl.square, data=x[0:ts, h0:h0 + hw],
                                reduce_op=nl.add, reduce_res=ss[0:ts, j:j + 1])
            if len(parts) > 1:
                tot = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_reduce(dst=tot[0:ts, :], op=nl.add, data=ss[0:ts, :], axis=1)
                ss = tot
            nisa.tensor_scalar(dst=ss[0:ts, :], data=ss[0:ts, :], op0=nl.multiply, operand0=1.0 / H,
                               op1=nl.add, operand1=c.eps)
            nisa.activation(dst=ss[0:ts, :], op=nl.rsqrt, data=ss[0:ts, :])
            nisa.activation(dst=x[0:ts, :], op=nl.copy, data=x[0:ts, :], scale=ss[0:ts, :])
        yield 1
    kh = _chunks(H)
    blk.xT = nl.ndarray((P, len(kh), blk.tw), dtype=dt, buffer=nl.sbuf)
    for j, (h0, hw) in enumerate(kh):
        t_ps = nl.ndarray((hw, blk.tw), dtype=dt, buffer=nl.psum)
        for (s0, ts), x in zip(subs, xs):
            nisa.nc_transpose(dst=t_ps[:, s0:s0 + ts], data=x[0:ts, h0:h0 + hw])
        dst = blk.xT[0:hw, j, :]
        if c.w_cols is not None:     # the norm weight is per hidden row here: a per-partition scale
            w = c.w_cols[0:hw, j:j + 1]
            if j % 2:
                nisa.activation(dst=dst, op=nl.copy, data=t_ps, scale=w)
            else:
                nisa.tensor_scalar(dst=dst, data=t_ps, op0=nl.multiply, operand0=w)
        elif j % 2:
            nisa.activation(dst=dst, op=nl.copy, data=t_ps)
        else:
            nisa.tensor_copy(dst=dst, src=t_ps)
    blk.acc = nl.ndarray((P, len(subs), H), dtype=nl.float32, buffer=nl.sbuf)


def _clamp(dst, src, lo, hi, bias):
    """dst = clamp(src + bias, lo, hi) on VectorE."""
    ops = [(nl.add, bias)] if bias is not None else []
    ops += [(nl.maximum, float(lo))] if lo is not None else []
    ops += [(nl.minimum, float(hi))] if hi is not None else []
    cur = src
    for k in range(0, len(ops), 2):
        pair = ops[k:k + 2]
        kw = dict(op1=pair[1][0], operand1=pair[1][1]) if len(pair) > 1 else {}
        nisa.tensor_scalar(dst=dst, data=cur, op0=pair[0][0], operand0=pair[0][1], **kw)
        cur = dst


def _block_unit(c, blk, i0, iw, first, last):
    """One I block of one token block: load its weights, the gate/up projections into
    h^T, and its share of the down projection."""
    P, H, dt = nl.tile_size.pmax, c.H, c.dt
    kh, ki = _chunks(H), _chunks(iw)
    wg = nl.ndarray((P, len(kh), iw), dtype=dt, buffer=nl.sbuf)
    wu = nl.ndarray((P, len(kh), iw), dtype=dt, buffer=nl.sbuf)
    wd = nl.ndarray((P, len(ki), H), dtype=dt, buffer=nl.sbuf)
    _load_rows(wg, c.wg, 0, H, i0, iw)
    _load_rows(wu, c.wu, 0, H, i0, iw)
    _load_rows(wd, c.wd, i0, iw, 0, H)
    bias = {}
    for name in ("bg", "bu"):
        if getattr(c, name) is not None:
            bias[name] = nl.ndarray((P, len(ki)), dtype=nl.float32, buffer=nl.sbuf)
            _load_cols(bias[name], getattr(c, name), iw, i0)
    yield 1
    # gate and up: weights stationary, tokens moving -> [I chunk, tokens] in one PSUM bank
    tw = blk.tw
    hT = nl.ndarray((P, len(ki), tw), dtype=dt, buffer=nl.sbuf)
    for j, (a0, aw) in enumerate(ki):
        g_ps = nl.ndarray((aw, tw), dtype=nl.float32, buffer=nl.psum)
        u_ps = nl.ndarray((aw, tw), dtype=nl.float32, buffer=nl.psum)
        for ps, w in ((g_ps, wg), (u_ps, wu)):
            for k, (h0, hw) in enumerate(kh):
                nisa.nc_matmul(dst=ps, stationary=w[0:hw, k, a0:a0 + aw], moving=blk.xT[0:hw, k, :],
                               accumulate=k > 0)
        bg = bias["bg"][0:aw, j:j + 1] if "bg" in bias else None
        bu = bias["bu"][0:aw, j:j + 1] if "bu" in bias else None
        g_in = g_ps
        if any(v is not None for v in c.clamp_g):
            g_in = nl.ndarray((aw, tw), dtype=nl.float32, buffer=nl.sbuf)
            _clamp(g_in, g_ps, *c.clamp_g, bg)
            bg = None
        a = nl.ndarray((aw, tw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=a, op=c.act, data=g_in, bias=bg)
        u_in = u_ps
        if any(v is not None for v in c.clamp_u):
            u_in = nl.ndarray((aw, tw), dtype=nl.float32, buffer=nl.sbuf)
            _clamp(u_in, u_ps, *c.clamp_u, bu)
            bu = None
        nisa.scalar_tensor_tensor(dst=hT[0:aw, j, :], data=u_in, op0=nl.add,
                                  operand0=bu if bu is not None else 0.0, op1=nl.multiply,
                                  operand1=a)
    del wg, wu
    yield 1
    # down: h^T stationary (128 tokens), Wd moving (512 hidden columns) -> [tokens, 512]
    acc = blk.acc
    for s, (s0, ts) in enumerate(_chunks(tw)):
        o = nl.ndarray((P, H), dtype=c.out_dtype, buffer=nl.sbuf) if last else None
        for n, (h0, hw) in enumerate(_chunks(H, 512)):
            y_ps = nl.ndarray((ts, hw), dtype=nl.float32, buffer=nl.psum)
            for j, (a0, aw) in enumerate(ki):
                nisa.nc_matmul(dst=y_ps, stationary=hT[0:aw, j, s0:s0 + ts],
                               moving=wd[0:aw, j, h0:h0 + hw], accumulate=j > 0)
            dst = o[0:ts, h0:h0 + hw] if last else acc[0:ts, s, h0:h0 + hw]
            if not first:
                nisa.tensor_tensor(dst=dst, data1=acc[0:ts, s, h0:h0 + hw], data2=y_ps, op=nl.add)
            elif c.bd is not None:
                nisa.tensor_tensor(dst=dst, data1=y_ps, data2=c.bd[0:ts, h0:h0 + hw], op=nl.add)
            elif n % 2:
                nisa.activation(dst=dst, op=nl.copy, data=y_ps)
            else:
                nisa.tensor_copy(dst=dst, src=y_ps)
        if last:
            nisa.dma_copy(dst=c.out[blk.t0 + s0:blk.t0 + s0 + ts, :], src=o[0:ts, :])
