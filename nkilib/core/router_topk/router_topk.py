"""Mixture-of-Experts router: AWS's ``router_topk``.

router_logits = x @ w (+ w_bias); the top-k experts of each token; their affinities.
Layouts: x in HBM as [H, T] (``x_hbm_layout=XHBMLayout_H_T__0``) or [T, H]
(``XHBMLayout_T_H__1``), any H; w [H, E] with E <= 512; w_bias [1, E] or [E] or None.
Outputs (passed in as AWS's mutable tensors, or None to have the kernel allocate them in the
dtype of x, indices uint32): router_logits [T, E], expert_index [T, k], expert_affinities
[T, E]. ``x_sb_layout`` names an SBUF layout of x for callers that hold x on chip; x comes
from HBM here, so it is checked and otherwise unused. Returns
[router_logits, expert_index, expert_affinities] plus, with ``return_eager_affi``, the top-k
affinities [T, k] (float32) in expert_index's order.

The pipelines (AWS's):
* ``router_pre_norm=True`` (ACT1 then top-k): expert_affinities = act(logits) over all E;
  with ``norm_topk_prob`` only the top-k keep their affinity, divided by the top-k's sum.
* ``router_pre_norm=False`` (top-k then ACT2): act over the k selected logits (softmax over
  them, or sigmoid), scattered into [T, E], zero elsewhere.
Experts are ranked on the logits, so the ranking is the activation's (both are monotonic);
among equal logits the lower expert index ranks first. k may exceed AWS's 8.

How, per tile of up to 128 tokens: x^T tiles (H on partitions; [T, H] inputs transposed on
TensorE) times w accumulate in one fp32 PSUM bank, the bias added by one more matmul of a
ones row; VectorE's max8 / nc_match_replace8 rounds pick the top k and leave -inf where they
were, which is the scatter mask: the affinity tile is ``(picked == -inf) * act`` in one
VectorE pass; ScalarE computes every activation. Tiles are software-pipelined.
``use_column_tiling``, ``use_indirect_dma_scatter`` and ``use_PE_broadcast_w_bias`` are
AWS's implementation choices and change nothing here; ``shard_on_tokens`` splits the tokens
over an LNC launch (``router_topk[2]``), otherwise every program computes all of them;
``skip_store_*`` leave that output unwritten (AWS refuses it for router_logits; here it works).
``RouterActFnType`` is AWS's (``nkilib.core.utils.common_types``, importable from here too);
members of any enum named SIGMOID / SOFTMAX are accepted.
"""
from __future__ import annotations

from types import SimpleNamespace as _Cfg   # the kernel's operands and options

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..utils.common_types import RouterActFnType
from ..utils.dma import runs as _runs
from ..utils.pipeline import pipeline as _pipeline

XHBMLayout_H_T__0 = 0
XHBMLayout_T_H__1 = 1
XSBLayout_tp102__0 = 0
XSBLayout_tp2013__1 = 1
XSBLayout_tp201__2 = 2
XSBLayout__128_Hdiv128_T__3 = 3

_P = 128
_E_MAX = 512        # fp32 logits of one token tile fill one PSUM bank
_NEG = float("-inf")


@nki.jit
def router_topk(x, w, w_bias, router_logits, expert_affinities, expert_index, act_fn, k,
                x_hbm_layout, x_sb_layout, router_pre_norm=True, norm_topk_prob=False,
                use_column_tiling=False, use_indirect_dma_scatter=False, return_eager_affi=False,
                use_PE_broadcast_w_bias=False, shard_on_tokens=False, skip_store_expert_index=False,
                skip_store_router_logits=False):
    """Router logits, top-k expert indices and expert affinities (see the module docstring)."""
    act = router_act(act_fn)
    T, H, E = _check(x, w, w_bias, k, x_hbm_layout, x_sb_layout)
    outs = []
    for t, shape, dt, what in ((router_logits, (T, E), x.dtype, "router_logits"),
                               (expert_index, (T, k), nl.uint32, "expert_index"),
                               (expert_affinities, (T, E), x.dtype, "expert_affinities")):
        if t is None:
            t = nl.ndarray(shape, dtype=dt, buffer=nl.shared_hbm)
        elif tuple(t.shape) != shape:
            raise E.ShapeMismatchError(f"router_topk: {what} must be {shape} for x {tuple(x.shape)}, "
                                       f"w {tuple(w.shape)}, k={k}; got {tuple(t.shape)}")
        outs.append(t)
    eager = nl.ndarray((T, k), dtype=nl.float32, buffer=nl.shared_hbm) if return_eager_affi else None
    lo, hi = 0, T
    n_prog, pid = nl.num_programs(0), nl.program_id(0)
    if shard_on_tokens and n_prog > 1:
        share = T // n_prog
        lo, hi = pid * share, (T if pid == n_prog - 1 else (pid + 1) * share)
    c = _Cfg(x=x, T=T, H=H, E=E, k=k, act=act, layout=x_hbm_layout, pre=router_pre_norm,
             norm=router_pre_norm and norm_topk_prob, logits=outs[0], index=outs[1], affin=outs[2],
             eager=eager, aff_dtype=outs[2].dtype, store_logits=not skip_store_router_logits,
             store_index=not skip_store_expert_index)
    if hi > lo:
        _load_weights(c, w, w_bias)
        _pipeline([tile_stages(c, t0, min(_P, hi - t0)) for t0 in range(lo, hi, _P)])
    return outs + ([eager] if return_eager_affi else [])


def router_act(act_fn):
    """The RouterActFnType an ``act_fn`` names (a member, its name or AWS's value)."""
    if isinstance(act_fn, RouterActFnType):
        return act_fn
    key = getattr(act_fn, "name", act_fn)
    if isinstance(key, str) and key.upper() in RouterActFnType.__members__:
        return RouterActFnType[key.upper()]
    if isinstance(key, int) and key in (0, 1):
        return RouterActFnType(key)
    raise E.UnsupportedError(f"router_topk: act_fn must be SOFTMAX or SIGMOID, got {act_fn!r}")


def _check(x, w, w_bias, k, x_hbm_layout, x_sb_layout):
    if x_hbm_layout not in (XHBMLayout_H_T__0, XHBMLayout_T_H__1):
        raise E.UnsupportedError(f"router_topk: x_hbm_layout must be 0 ([H, T]) or 1 ([T, H]), "
                                 f"got {x_hbm_layout}")
    if x_sb_layout not in (0, 1, 2, 3):
        raise E.UnsupportedError(f"router_topk: x_sb_layout must be 0..3, got {x_sb_layout}")
    if x.ndim != 2 or w.ndim != 2:
        raise E.ShapeMismatchError(f"router_topk: x and w must be 2-D, got x {tuple(x.shape)} and "
                                   f"w {tuple(w.shape)}")
    H, E_ = w.shape
    xH, T = x.shape if x_hbm_layout == XHBMLayout_H_T__0 else x.shape[::-1]
    if xH != H:
        raise E.ShapeMismatchError(f"router_topk: x {tuple(x.shape)} (layout {x_hbm_layout}) has "
                                   f"H={xH}, w {tuple(w.shape)} has H={H}")
    if not 1 <= E_ <= _E_MAX:
        raise E.ShapeMismatchError(f"router_topk: E={E_} experts (w {tuple(w.shape)}) must be in "
                                   f"[1, {_E_MAX}]")
    if not 1 <= k <= E_:
        raise E.ShapeMismatchError(f"router_topk: k must be in [1, {E_}] for w {tuple(w.shape)}, got {k}")
    if x.dtype != w.dtype or x.dtype not in (nl.float32, nl.bfloat16):
        raise E.UnsupportedError(f"router_topk: x and w must share a dtype, float32 or bfloat16; got "
                                 f"{x.dtype.name} and {w.dtype.name}")
    if w_bias is not None and w_bias.size != E_:
        raise E.ShapeMismatchError(f"router_topk: w_bias must be [1, {E_}] or [{E_}], got "
                                   f"{tuple(w_bias.shape)}")
    return T, H, E_


def _h_tiles(H):
    return [(h0, min(_P, H - h0)) for h0 in range(0, H, _P)]


def _load_weights(c, w, w_bias):
    """w as [128, H/128, E] (contraction tile j on dim 1); the bias as a [1, E] row and a row
    of ones to add it with one more matmul."""
    E_, nh = c.E, len(_h_tiles(c.H))
    c.w = nl.ndarray((_P, nh, E_), dtype=w.dtype, buffer=nl.sbuf)
    full = c.H // _P
    for j0, n in _runs(full):
        nisa.dma_copy(dst=c.w[:, j0:j0 + n, :],
                      src=w.ap(pattern=[[E_, _P], [_P * E_, n], [1, E_]], offset=j0 * _P * E_))
    if c.H % _P:
        nisa.dma_copy(dst=c.w[0:c.H % _P, full, :], src=w[full * _P:c.H, :])
    c.bias = None
    if w_bias is not None:
        c.bias = nl.ndarray((1, E_), dtype=w_bias.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=c.bias, src=w_bias.reshape((1, E_)))
        c.ones = nl.ndarray((1, _P), dtype=w_bias.dtype, buffer=nl.sbuf)
        nisa.memset(dst=c.ones, value=1.0, engine=nisa.gpsimd_engine)


def _load_xT(c, t0, tt):
    """x^T for tokens t0..t0+tt as [128, H/128, tt]: H on partitions, as the matmul contracts."""
    x, H = c.x, c.H
    tiles = _h_tiles(H)
    xT = nl.ndarray((_P, len(tiles), tt), dtype=x.dtype, buffer=nl.sbuf)
    if c.layout == XHBMLayout_H_T__0:
        full = H // _P
        for j0, n in _runs(full):
            nisa.dma_copy(dst=xT[:, j0:j0 + n, :],
                          src=x.ap(pattern=[[c.T, _P], [_P * c.T, n], [1, tt]], offset=j0 * _P * c.T + t0))
        if H % _P:
            nisa.dma_copy(dst=xT[0:H % _P, full, :], src=x[full * _P:H, t0:t0 + tt])
        return xT
    xs = nl.ndarray((tt, H), dtype=x.dtype, buffer=nl.sbuf)
    for j0, n in _runs(len(tiles)):
        a, b = j0 * _P, min(H, (j0 + n) * _P)
        nisa.dma_copy(dst=xs[:, a:b], src=x[t0:t0 + tt, a:b])
    for j, (h0, hs) in enumerate(tiles):
        ps = nl.ndarray((hs, tt), dtype=x.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=xs[:, h0:h0 + hs])
        if j % 2:     # PSUM to SBUF on ScalarE and VectorE in turn (GpSimd cannot read PSUM)
            nisa.activation(dst=xT[0:hs, j, :], op=nl.copy, data=ps)
        else:
            nisa.tensor_copy(dst=xT[0:hs, j, :], src=ps)
    return xT


def tile_stages(c, t0, tt, xT=None):
    """Tokens t0..t0+tt, as stages separated by ``yield``. A caller holding x^T in SBUF
    (``moe_block_tkg``) passes it as ``xT``, its contraction tiles in ``c.w``'s order; the
    tiles the kernel keeps in SBUF are left in ``c.sb`` (affinities, logits with the top k
    at -inf)."""
    E_, k = c.E, c.k
    f32 = nl.float32
    if xT is None:
        xT = _load_xT(c, t0, tt)
    if k % 8:    # the last round knocks out only the k % 8 kept: NaN matches nothing
        knock = nl.ndarray((tt, 8), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=knock, value=float("nan"), engine=nisa.gpsimd_engine)
    yield 1
    ps = nl.ndarray((tt, E_), dtype=f32, buffer=nl.psum)
    tiles = _h_tiles(c.H)
    for j, (h0, hs) in enumerate(tiles):
        nisa.nc_matmul(dst=ps, stationary=xT[0:hs, j, :], moving=c.w[0:hs, j, :], accumulate=j > 0)
    if c.bias is not None:
        nisa.nc_matmul(dst=ps, stationary=c.ones[:, 0:tt], moving=c.bias, accumulate=True)
    yield 1
    Ew = max(E_, 8)          # max8 reads at least 8 elements
    lg = nl.ndarray((tt, Ew), dtype=f32, buffer=nl.sbuf)
    if Ew > E_:
        nisa.memset(dst=lg[:, E_:Ew], value=_NEG, engine=nisa.gpsimd_engine)
    nisa.activation(dst=lg[:, 0:E_], op=nl.copy, data=ps)
    if c.store_logits:
        nisa.dma_copy(dst=c.logits[t0:t0 + tt, :], src=lg[:, 0:E_])
    rounds = -(-k // 8)
    vals = nl.ndarray((tt, 8 * rounds), dtype=f32, buffer=nl.sbuf)
    idx = nl.ndarray((tt, 8 * rounds), dtype=nl.uint32, buffer=nl.sbuf)
    picked = nl.ndarray((tt, Ew), dtype=f32, buffer=nl.sbuf)     # logits with the top k at -inf
    src = ps if Ew == E_ else lg     # VectorE reads PSUM itself, beside ScalarE's copy
    for i in range(rounds):
        sl = slice(8 * i, 8 * i + 8)
        data = src if i == 0 else picked
        nisa.max8(dst=vals[:, sl], src=data)
        found = vals[:, sl]
        if i == rounds - 1 and k % 8:
            nisa.tensor_copy(dst=knock[:, 0:k % 8], src=vals[:, 8 * i:8 * i + k % 8])
            found = knock
        nisa.nc_match_replace8(dst=picked, data=data, vals=found, imm=_NEG, dst_idx=idx[:, sl])
    if c.store_index:
        nisa.dma_copy(dst=c.index[t0:t0 + tt, :], src=idx[:, 0:k])
    yield 1
    aff, top = _affinities(c, lg[:, 0:E_], picked[:, 0:E_], vals[:, 0:k], tt)
    c.sb = _Cfg(aff=aff, picked=picked)
    yield 1
    if c.affin is not None:
        nisa.dma_copy(dst=c.affin[t0:t0 + tt, :], src=aff)
    if c.eager is not None:
        nisa.dma_copy(dst=c.eager[t0:t0 + tt, :], src=top)


def _affinities(c, lg, picked, top_logits, tt):
    """The [tt, E] affinity tile and the top-k affinities [tt, k], on ScalarE (then one
    VectorE pass to mask)."""
    E_, k = c.E, c.k
    f32 = nl.float32
    aff = nl.ndarray((tt, E_), dtype=c.aff_dtype, buffer=nl.sbuf)
    top = nl.ndarray((tt, k), dtype=f32, buffer=nl.sbuf)
    full = nl.ndarray((tt, E_), dtype=f32, buffer=nl.sbuf)
    softmax = c.act == RouterActFnType.SOFTMAX
    neg_max = nl.ndarray((tt, 1), dtype=f32, buffer=nl.sbuf)
    if softmax:
        nisa.activation(dst=neg_max, op=nl.identity, data=top_logits[:, 0:1], scale=-1.0)
    scatter = c.norm or not c.pre
    if not scatter:                  # act over all experts
        if softmax:
            s = nl.ndarray((tt, 1), dtype=f32, buffer=nl.sbuf)
            nisa.activation(dst=full, op=nl.exp, data=lg, bias=neg_max, reduce_op=nl.add, reduce_res=s)
            nisa.activation(dst=s, op=nl.reciprocal, data=s)
            nisa.activation(dst=aff, op=nl.copy, data=full, scale=s)
            nisa.activation(dst=top, op=nl.exp, data=top_logits, bias=neg_max)
            nisa.activation(dst=top, op=nl.copy, data=top, scale=s)
        else:
            nisa.activation(dst=aff, op=nl.sigmoid, data=lg)
            nisa.activation(dst=top, op=nl.sigmoid, data=top_logits)
        return aff, top
    if softmax:    # softmax over the top k: exp(l - max - log(sum over the top k))
        s = nl.ndarray((tt, 1), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=top, op=nl.exp, data=top_logits, bias=neg_max, reduce_op=nl.add, reduce_res=s)
        nisa.activation(dst=s, op=nl.log, data=s)
        bias = nl.ndarray((tt, 1), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=bias, op=nl.identity, data=s, scale=-1.0, bias=neg_max)
        nisa.activation(dst=full, op=nl.exp, data=lg, bias=bias)
        nisa.activation(dst=top, op=nl.exp, data=top_logits, bias=bias)
    elif c.norm:   # sigmoid, divided by the top k's sum
        s = nl.ndarray((tt, 1), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=top, op=nl.sigmoid, data=top_logits, reduce_op=nl.add, reduce_res=s)
        nisa.activation(dst=s, op=nl.reciprocal, data=s)
        nisa.activation(dst=full, op=nl.sigmoid, data=lg)
        nisa.activation(dst=full, op=nl.copy, data=full, scale=s)
        nisa.activation(dst=top, op=nl.copy, data=top, scale=s)
    else:
        nisa.activation(dst=full, op=nl.sigmoid, data=lg)
        nisa.activation(dst=top, op=nl.sigmoid, data=top_logits)
    # keep the picked experts: the top-k rounds left -inf exactly there
    nisa.scalar_tensor_tensor(dst=aff, data=picked, op0=nl.equal, operand0=_NEG, op1=nl.multiply,
                              operand1=full)
    return aff, top
