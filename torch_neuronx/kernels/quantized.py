"""Eager quantized tensors: a clear error naming the op."""
from __future__ import annotations

import torch

_lib = torch.library.Library("aten", "IMPL")


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
