"""Kernels registered from Python for ops the CPU fallback cannot serve as CUDA does.

The fallback hands a random op the device's generator through the op's ``Generator?``
argument. ``aten::native_dropout`` has none, so its CPU kernel would draw from the CPU
default generator: ``torch.neuron.manual_seed`` would not reach dropout and dropout would
advance CPU's stream, unlike CUDA, where dropout draws from the device's generator. This
kernel performs the CPU kernel's steps (a Bernoulli mask of the keep probability, then
``input * mask * scale``) with ``bernoulli_`` on the device, which the fallback routes to
the neuron generator, so a seed gives CPU's numbers and only the device stream advances.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("aten", "IMPL")


def _native_dropout(input: torch.Tensor, p: float, train):
    if input.numel() == 0:
        return input, torch.empty_like(input)  # as CPU: the empty mask keeps the input dtype
    if train is None or train:
        p1m = 1.0 - p
        scale = 0.0 if p1m == 0 else 1.0 / p1m
        mask = torch.empty_like(input, memory_format=torch.contiguous_format)
        mask.bernoulli_(p1m)
        output = input.mul(mask).mul_(scale)
        return output, mask.to(torch.bool)
    return input.clone(), torch.ones_like(input, dtype=torch.bool)


_lib.impl("native_dropout", _native_dropout, "PrivateUse1")


# Quantized tensors: PyTorch's eager quantization (torch.ao.quantization) is deprecated
# upstream and has no PrivateUse1 storage, so the CPU fallback fails deep in empty_strided.
# These name the op and the way forward instead.
def _no_quantized(op):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"aten::{op} is not supported on the neuron device: eager quantized tensors "
            "(torch.ao.quantization, deprecated upstream) have no neuron storage. Quantize on "
            "the CPU, or keep low-precision weights as ordinary neuron tensors "
            "(float8/int8 dtypes) with explicit scales.")
    return kernel


for _op in ("quantize_per_tensor", "quantize_per_tensor.tensor_qparams",
            "quantize_per_tensor.tensors", "quantize_per_tensor_dynamic", "quantize_per_channel"):
    _lib.impl(_op, _no_quantized(_op), "PrivateUse1")
