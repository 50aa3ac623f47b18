"""Fused attention entry points off the CPU: PyTorch's PrivateUse1 SDPA entry and the
FlashAttention one that code written for CUDA calls directly.

``_scaled_dot_product_fused_attention_overrideable`` is the entry PyTorch reserves for a
PrivateUse1 backend's fused SDPA; ``_scaled_dot_product_flash_attention`` is CUDA's. Both run
CPU's flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``: blocked,
online softmax, the log-sum-exp kept for the backward), so results equal CPU's SDPA. Which
SDPA path ``F.scaled_dot_product_attention`` itself takes on neuron is unchanged
(docs/device.md). Dropout: CPU's kernel has none, so ``dropout_p > 0`` is refused here;
``F.scaled_dot_product_attention`` with dropout takes the math path on neuron.
"""
from __future__ import annotations

import torch

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
