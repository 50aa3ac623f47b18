"""``_fused_rms_norm_backward``: CUDA's fused RMSNorm backward, which CPU lacks.

Forward ``_fused_rms_norm`` has a CPU kernel and returns ``rstd`` (float32, the normalised
dims kept as 1); the backward differentiates ``y = x * rstd * w`` in float32 (CUDA's
accumulation type): ``dx = rstd * (dy*w - x̂ * mean(dy*w*x̂))`` and ``dw = sum(dy * x̂)``
over the leading dims, with ``x̂ = x * rstd``.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("aten", "IMPL")


def _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    k = len(normalized_shape)
    norm_dims = list(range(input.dim() - k, input.dim()))
    lead_dims = list(range(input.dim() - k))
    x, g = input.float(), grad_out.float()
    xhat = x * rstd
    gw = g * weight.float() if weight is not None else g
    grad_input = grad_weight = None
    if output_mask[0]:
        grad_input = (rstd * (gw - xhat * (gw * xhat).mean(norm_dims, keepdim=True))).to(input.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = (g * xhat).sum(lead_dims).to(weight.dtype) if lead_dims else (g * xhat).to(weight.dtype)
    return grad_input, grad_weight


_lib.impl("_fused_rms_norm_backward", _fused_rms_norm_backward, "PrivateUse1")
