"""The MoE block for token generation in one kernel: AWS's ``moe_block_tkg``.

RMSNorm, the router (logits, softmax or sigmoid, top-k) and the expert MLPs of ``moe_tkg``,
on up to 128 tokens, with nothing between the stages leaving the chip: the normalised tokens
stay in SBUF, transposed once for both the router's and the experts' matmuls, and the
router's picks and affinities feed the experts' selection where they were computed. Called as
three kernels the same work writes the normalised tokens and the routing to HBM and reads
them back, and every kernel starts on an empty pipeline.

Layouts are AWS's: inp [B, S, H] (or [T, H]), gamma [1, H], router_weights [H, E],
expert_gate_up_weights [E_L, H, 2, I], expert_down_weights [E_L, I, H], router_bias [1, E],
expert biases [E_L, 2, I] and [E_L, H]. Returns ``(out,)`` or, unless
``skip_router_logits``, ``(out, router_logits)``: out [T, H] and router_logits [T, E] in
inp's dtype.

Selective mode (``is_all_expert=False``, E_L = E) runs the experts some token picked; all-
expert mode runs local experts E_L * rank_id ... E_L * (rank_id + 1) - 1 for every token, its
weight DMAs free to start while the norm and router compute. POST_SCALE weighs an expert's
output by the token's affinity where the token picked it and by 0 elsewhere; NO_SCALE adds
the picked experts' outputs (all local experts', in all-expert mode, as ``moe_tkg``).

Implemented: bf16/fp16/fp32, H a multiple of 128, T <= 128, E <= 512, both router
activations and pre-norm orders, ``norm_topk_prob``, ``router_mm_dtype``, ``hidden_actual``,
biases, clamps. Shared experts, quantized weights, the fused residual, the transposed I/O
layouts and the activation's scale/bias placeholders raise ``UnsupportedError`` (AWS refuses
the last two too). Under an LNC=2 grid (``moe_block_tkg[2]``, AWS's configuration) the first
core does all the work and the second idles: the result is right, the modelled time one
core's.
"""
from __future__ import annotations

import math

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..moe.moe_tkg.moe_tkg import (alloc_rings, config, run_experts, store, transpose_hidden,
                                    used_experts)
from ..router_topk.router_topk import router_act, tile_stages
from ..utils.refuse import refuse_given, unsupported
from ..utils.common_types import (ActFnType, ExpertAffinityScaleMode, MoEBlockIOLayout,
                                  RouterActFnType)

_P = 128
_E_MAX = 512


@nki.jit
def moe_block_tkg(inp, gamma, router_weights, expert_gate_up_weights, expert_down_weights,
                  shared_expert_gate_w=None, shared_expert_up_w=None, shared_expert_down_w=None,
                  expert_gate_up_weights_scale=None, expert_down_weights_scale=None,
                  router_bias=None, expert_gate_up_bias=None, expert_down_bias=None,
                  shared_expert_gate_bias=None, shared_expert_up_bias=None,
                  shared_expert_down_bias=None, eps=1e-6, top_k=1,
                  router_act_fn=RouterActFnType.SIGMOID, router_pre_norm=True,
                  norm_topk_prob=False,
                  expert_affinities_scaling_mode=ExpertAffinityScaleMode.NO_SCALE,
                  hidden_act_fn=ActFnType.SiLU, hidden_act_scale_factor=None,
                  hidden_act_bias=None, gate_clamp_upper_limit=None, gate_clamp_lower_limit=None,
                  up_clamp_upper_limit=None, up_clamp_lower_limit=None,
                  router_mm_dtype=nl.bfloat16, hidden_actual=None, skip_router_logits=False,
                  is_all_expert=False, rank_id=None, residual=None,
                  expert_gate_up_input_scale=None, expert_down_input_scale=None,
                  is_all_expert_dynamic=False, block_size=None,
                  inp_layout=MoEBlockIOLayout.B_S_H, outp_layout=MoEBlockIOLayout.B_S_H):
    refuse_given("moe_block_tkg", (
        ("shared experts (shared_expert_gate_w)", shared_expert_gate_w),
        ("shared experts (shared_expert_up_w)", shared_expert_up_w),
        ("shared experts (shared_expert_down_w)", shared_expert_down_w),
        ("quantized weights (expert_gate_up_weights_scale)", expert_gate_up_weights_scale),
        ("quantized weights (expert_down_weights_scale)", expert_down_weights_scale),
        ("static quantization (expert_gate_up_input_scale)", expert_gate_up_input_scale),
        ("static quantization (expert_down_input_scale)", expert_down_input_scale),
        ("the fused residual add (residual)", residual)))
    if hidden_act_scale_factor is not None or hidden_act_bias is not None:
        raise E.NkiRuleError("moe_block_tkg: hidden_act_scale_factor and hidden_act_bias are "
                             "placeholders and must be None")
    for nm, lay in (("inp_layout", inp_layout), ("outp_layout", outp_layout)):
        if getattr(lay, "name", lay) not in ("B_S_H", 0):
            unsupported("moe_block_tkg", f"{nm}={lay}")
    if is_all_expert_dynamic and not is_all_expert:
        raise E.NkiRuleError("moe_block_tkg: is_all_expert_dynamic is only valid with "
                             "is_all_expert=True")
    if inp.ndim not in (2, 3):
        raise E.ShapeMismatchError(f"moe_block_tkg: inp {tuple(inp.shape)} must be [B, S, H] or "
                                   f"[T, H]")
    H = inp.shape[-1]
    T = math.prod(inp.shape[:-1])
    c = config(inp.dtype, T, H, expert_gate_up_weights, expert_down_weights,
               expert_gate_up_bias, expert_down_bias, expert_affinities_scaling_mode,
               hidden_act_fn, (gate_clamp_lower_limit, gate_clamp_upper_limit),
               (up_clamp_lower_limit, up_clamp_upper_limit))
    if router_weights.ndim != 2 or router_weights.shape[0] != H:
        raise E.ShapeMismatchError(f"moe_block_tkg: router_weights {tuple(router_weights.shape)} "
                                   f"must be [H={H}, E]")
    n_exp = router_weights.shape[1]
    if not 1 <= n_exp <= _E_MAX:
        raise E.ShapeMismatchError(f"moe_block_tkg: E={n_exp} experts must be in [1, {_E_MAX}]")
    if not 1 <= top_k <= n_exp:
        raise E.ShapeMismatchError(f"moe_block_tkg: top_k must be in [1, {n_exp}], got {top_k}")
    if gamma.size != H:
        raise E.ShapeMismatchError(f"moe_block_tkg: gamma {tuple(gamma.shape)} must be [1, {H}]")
    if router_bias is not None and router_bias.size != n_exp:
        raise E.ShapeMismatchError(f"moe_block_tkg: router_bias {tuple(router_bias.shape)} must "
                                   f"be [1, {n_exp}]")
    if hidden_actual is not None and not 0 < hidden_actual <= H:
        raise E.ShapeMismatchError(f"moe_block_tkg: hidden_actual {hidden_actual} must be in "
                                   f"(0, {H}]")
    if not is_all_expert and c.E != n_exp:
        raise E.ShapeMismatchError(f"moe_block_tkg: selective mode needs every expert's weights: "
                                   f"{c.E} in expert_gate_up_weights, {n_exp} in router_weights")
    out = nl.ndarray((T, H), dtype=inp.dtype, buffer=nl.shared_hbm)
    logits = None if skip_router_logits else nl.ndarray((T, n_exp), dtype=inp.dtype,
                                                        buffer=nl.shared_hbm)
    outs = (out,) if logits is None else (out, logits)
    if nl.program_id(0) > 0:
        return outs

    base = 0
    if is_all_expert:
        if rank_id is None:
            raise E.NkiRuleError("moe_block_tkg: rank_id is required when is_all_expert=True")
        rk = nl.ndarray((1, 1), dtype=rank_id.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rk, src=rank_id.reshape((1, 1)))
        reg = nisa.register_alloc(0)
        nisa.register_load(reg, rk)
        base = c.E * int(reg)
        if base + c.E > n_exp:
            raise E.ShapeMismatchError(f"moe_block_tkg: rank_id {int(reg)} selects experts "
                                       f"[{base}, {base + c.E}) of {n_exp}")

    xT = _rmsnorm_T(c, inp.reshape((T, H)), gamma, eps, hidden_actual)
    rc = _router(c, xT, router_weights, router_bias, n_exp, top_k, router_act_fn,
                 router_pre_norm, norm_topk_prob, router_mm_dtype, logits)
    alloc_rings(c)
    sel = nl.ndarray((T, c.E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sel, data=rc.sb.picked[:, base:base + c.E], op0=nl.equal,
                       operand0=float("-inf"))
    wsel = sel
    if c.scale:
        wsel = nl.ndarray((T, c.E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=wsel, data1=sel, data2=rc.sb.aff[:, base:base + c.E],
                           op=nl.multiply)
    elif is_all_expert:
        wsel = None
    experts = list(range(c.E)) if is_all_expert else used_experts(c, sel)
    acc = run_experts(c, xT, wsel, experts)
    store(acc, out)
    return outs


def _rmsnorm_T(c, x_hbm, gamma, eps, hidden_actual):
    """x * rsqrt(mean(x^2) + eps) * gamma, computed transposed: xT [128, H/128, T] comes from
    TensorE anyway, and with H on partitions every elementwise pass is H/128 * T elements per
    partition instead of H (T of the 128 partitions busy). A token's sum of squares crosses
    the partitions in a matmul against ones, which also puts it on every partition; the mean
    is over ``hidden_actual`` columns when H is padded. Returns the normalised xT."""
    T, kh = c.T, c.kh
    n = float(hidden_actual or c.H)
    x = nl.ndarray((T, c.H), dtype=c.dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=x_hbm)
    # gamma at [p, k] (row p * kh + k, as xT), times sqrt(n): rsqrt(ss / n + eps) is
    # sqrt(n) * rsqrt(ss + n * eps). Off the critical path: it waits only for its DMA.
    g = nl.ndarray((_P, kh), dtype=nl.float32, buffer=nl.sbuf)
    gl = nl.ndarray((_P, kh), dtype=gamma.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=gl, src=gamma.reshape((_P, kh)))
    nisa.tensor_scalar(dst=g, data=gl, op0=nl.multiply, operand0=math.sqrt(n),
                       engine=nisa.gpsimd_engine)
    ones = nl.ndarray((_P, _P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0, engine=nisa.gpsimd_engine)
    xT = transpose_hidden(c, x)
    del x
    t = nl.ndarray((_P, kh, T), dtype=nl.float32, buffer=nl.sbuf)    # squares, then x * gamma
    nisa.tensor_tensor(dst=t, data1=xT, data2=xT, op=nl.multiply)
    part = nl.ndarray((_P, T), dtype=nl.float32, buffer=nl.sbuf)     # over k, per partition
    nisa.tensor_reduce(dst=part, op=nl.add, data=t.ap(pattern=[[kh * T, _P], [1, T], [T, kh]]),
                       axis=2)
    ss = nl.ndarray((_P, T), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ss, stationary=ones, moving=part)
    nisa.tensor_tensor(dst=t, data1=xT, data2=g.ap(pattern=[[kh, _P], [1, kh], [0, T]]),
                       op=nl.multiply)
    rstd = nl.ndarray((_P, T), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=ss, op0=nl.add, operand0=n * float(eps), op1=nl.power,
                       operand1=-0.5)
    xn = nl.ndarray((_P, kh, T), dtype=c.dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=xn, data1=t, data2=rstd.ap(pattern=[[T, _P], [0, kh], [1, T]]),
                       op=nl.multiply)
    return xn


def _router(c, xT, w, w_bias, n_exp, k, act_fn, pre_norm, norm_topk_prob, mm_dtype, logits):
    """The router on the normalised tokens already in SBUF (router_topk's tile, fed xT): its
    weights in xT's row order, matmuls in ``router_mm_dtype``."""
    mm = nl.as_dtype(mm_dtype)
    kh = c.kh
    wl = nl.ndarray((_P, kh, n_exp), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=wl, src=w.reshape((_P, kh, n_exp)))     # row p * kh + k, as xT
    if wl.dtype != mm:
        wm = nl.ndarray((_P, kh, n_exp), dtype=mm, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wm, src=wl)
        wl = wm
    if xT.dtype != mm:
        xm = nl.ndarray(tuple(xT.shape), dtype=mm, buffer=nl.sbuf)
        nisa.tensor_copy(dst=xm, src=xT)
        xT = xm
    rc = _Cfg(T=c.T, H=c.H, E=n_exp, k=k, act=router_act(act_fn), pre=pre_norm,
              norm=pre_norm and norm_topk_prob, logits=logits, index=None, affin=None,
              eager=None, aff_dtype=nl.float32, store_logits=logits is not None,
              store_index=False, w=wl, bias=None)
    if w_bias is not None:
        rc.bias = nl.ndarray((1, n_exp), dtype=mm, buffer=nl.sbuf)
        b = nl.ndarray((1, n_exp), dtype=w_bias.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b, src=w_bias.reshape((1, n_exp)))
        nisa.tensor_copy(dst=rc.bias, src=b)
        rc.ones = nl.ndarray((1, _P), dtype=mm, buffer=nl.sbuf)
        nisa.memset(dst=rc.ones, value=1.0, engine=nisa.gpsimd_engine)
    for _ in tile_stages(rc, 0, c.T, xT=xT):
        pass
    return rc
