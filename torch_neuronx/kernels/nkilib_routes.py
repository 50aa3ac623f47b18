"""PyTorch ops routed to NKI-lib kernels on neuron.

``scaled_dot_product_attention`` on 4-D neuron tensors reaches CPU's flash-attention op
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward), eagerly and from
compiled graphs, where the host runs it at CPU speed with CPU's numerics. Its modelled time
is that of NKI-lib's FlashAttention kernels (``nkilib.core.attention.attention_cte`` and
``attention_bwd``; ``attention_tkg`` for decode-shaped calls of at most 8 queries against
at least 128 keys) at the call's shape: one launch over up to 16 of the call's query heads
(pipelined together, as the kernel runs them) is simulated as ``kernel[lnc]`` (spread over
the logical core's physical cores as the kernel spreads its work) on the target chip once
per (chip, shape, dtype, causal, heads simulated, lnc) and cached; a call costs that
launch's latency per head times its heads.
Calls the kernels do not cover (an explicit mask, dropout, head dim > 128, a backward whose
query length is not a multiple of 128, dtypes other than fp32/bf16/fp16) keep the
roofline cost, and the logger ``torch_neuronx.nkilib`` says why at debug level.

``native_layer_norm`` and ``rms_norm`` (charged by ``kernels.norms``) are priced the same
way as NKI-lib's ``layernorm_tkg`` / ``rmsnorm_tkg`` at the call's shape on ``kernel[lnc]``.
``charged_as`` is the scope a Python kernel uses to charge the ATen ops it runs as one
NKI-lib kernel (FlexAttention, ``rms_norm``).

``TORCH_NEURONX_NKI_EXECUTE=1`` (read at import) executes the kernels themselves in the
simulator instead of CPU's op, for validation: results then come from NKI-lib.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os

import numpy as np
import torch

import nki
from nkilib.core.attention.attention_bwd import attention_bwd
from nkilib.core.attention.attention_cte import attention_cte
from nkilib.core.attention.attention_tkg import attention_tkg
from nkilib.core.moe.moe_cte.grouped_mm import grouped_mm
from nkilib.core.subkernels.layernorm_tkg import layernorm_tkg
from nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg

from .. import _C, cost_model

log = logging.getLogger("torch_neuronx.nkilib")

EXECUTE = os.environ.get("TORCH_NEURONX_NKI_EXECUTE", "0") == "1"
# Scores simulated per head at most; longer sequences are simulated at a shorter length
# and the time scaled by the ratio of score blocks (the kernels' work is quadratic).
_SIM_SCORES = 2048 * 2048
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FWD = "_scaled_dot_product_flash_attention_for_cpu"
BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _decline(op, why):
    log.debug("%s: not routed to NKI-lib (%s); charged by the roofline", op, why)
    return None


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


# Heads simulated together at most: a call's heads run in one kernel launch, pipelined, so
# for short sequences one head's latency overlaps the others' work.
_SIM_HEADS = 16


def sim_heads(heads: int, sq: int, skv: int) -> int:
    """How many of a call's heads the cost simulation runs in one launch."""
    return max(1, min(_SIM_HEADS, heads, _SIM_SCORES // max(1, sq * skv)))


def head_latency_ns(target: str, kind: str, sq: int, skv: int, d: int, dtype: str,
                    causal: bool, heads: int = 1, lnc: int = 1) -> float:
    """Modelled latency per query head of the NKI-lib kernel launched as ``kernel[lnc]``
    over ``heads`` heads (simulated together up to ``sim_heads``)."""
    n = sim_heads(heads, sq, skv)
    return _latency_ns(target, kind, sq, skv, d, dtype, causal, n, max(1, lnc)) / n


@functools.lru_cache(maxsize=512)
def _latency_ns(target, kind, sq, skv, d, dtype, causal, n, lnc):
    """Modelled latency of one launch of ``kernel[lnc]`` over n query heads."""
    f = 1.0
    while sq * skv / (f * f) > _SIM_SCORES:
        f *= 2
    s_q = max(128, int(sq / f) // 128 * 128) if kind == "bwd" else max(1, int(sq / f))
    s_kv = max(1, int(skv / f))
    ratio = (sq * skv) / (s_q * s_kv)
    rng = np.random.default_rng(0)
    dt = _np_dtype(dtype)

    def rand(*shape):
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(dt)
    scale = 1.0 / math.sqrt(d)
    if kind == "fwd":
        # the statistics stored too: the op returns its log-sum-exp, for the backward
        r = nki.benchmark(on_cores(attention_cte, lnc), target=target)(
            rand(n, s_q, d), rand(n, d, s_kv), rand(n, s_kv, d), scale=scale, causal_mask=causal,
            cache_softmax=True)
    else:
        lse = np.zeros((1, n, 128, s_q // 128), np.float32)
        r = nki.benchmark(on_cores(attention_bwd, lnc), target=target)(
            rand(1, n, d, s_q), rand(1, n, d, s_kv), rand(1, n, d, s_kv), rand(1, n, d, s_q),
            rand(1, n, d, s_q), lse, use_causal_mask=causal, softmax_scale=scale)
    return r.latency_ns * ratio


def _attention_seconds(op, kind, p, lnc, shapes, dtype, flags):
    if len(shapes) < 3 or any(len(s) != 4 for s in shapes[:3]):
        return _decline(op, f"shapes {shapes} are not 4-D")
    q, k = (shapes[1], shapes[2]) if kind == "bwd" else (shapes[0], shapes[1])
    B, H, sq, d = q
    skv = k[2]
    if flags & 2:
        return _decline(op, "an explicit attention mask")
    if flags & 4:
        return _decline(op, "dropout")
    if d > 128:
        return _decline(op, f"head dim {d} > 128")
    if dtype not in _DTYPES:
        return _decline(op, f"dtype {dtype}")
    if kind == "bwd" and sq % 128:
        return _decline(op, f"query length {sq} is not a multiple of 128 (attention_bwd's "
                            f"log-sum-exp layout)")
    Hkv = k[1]
    if kind == "fwd" and _decode_shape(H, Hkv, sq, skv):
        ns = decode_latency_ns(p.name, H, Hkv, sq, skv, d, _DTYPES[dtype])
        return ns * 1e-9 * B / max(1, lnc)
    ns = head_latency_ns(p.name, kind, sq, skv, d, _DTYPES[dtype], bool(flags & 1), B * H, lnc)
    return ns * 1e-9 * B * H


def _decode_shape(H, Hkv, sq, skv) -> bool:
    """A call shaped like decoding (a few queries against a long cache) that attention_tkg
    covers: its time is the decode kernel's, bound by reading the cache."""
    return sq <= 8 and skv >= 128 and Hkv and H % Hkv == 0 and (H // Hkv) * sq <= 128


@functools.lru_cache(maxsize=256)
def decode_latency_ns(target, H, Hkv, sq, skv, d, dtype):
    """Modelled latency of NKI-lib's ``attention_tkg`` for one sequence: H query heads, sq
    new tokens, a contiguous cache of skv tokens (the new ones included) over Hkv kv heads."""
    s = min(skv, 32768)
    rng = np.random.default_rng(0)
    dt = _np_dtype(dtype)

    def rand(*shape):
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(dt)
    r = nki.benchmark(attention_tkg, target=target)(
        rand(1, d, H, sq), None, None, rand(1, Hkv, d, s), rand(1, Hkv, s, d),
        scale=1.0 / math.sqrt(d))
    return r.latency_ns * skv / s


def _fwd_seconds(p, lnc, shapes, dtype, flags):
    return _attention_seconds(FWD, "fwd", p, lnc, shapes, dtype, flags)


def _bwd_seconds(p, lnc, shapes, dtype, flags):
    return _attention_seconds(BWD, "bwd", p, lnc, shapes, dtype, flags)


cost_model.KERNEL_COSTS[FWD] = _fwd_seconds
cost_model.KERNEL_COSTS[BWD] = _bwd_seconds


def grouped_mm_seconds(a_shape, b_shape, dtype, offs):
    """(modelled seconds, flops) of one ``torch._grouped_mm`` kernel launch: NKI-lib's
    ``grouped_mm`` for the 2-D x 3-D form (MoE experts; groups taken as equal, since the
    cost is cached per shape while routing changes every step), the TensorE roofline for
    the other forms."""
    from .. import _state
    cfg = _state.config()
    key = (a_shape, b_shape, dtype, id(cfg.profile), cfg.lnc)
    hit = _GROUPED_MM_COSTS.get(key)
    if hit is not None and hit[0] is cfg.profile:
        return hit[1]
    if len(_GROUPED_MM_COSTS) >= 1024:
        _GROUPED_MM_COSTS.clear()
    cost = _grouped_mm_seconds(cfg, a_shape, b_shape, dtype)
    _GROUPED_MM_COSTS[key] = (cfg.profile, cost)
    return cost


# (profile, cost) by shapes, dtype, profile and LNC: a MoE layer prices the same few calls
# every step
_GROUPED_MM_COSTS: dict = {}


def _grouped_mm_seconds(cfg, a_shape, b_shape, dtype):
    nbytes = dtype.itemsize * (math.prod(a_shape) + math.prod(b_shape))
    seconds, _, flops = cost_model.op_seconds(cfg.profile, cfg.lnc, "_grouped_mm",
                                              [a_shape, b_shape], dtype, nbytes, 0)
    if len(a_shape) != 2 or len(b_shape) != 3:
        return seconds, flops
    if dtype not in _DTYPES:
        _decline("_grouped_mm", f"dtype {dtype}")
        return seconds, flops
    (M, K), (G, _, N) = a_shape, b_shape
    # NKI-lib's grouped_mm takes fp32 and bf16; fp16 has bf16's width and TensorE rate
    ns = _grouped_mm_ns(cfg.profile.name, M, K, N, G, _DTYPES[torch.bfloat16 if dtype == torch.float16 else dtype])
    return cfg.profile.launch_overhead_ns * 1e-9 + ns * 1e-9 / max(1, cfg.lnc), flops


# Rows x columns simulated at most; more are scaled linearly (the kernel's work is).
_SIM_ROWS, _SIM_COLS = 2048, 2048


@functools.lru_cache(maxsize=256)
def _grouped_mm_ns(target, M, K, N, G, dtype):
    m, n = min(M, _SIM_ROWS), min(N, _SIM_COLS)
    g = max(1, min(G, m))
    rng = np.random.default_rng(0)
    dt = _np_dtype(dtype)
    a = (0.1 * rng.standard_normal((m, K), dtype=np.float32)).astype(dt)
    b = (0.1 * rng.standard_normal((g, K, n), dtype=np.float32)).astype(dt)
    offs = ((np.arange(1, g + 1) * m) // g).astype(np.int32)
    r = nki.benchmark(grouped_mm, target=target)(a, b, offs)
    return r.latency_ns * (M / m) * (N / n)


def flex_seconds(kind, B, H, sq, skv, d, dtype, fraction):
    """(modelled seconds, flops) of a FlexAttention call (``kind`` "fwd" or "bwd") as
    NKI-lib's kernel skipping the key blocks the block mask leaves out: the full kernel's
    time at the shape times the fraction of (query block, key block) pairs visited; or
    None when the kernel does not cover the call."""
    from .. import _state
    cfg = _state.config()
    op = f"flex_attention ({kind})"
    if d > 128:
        return _decline(op, f"head dim {d} > 128")
    if dtype not in _DTYPES:
        return _decline(op, f"dtype {dtype}")
    if kind == "bwd" and sq % 128:
        return _decline(op, f"query length {sq} is not a multiple of 128")
    ns = head_latency_ns(cfg.profile.name, kind, sq, skv, d, _DTYPES[dtype], False,
                         B * H, cfg.lnc) * fraction
    flops = (4.0 if kind == "fwd" else 8.0) * B * H * sq * skv * d * fraction
    return cfg.profile.launch_overhead_ns * 1e-9 + ns * 1e-9 * B * H, flops


@contextlib.contextmanager
def charged_as(device, name, seconds, *, engine, flops=0.0, hbm_bytes=0, **priced):
    """Runs the body's device ops unrecorded and charges ``seconds`` under ``name`` instead:
    the host computes a call with ATen's ops while its modelled time is an NKI-lib kernel's.
    Adaptive Eager keeps the body's ops apart from the ops around it in the cost records:
    each op knows whether it was recorded, and a window changes between recorded and
    unrecorded ops only where one recorded op leads the body (a residual add before a norm),
    which the host then runs fused with the body while the op keeps its own charge, as on
    the chip, where the kernel is a launch of its own. ``priced``: the shapes, dtype and
    bytes ``seconds`` was priced from (``cost_model.op_seconds``), kept in the charge so a
    what-if can re-price it. Scopes nest: only the outermost charges (the cost model adds
    nothing on a thread whose op records are off)."""
    idx = device.index if device.index is not None else torch.neuron.current_device()
    prev = _C._set_op_records(False)
    try:
        yield
    finally:
        _C._set_op_records(prev)
    cost_model._add_time(idx, name, seconds, engine=engine, flops=flops, hbm_bytes=hbm_bytes,
                         **priced)


# Elements simulated at most per norm launch; more rows are extrapolated at the marginal
# time per row (the norm kernels stream row tiles, so their time is linear in rows).
_SIM_NORM_ELEMS = 2048 * 4096
NORM_KERNELS = {"rms_norm": rmsnorm_tkg, "native_layer_norm": layernorm_tkg}


def norm_kernel_seconds(op, p, lnc, shapes, dtype, flags=0):
    """Modelled seconds (launch excluded) of one launch of NKI-lib's norm kernel on
    ``kernel[lnc]``: ``rmsnorm_tkg`` for "rms_norm", ``layernorm_tkg`` for
    "native_layer_norm" (with a beta when the call has both weight and bias). ``shapes``:
    the input's, then the weight's or bias's (the normalised trailing dims), as the runtime
    records ``native_layer_norm``. None when the kernel does not cover the call (logged)."""
    if len(shapes) < 2:
        return _decline(op, "no weight or bias, so the record does not give the normalised "
                            "shape")
    if dtype not in _DTYPES:
        return _decline(op, f"dtype {dtype}")
    H, n = math.prod(shapes[1]), math.prod(shapes[0])
    if H == 0 or n == 0:
        return _decline(op, f"empty input of shape {tuple(shapes[0])}")
    if n % H or tuple(shapes[0][len(shapes[0]) - len(shapes[1]):]) != tuple(shapes[1]):
        return _decline(op, f"normalised shape {tuple(shapes[1])} is not the trailing dims of "
                            f"{tuple(shapes[0])}")
    beta = op == "native_layer_norm" and len(shapes) > 2
    return _norm_ns(p.name, op, n // H, H, _DTYPES[dtype], beta, max(1, lnc)) * 1e-9


for _op in NORM_KERNELS:
    cost_model.KERNEL_COSTS[_op] = functools.partial(norm_kernel_seconds, _op)


@functools.lru_cache(maxsize=512)
def _norm_ns(target, op, rows, H, dtype, beta, lnc):
    r = min(rows, max(1, _SIM_NORM_ELEMS // H))
    if r == rows:
        return norm_kernel_ns(target, op, rows, H, dtype, beta, lnc)
    if r < 256:     # few rows fit: scale by rows
        return norm_kernel_ns(target, op, r, H, dtype, beta, lnc) * rows / r
    r -= r % 128
    full = norm_kernel_ns(target, op, r, H, dtype, beta, lnc)
    half = norm_kernel_ns(target, op, r // 2, H, dtype, beta, lnc)
    return full + (rows - r) * (full - half) / (r - r // 2)


def norm_kernel_ns(target, op, rows, H, dtype, beta, lnc):
    """Simulated latency of NKI-lib's norm kernel over [rows, H] on ``kernel[lnc]``."""
    rng = np.random.default_rng(0)
    dt = _np_dtype(dtype)
    x = rng.standard_normal((rows, H), dtype=np.float32).astype(dt)
    g = np.ones((1, H), dt)
    kernel = NORM_KERNELS[op]
    kw = {"beta": np.zeros((1, H), dt)} if beta else {}
    r = nki.benchmark(on_cores(kernel, lnc), target=target)(x, g, eps=1e-6, **kw)
    return r.latency_ns


# ----------------------------------------------------------------------- execution mode
def _on_cpu(op, *args, **kwargs):
    """CPU's kernel for a call the NKI-lib kernels do not cover (execution mode only)."""
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    conv = [(_C._cpu_alias(a) if isinstance(a, torch.Tensor) and a.device.type == "neuron" else a)
            for a in args]
    kw = {k: (_C._cpu_alias(v) if isinstance(v, torch.Tensor) and v.device.type == "neuron" else v)
          for k, v in kwargs.items()}
    out = op(*conv, **kw)
    return tuple(o.to(dev) if isinstance(o, torch.Tensor) else o for o in out)


def on_cores(kernel, lnc=None):
    """``kernel`` launched over the logical core's physical cores (``kernel[lnc]``, the
    current device's when ``lnc`` is None), as the cost routes price it: a kernel run in
    execution mode is charged what the route charges for the same call."""
    if lnc is None:
        from .. import _state
        lnc = _state.config().lnc
    return kernel[lnc] if lnc > 1 else kernel


def _execute_fwd(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    B, H, sq, d = query.shape
    Hkv, skv = key.shape[1], key.shape[2]
    if attn_mask is not None or dropout_p > 0 or d > 128 or H % Hkv or query.dtype not in _DTYPES:
        _decline(FWD, "mask, dropout, head dim or dtype")
        return _on_cpu(op, query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    q = query.reshape(B * H, sq, d).contiguous()
    k = key.transpose(-1, -2).reshape(B * Hkv, d, skv).contiguous()
    v = value.reshape(B * Hkv, skv, d).contiguous()
    out, neg_max, sum_recip = on_cores(attention_cte)(q, k, v, scale=sc,
                                                      causal_mask=bool(is_causal),
                                                      cache_softmax=True)
    lse = -(neg_max + torch.log(sum_recip))             # (B*H, 128, G)
    lse = lse.transpose(1, 2).reshape(B * H, -1)[:, :sq].reshape(B, H, sq)
    return out.reshape(B, H, sq, d), lse.contiguous()


def _execute_bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                 attn_mask=None, scale=None):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    B, H, sq, d = query.shape
    Hkv, skv = key.shape[1], key.shape[2]
    if attn_mask is not None or dropout_p > 0 or d > 128 or sq % 128 or query.dtype not in _DTYPES:
        _decline(BWD, "mask, dropout, head dim, query length or dtype")
        return _on_cpu(op, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                       attn_mask=attn_mask, scale=scale)

    def t(x):
        return x.transpose(-1, -2).contiguous()
    lse = logsumexp.reshape(B, H, sq // 128, 128).transpose(-1, -2).contiguous()
    dq, dk, dv = on_cores(attention_bwd)(t(query), t(key), t(value), t(out), t(grad_out), lse,
                                         use_causal_mask=bool(is_causal), softmax_scale=scale)
    return t(dq), t(dk), t(dv)


if EXECUTE:
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl(FWD, _execute_fwd, "PrivateUse1")
    _lib.impl(BWD, _execute_bwd, "PrivateUse1")
