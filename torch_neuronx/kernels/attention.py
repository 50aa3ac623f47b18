"""Fused attention entry points off the CPU: PyTorch's PrivateUse1 SDPA entry and CUDA's
FlashAttention, memory-efficient and cuDNN ones, which code written for CUDA reaches.

``_scaled_dot_product_fused_attention_overrideable`` is the entry PyTorch reserves for a
PrivateUse1 backend's fused SDPA; the others are CUDA's. All run CPU's flash-attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``: blocked, online softmax, the log-sum-exp
kept for the backward), so results equal CPU's SDPA. ``F.scaled_dot_product_attention`` on
neuron takes CPU's path, unless a program allows only the efficient or cuDNN kernels
(docs/device.md). Dropout: CPU's kernel has none, so ``dropout_p > 0`` is refused here;
``F.scaled_dot_product_attention`` with dropout takes the math path on neuron.
"""
from __future__ import annotations

import torch
from torch._meta_registrations import alloc_with_matching_layout

_lib = torch.library.Library("aten", "IMPL")


def _no_dropout(op, dropout_p):
    if dropout_p > 0:
        raise NotImplementedError(
            f"aten::{op} on neuron runs CPU's flash-attention kernel, which has no dropout "
            f"(dropout_p={dropout_p}); call torch.nn.functional.scaled_dot_product_attention, "
            "which takes the math path for dropout")


def _empty(like):
    return torch.empty(0, dtype=torch.int64, device=like.device)


def _flash_outputs(q, k, v, attn_mask, is_causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    return out, lse, _empty(q), _empty(q), q.shape[-2], k.shape[-2], _empty(q), _empty(q), _empty(q)


def _overrideable(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
                  return_debug_mask=False, *, scale=None):
    _no_dropout("_scaled_dot_product_fused_attention_overrideable", dropout_p)
    return _flash_outputs(query, key, value, attn_bias, is_causal, scale)


def _overrideable_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out,
                           logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           philox_seed, philox_offset, *, scale=None):
    _no_dropout("_scaled_dot_product_fused_attention_overrideable_backward", dropout_p)
    mask = attn_bias if attn_bias is not None and attn_bias.numel() > 0 else None
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, attn_mask=mask, scale=scale)
    g_bias = None
    if grad_input_mask[3] and mask is not None:
        raise NotImplementedError(
            "aten::_scaled_dot_product_fused_attention_overrideable_backward: the gradient of "
            "attn_bias is not computed by the flash kernel; use the math path (requires_grad "
            "on the mask selects it)")
    return gq, gk, gv, g_bias


def _flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _no_dropout("_scaled_dot_product_flash_attention", dropout_p)
    return _flash_outputs(query, key, value, None, is_causal, scale)


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                    max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    _no_dropout("_scaled_dot_product_flash_attention_backward", dropout_p)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)


_lib.impl("_scaled_dot_product_fused_attention_overrideable", _overrideable, "PrivateUse1")
_lib.impl("_scaled_dot_product_fused_attention_overrideable_backward", _overrideable_backward, "PrivateUse1")
_lib.impl("_scaled_dot_product_flash_attention", _flash, "PrivateUse1")
_lib.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "PrivateUse1")


# CUDA's memory-efficient and cuDNN attention: what F.scaled_dot_product_attention calls on
# neuron when a program allows only those backends (`sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)`,
# the choice in csrc/aten/kernels.cpp), and what code written for CUDA may call directly. They
# run CPU's flash kernel too; outputs take the layouts of the ops' meta functions (what a
# compiled graph allocates for them): the efficient kernel's output laid out [batch, seq,
# heads, dim] and its log-sum-exp padded to a multiple of 32 queries, cuDNN's output laid out
# as the query.
def _bmhk(out):
    b, h, m, d = out.shape
    laid = torch.empty((b, m, h, d), dtype=out.dtype, device=out.device).transpose(1, 2)
    return laid.copy_(out)


def _bias_grad(grad_out, q, k, v, bias, out, lse, is_causal, scale):
    """d(loss)/d(attn_bias), which the flash kernel does not return: the scores' gradient
    P * (dP - rowsum(dO * O)), recomputed from the log-sum-exp, summed to the bias's shape."""
    f = torch.float32
    s = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.to(f) @ k.to(f).transpose(-2, -1)) * s + bias.to(f)
    if is_causal:
        m, n = scores.shape[-2:]
        scores = scores.masked_fill(
            torch.ones(m, n, dtype=torch.bool, device=q.device).tril().logical_not(), float("-inf"))
    p = torch.exp(scores - lse.to(f).unsqueeze(-1))
    dp = grad_out.to(f) @ v.to(f).transpose(-2, -1)
    ds = p * (dp - (grad_out.to(f) * out.to(f)).sum(-1, keepdim=True))
    return ds.sum_to_size(bias.shape).to(bias.dtype)


def _fused_backward(op, grad_out, q, k, v, bias, out, lse, dropout_p, is_causal, scale, want_bias):
    _no_dropout(op, dropout_p)
    bias = bias if bias is not None and bias.numel() > 0 else None
    lse = lse[..., :q.shape[-2]]
    if lse.dim() == 4:  # cuDNN's [b, h, m, 1]
        lse = lse.squeeze(-1)
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)
    g_bias = (_bias_grad(grad_out, q, k, v, bias, out, lse, is_causal, scale)
              if want_bias and bias is not None else None)
    return gq, gk, gv, g_bias


def _efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
               *, scale=None):
    _no_dropout("_scaled_dot_product_efficient_attention", dropout_p)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_bias, scale=scale)
    b, h, m = lse.shape
    padded = lse.new_zeros((b, h, (m + 31) // 32 * 32 if compute_log_sumexp else 0))
    padded[..., :m] = lse[..., :padded.shape[-1]]
    seed = torch.empty((), dtype=torch.int64, device=query.device)
    return _bmhk(out), padded, seed, seed.clone()


def _efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed,
                        philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    return _fused_backward("_scaled_dot_product_efficient_attention_backward", grad_out_, query,
                           key, value, attn_bias, out, logsumexp, dropout_p, is_causal, scale,
                           grad_input_mask[3])


def _cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
           return_debug_mask=False, *, scale=None):
    _no_dropout("_scaled_dot_product_cudnn_attention", dropout_p)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_bias, scale=scale)
    seed = torch.empty((), dtype=torch.int64, device=query.device)
    laid = alloc_with_matching_layout(query, tuple(out.shape)).copy_(out)  # as its meta does
    return (laid, lse.unsqueeze(-1).contiguous(), None, None, query.shape[-2], key.shape[-2],
            seed, seed.clone(), None)


def _cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
                    attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
                    scale=None):
    return _fused_backward("_scaled_dot_product_cudnn_attention_backward", grad_out, query, key,
                           value, attn_bias, out, logsumexp, dropout_p, is_causal, scale,
                           False)[:3]


_lib.impl("_scaled_dot_product_efficient_attention", _efficient, "PrivateUse1")
_lib.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward, "PrivateUse1")
_lib.impl("_scaled_dot_product_cudnn_attention", _cudnn, "PrivateUse1")
_lib.impl("_scaled_dot_product_cudnn_attention_backward", _cudnn_backward, "PrivateUse1")
