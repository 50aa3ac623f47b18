"""Transformers' MoE experts on neuron, charged as NKI-lib's MoE kernels.

Transformers runs the experts of its sparse MoE blocks (Mixtral, Qwen-MoE, OLMoE, ... every
class decorated with ``use_experts_implementation``) through one function taken from
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` at each call ("grouped_mm" by
default, "batched_mm", or the class's own "eager" loop). When Transformers is imported, each
of those entries is wrapped once: on neuron tensors the function runs exactly as before (the
same ATen ops, so results and gradients are CPU's), but its forward ops run unrecorded and the
call is charged as one launch of NKI-lib's MoE MLP at the call's shape: ``moe_tkg`` (decode,
the picked experts each loaded once) for at most 128 tokens, else ``moe_cte`` (blockwise
prefill) at the block size of 128 or 512 (when an expert's tokens fill one) that the model
finds faster. The router, which runs
before the experts, keeps its ops' costs; the backward keeps its ops' costs (NKI-lib has no MoE
backward kernel).

Routing changes every step while the cost is cached per shape, so the kernels are priced for
balanced routing: each expert gets ``ceil(tokens * top_k / experts)`` tokens. Large shapes are
simulated at fewer blocks, and at a hidden size of at most 2048 and an intermediate size of at
most 1024, then extrapolated: ``moe_cte`` by its marginal time per block (every block loads its
expert's weights and runs the same matmuls), both kernels by the ratio of weight elements.

A hidden size that is not a multiple of 128 is priced (and, executed, run) zero-padded to the
next one. Calls not covered keep their ops' costs, with a debug log on
``torch_neuronx.nkilib``: dtypes other than fp32/bf16/fp16, experts without
a gate or with a post-expert norm or their own gating function, expert parallelism, an
activation the kernels lack, and calls during graph capture or tracing (compiled graphs are
costed as the kernels Inductor makes of them).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

import nki
from nkilib.core.moe.moe_cte.blocks import routing_blocks
from nkilib.core.moe.moe_cte.moe_cte import moe_cte
from nkilib.core.moe.moe_tkg.moe_tkg import moe_tkg
from nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode

from .. import _C, _state, cost_model
from . import nkilib_routes as routes
from .norms import _device_tensor

log = routes.log

OP = "moe_experts"
# Transformers' activation names (config.hidden_act) -> the kernels' activation
_ACTS = {"silu": ActFnType.SiLU, "swish": ActFnType.SiLU, "gelu": ActFnType.GELU,
         "gelu_pytorch_tanh": ActFnType.GELU_Tanh_Approx, "gelu_new": ActFnType.GELU_Tanh_Approx}
_DECODE_TOKENS = 128
_SIM_H, _SIM_I = 2048, 1024
_BLOCK_SIZES = (128, 512)
_DEFAULT_GATE = None     # Transformers' gating, the kernels' (bound by install())


def moe_kernel_seconds(p, lnc, shapes, dtype, flags=0):
    """Modelled seconds (launch excluded) of NKI-lib's MoE MLP over ``shapes`` = (hidden
    [T, H], top-k index [T, k], gate_up weight [E, 2I, H]) in ``dtype`` on one physical core
    (the kernels run on one core; under LNC=2 the second idles). None when not covered
    (logged). ``flags``: the activation (an ``ActFnType`` value)."""
    if len(shapes) < 3 or len(shapes[0]) != 2 or len(shapes[1]) != 2 or len(shapes[2]) != 3:
        return routes._decline(OP, f"shapes {list(shapes)} are not hidden [T, H], top-k index "
                                   f"[T, k] and gate_up [E, 2I, H]")
    (T, H), (_, k), (E, I2, _) = shapes[:3]
    if dtype not in routes._DTYPES:
        return routes._decline(OP, f"dtype {dtype}")
    if T == 0 or k == 0 or E == 0 or H == 0 or I2 % 2:
        return routes._decline(OP, f"empty call or odd gate_up rows: {list(shapes)}")
    dt = torch.bfloat16 if dtype == torch.float16 else dtype
    return _moe_ns(p.name, T, _padded(H), I2 // 2, E, min(k, E), routes._DTYPES[dt],
                   ActFnType(flags)) * 1e-9


def _padded(H):
    """The kernels take H in whole partitions: a smaller multiple runs zero-padded (the
    weights padded once, as AWS's ``hidden_actual`` lets a caller of the fused block do)."""
    return -(-H // 128) * 128


cost_model.KERNEL_COSTS[OP] = moe_kernel_seconds


@functools.lru_cache(maxsize=256)
def _moe_ns(target, T, H, I, E, k, dtype, act):
    Hs, Is = min(H, _SIM_H), min(I, _SIM_I)
    weights = (H * I) / (Hs * Is)
    if T <= _DECODE_TOKENS:
        return _tkg_ns(target, T, Hs, Is, E, k, dtype, act) * weights
    per_expert = -(-T * k // E)
    best = None
    # a block of 512 pays for its padding slots: it can only win when an expert fills one
    for B in [b for b in _BLOCK_SIZES if b == _BLOCK_SIZES[0] or b <= per_expert]:
        N = E * -(-per_expert // B)
        if N <= 3:
            ns = _cte_ns(target, T, Hs, Is, B, N, dtype, act) * weights
        else:
            two = _cte_ns(target, T, Hs, Is, B, 2, dtype, act)
            block = _cte_ns(target, T, Hs, Is, B, 3, dtype, act) - two
            ns = (two - 2 * block) * H / Hs + N * block * weights
        best = ns if best is None else min(best, ns)
    return best


def _weights(E, H, I, dt, rng):
    wgu = (rng.standard_normal((E, H, 2, I), dtype=np.float32) / np.sqrt(H)).astype(dt)
    wd = (rng.standard_normal((E, I, H), dtype=np.float32) / np.sqrt(I)).astype(dt)
    return wgu, wd


def _tkg_ns(target, T, H, I, E, k, dtype, act):
    """``moe_tkg``, selective, POST_SCALE: token t picks experts t*k .. t*k+k-1 (mod E), so
    min(E, T*k) experts are loaded; only those are simulated."""
    used = min(E, T * k)
    rng = np.random.default_rng(0)
    dt = routes._np_dtype(dtype)
    x = rng.standard_normal((T, H), dtype=np.float32).astype(dt)
    wgu, wd = _weights(used, H, I, dt, rng)
    idx = ((np.arange(T)[:, None] * k + np.arange(k)[None, :]) % used).astype(np.int32)
    aff = np.zeros((T, used), np.float32)
    np.put_along_axis(aff, idx, 1.0 / k, axis=1)
    r = nki.benchmark(moe_tkg, target=target)(
        x, wgu, wd, aff.astype(dt), idx, False, activation_fn=act,
        expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE)
    return r.latency_ns


def _cte_ns(target, T, H, I, B, N, dtype, act):
    """``moe_cte`` over N full blocks of B tokens, block n for expert n, out of T tokens."""
    rng = np.random.default_rng(0)
    dt = routes._np_dtype(dtype)
    h = rng.standard_normal((T + 1, H), dtype=np.float32).astype(dt)
    h[T] = 0
    wgu, wd = _weights(N, H, I, dt, rng)
    pos = (np.arange(N * B) % T).astype(np.int32)
    aff = np.zeros((T + 1, N), np.float32)
    aff[pos, np.repeat(np.arange(N), B)] = 0.5
    b2e = np.arange(N, dtype=np.int32).reshape(N, 1)
    r = nki.benchmark(moe_cte, target=target)(
        h, aff.astype(dt).reshape(-1, 1), wgu, wd, pos, b2e, B, activation_function=act)
    return r.latency_ns


def _priced(experts, hidden, top_k_index):
    """(seconds, shapes, dtype, flags, flops, bytes) of the call as one NKI-lib MoE launch,
    or None when not covered (logged)."""
    if not (_device_tensor(hidden) and _device_tensor(top_k_index)):
        return None      # CPU, or a tracer's tensors: compiled graphs cost their kernels
    stream = torch.neuron.current_stream(hidden.device)
    if _C._is_capturing(stream.device_index, stream.stream_id):
        return routes._decline(OP, "graph capture (replays charge the ops)")
    if not getattr(experts, "has_gate", False) or getattr(experts, "has_post_expert_norm", False):
        return routes._decline(OP, "experts without a gate or with a post-expert norm")
    if getattr(type(experts), "_apply_gate", None) is not _DEFAULT_GATE:
        return routes._decline(OP, f"{type(experts).__name__} has its own gating function")
    if getattr(experts, "_is_expert_parallel", False):
        return routes._decline(OP, "expert parallelism")
    act = _ACTS.get(getattr(getattr(experts, "config", None), "hidden_act", None))
    if act is None:
        return routes._decline(OP, "an activation the kernels lack")
    weight = getattr(experts, "gate_up_proj", None)
    if (hidden.dim() != 2 or top_k_index.dim() != 2 or not isinstance(weight, torch.Tensor)
            or weight.dim() != 3):
        return routes._decline(OP, "not the 2-D hidden states and 3-D gate_up weight of "
                                   "Transformers' experts")
    E, H = weight.shape[0], hidden.shape[1]
    # [E, 2I, H], or [E, H, 2I] when transposed
    two_i = weight.shape[2] if getattr(experts, "is_transposed", False) else weight.shape[1]
    shapes = ((hidden.shape[0], H), tuple(top_k_index.shape), (E, two_i, H))
    dtype = cost_model.priced_dtype(hidden.dtype)
    cfg = _state.config()
    if moe_kernel_seconds(cfg.profile, cfg.lnc, shapes, dtype, act.value) is None:
        return None
    T, k, I = shapes[0][0], shapes[1][1], two_i // 2
    nbytes = (2 * T * H + 3 * min(E, T * k) * H * I) * dtype.itemsize
    seconds, _, _ = cost_model.op_seconds(cfg.profile, cfg.lnc, OP, list(shapes), dtype,
                                          nbytes - T * H * dtype.itemsize,
                                          T * H * dtype.itemsize, flags=act.value)
    return seconds, shapes, dtype, act.value, 6.0 * T * k * H * I, nbytes


def _wrap(impl):
    """``impl`` (an experts forward) charged as NKI-lib's kernel on neuron."""
    if getattr(impl, "_neuron_moe", False):
        return impl

    @functools.wraps(impl)
    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        priced = (None if torch.compiler.is_compiling() or args or kwargs
                  else _priced(self, hidden_states, top_k_index))
        if priced is None:
            return impl(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        seconds, shapes, dtype, flags, flops, nbytes = priced
        if routes.EXECUTE and hidden_states.dtype in (torch.float32, torch.bfloat16):
            return _Executed.apply(impl, self, ActFnType(flags), hidden_states, top_k_index,
                                   top_k_weights, self.gate_up_proj, self.down_proj)
        out_bytes = shapes[0][0] * shapes[0][1] * dtype.itemsize
        with routes.charged_as(hidden_states.device, OP, seconds, engine="tensor", flops=flops,
                               hbm_bytes=nbytes, shapes=shapes, dtype=dtype,
                               bytes_in=nbytes - out_bytes, bytes_out=out_bytes, flags=flags):
            return impl(self, hidden_states, top_k_index, top_k_weights)

    forward._neuron_moe = True
    return forward


class _Executed(torch.autograd.Function):
    """``TORCH_NEURONX_NKI_EXECUTE=1``: the forward is NKI-lib's kernel run in the simulator
    (charged its simulated time); the backward recomputes Transformers' function and
    differentiates it."""

    @staticmethod
    def forward(ctx, impl, experts, act, hidden, index, weights, gate_up, down):
        ctx.impl, ctx.experts = impl, experts
        ctx.save_for_backward(hidden, index, weights)
        return _run_kernel(experts, act, hidden, index, weights)

    @staticmethod
    def backward(ctx, grad):
        hidden, index, weights = ctx.saved_tensors
        ex = ctx.experts
        h, w = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
        wrt = [h, w, ex.gate_up_proj, ex.down_proj]
        with torch.enable_grad():
            out = ctx.impl(ex, h, index, w)
            got = torch.autograd.grad(out, wrt, grad, allow_unused=True)
        return (None, None, None, got[0], None, *got[1:])


def _run_kernel(experts, act, hidden, index, weights):
    """The experts' output [T, H] from ``moe_tkg`` (T <= 128) or ``moe_cte`` (blocks of 128,
    routing laid out on the host). Putting the weights and routing into AWS's layouts runs
    unrecorded: on the chip they would be stored that way."""
    prev = _C._set_op_records(False)
    try:
        args, kwargs = _kernel_args(experts, act, hidden, index, weights)
    finally:
        _C._set_op_records(prev)
    T, H = hidden.shape
    if T <= _DECODE_TOKENS:
        return moe_tkg(*args, **kwargs)[:, :H]
    return moe_cte(*args, **kwargs)[:T, :H]


def _kernel_args(experts, act, hidden, index, weights):
    T, H = hidden.shape
    E = experts.gate_up_proj.shape[0]
    gu, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if getattr(experts, "is_transposed", False):     # [E, H, 2I] and [E, I, H]
        gu, down = gu.transpose(1, 2), down.transpose(1, 2)
    I = gu.shape[1] // 2
    # Transformers: gate rows then up rows ([E, 2I, H]); AWS: [E, H, 2, I]
    wgu = gu.reshape(E, 2, I, H).permute(0, 3, 1, 2).contiguous()
    wd = down.transpose(1, 2).contiguous()                          # [E, I, H]
    if _padded(H) != H:            # zero rows of the gate/up, zero columns of the down
        pad = _padded(H) - H
        wgu = torch.nn.functional.pad(wgu, (0, 0, 0, 0, 0, pad))
        wd = torch.nn.functional.pad(wd, (0, pad))
        hidden = torch.nn.functional.pad(hidden, (0, pad))
        H += pad
    dev = hidden.device
    dense = torch.zeros(T, E, dtype=hidden.dtype, device=dev)
    dense.scatter_(1, index, weights.to(hidden.dtype))
    kwargs = dict(expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE)
    if T <= _DECODE_TOKENS:
        kwargs["activation_fn"] = act
        return (hidden.contiguous(), wgu, wd, dense, index.to(torch.int32), False), kwargs
    B = _BLOCK_SIZES[0]
    pos, b2e = routing_blocks(index.cpu().numpy(), E, B)
    h1 = torch.cat([hidden, torch.zeros(1, H, dtype=hidden.dtype, device=dev)])
    aff = torch.cat([dense, torch.zeros(1, E, dtype=dense.dtype, device=dev)]).reshape(-1, 1)
    kwargs["activation_function"] = act
    return (h1, aff, wgu, wd, torch.from_numpy(pos).to(dev), torch.from_numpy(b2e).to(dev),
            B), kwargs


def _eager(self, *args, **kwargs):
    """The class's own experts loop (Transformers' "eager" implementation)."""
    return type(self).forward.__wrapped__(self, *args, **kwargs)


def install(moe_module) -> None:
    """Wrap the experts functions of ``transformers.integrations.moe`` (called when it is
    imported). A Transformers without the experts interface (before 5.x's) has nothing to
    wrap: its MoE blocks keep their ops' costs."""
    interface = getattr(moe_module, "ExpertsInterface", None)
    if (interface is None or not isinstance(getattr(interface, "_global_mapping", None), dict)
            or not hasattr(moe_module, "_default_apply_gate")):
        log.debug("moe_experts: this Transformers has no experts interface; MoE blocks keep "
                  "their ops' costs")
        return
    global _DEFAULT_GATE
    _DEFAULT_GATE = moe_module._default_apply_gate
    for name in ("grouped_mm", "batched_mm"):
        if name in interface._global_mapping:
            interface.register(name, _wrap(interface._global_mapping[name]))
    interface.register("eager", _wrap(_eager))
