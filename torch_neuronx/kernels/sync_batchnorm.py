"""The batch-norm pieces ``nn.SyncBatchNorm`` calls off the CPU (CUDA-only in ATen).

``SyncBatchNorm`` runs on CUDA and PrivateUse1 devices: per-rank statistics
(``batch_norm_stats``), an all-gather, their merge (``batch_norm_gather_stats_with_counts``),
the normalisation (``batch_norm_elemt``) and the two backward halves. Each follows CUDA's
definition, computing in float32 (CUDA's accumulation type) for half and bfloat16 inputs:
``invstd = 1 / sqrt(biased_var + eps)`` and the running variance updated with the unbiased one.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("aten", "IMPL")


def _acc(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _per_channel(t, like):
    return t.reshape((1, -1) + (1,) * (like.dim() - 2))


def _reduce_dims(t):
    return [0] + list(range(2, t.dim()))


def batch_norm_stats(input, eps):
    x = _acc(input)
    var, mean = torch.var_mean(x, dim=_reduce_dims(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    y = (_acc(input) - _per_channel(mean, input)) * _per_channel(invstd, input)
    if weight is not None:
        y = y * _per_channel(_acc(weight), input)
    if bias is not None:
        y = y + _per_channel(_acc(bias), input)
    return y.to(input.dtype)


def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var,
                                        momentum, eps, counts):
    counts = counts.to(mean.dtype).reshape(-1, 1)
    present = counts > 0  # a rank with no samples contributes nothing (its invstd is 0)
    n = counts.sum(0)
    total_mean = (counts * mean).sum(0) / n
    var_i = torch.where(present, 1.0 / (invstd * invstd) - eps, torch.zeros_like(invstd))
    var = (counts * (var_i + (mean - total_mean) ** 2)).sum(0) / n
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(total_mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        unbiased = var * n / (n - 1)
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return total_mean, torch.rsqrt(var + eps)


def batch_norm_gather_stats(input, mean, invstd, running_mean, running_var, momentum, eps, count):
    counts = torch.full((mean.shape[0],), float(count), dtype=mean.dtype, device=mean.device)
    return batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var,
                                               momentum, eps, counts)


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    g, dims = _acc(grad_out), _reduce_dims(grad_out)
    sum_dy = g.sum(dims)
    sum_dy_xmu = (g * (_acc(input) - _per_channel(mean, input))).sum(dims)
    wdtype = weight.dtype if weight is not None else input.dtype
    grad_weight = (sum_dy_xmu * invstd).to(wdtype) if weight_g else None
    grad_bias = sum_dy.to(wdtype) if bias_g else None
    if not input_g:
        sum_dy = sum_dy_xmu = None
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    n = count.sum().to(torch.float32)
    m, s = _per_channel(mean, input), _per_channel(invstd, input)
    g = (_acc(grad_out) - _per_channel(sum_dy / n, input)
         - (_acc(input) - m) * s * s * _per_channel(sum_dy_xmu / n, input)) * s
    if weight is not None:
        g = g * _per_channel(_acc(weight), input)
    return g.to(input.dtype)


for _name, _fn in [("batch_norm_stats", batch_norm_stats), ("batch_norm_elemt", batch_norm_elemt),
                   ("batch_norm_gather_stats", batch_norm_gather_stats),
                   ("batch_norm_gather_stats_with_counts", batch_norm_gather_stats_with_counts),
                   ("batch_norm_backward_reduce", batch_norm_backward_reduce),
                   ("batch_norm_backward_elemt", batch_norm_backward_elemt)]:
    _lib.impl(_name, _fn, "PrivateUse1")
_lib.impl("batch_norm_elemt.out", lambda input, weight, bias, mean, invstd, eps, *, out: out.resize_(
    input.shape).copy_(batch_norm_elemt(input, weight, bias, mean, invstd, eps)), "PrivateUse1")
