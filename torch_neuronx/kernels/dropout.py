"""Dropout on the device's generator.

The fallback hands a random op the device's generator through the op's ``Generator?``
argument. ``aten::native_dropout`` has none, so its CPU kernel would draw from the CPU
default generator: ``torch.neuron.manual_seed`` would not reach dropout and dropout would
advance CPU's stream, unlike CUDA, where dropout draws from the device's generator. This
kernel performs the CPU kernel's steps (a boolean Bernoulli mask of the keep probability in
the input's layout, then ``input * (mask * scale)`` in the input's dtype) with ``bernoulli_``
on the device, which the fallback routes to
the neuron generator, so a seed gives CPU's numbers and only the device stream advances.

``F.dropout`` itself (``aten::dropout`` / ``dropout_``) reaches ``native_dropout`` only off
the CPU: ATen's composite takes that fused path for CUDA and PrivateUse1 tensors, while on the
CPU it computes ``input * (bernoulli(1 - p) / (1 - p))`` with the noise in the input's layout.
The two orders round differently (``0.123`` in fp32, most rates in bf16) and draw a
non-contiguous input's mask in different element orders, so ``nn.Dropout`` and every layer
built on it drifted from CPU. Neuron's autograd kernel for both ops is CPU's composite, with
its autograd (the gradient is ``grad * noise``, as on CPU).
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
        mask = torch.empty_like(input, dtype=torch.bool)
        mask.bernoulli_(p1m)
        # CPU's kernel scales by the mask times the scale in the input's dtype (the scale
        # rounded to bf16/fp16 first: measured bit for bit, NaN and sign included)
        return input * (mask.to(input.dtype) * scale), mask
    return input.clone(), torch.ones_like(input, dtype=torch.bool)


def _check_p(p):
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")


def _noise(input, p):
    noise = torch.empty_like(input)   # the input's layout: the draw follows its memory order
    noise.bernoulli_(1 - p)
    return noise.div_(1 - p)


def _composite(input, p, train, multiply):
    """ATen's CPU composite, ``multiply`` being ``Tensor.mul`` or, for ``dropout_``,
    ``Tensor.mul_``."""
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        return multiply(input, torch.zeros((), dtype=input.dtype, device=input.device))
    noise = torch.empty_like(input)   # the input's layout: the draw follows its memory order
    noise.bernoulli_(1 - p)
    return multiply(input, noise.div_(1 - p))


def _dropout(input: torch.Tensor, p: float, train: bool):
    return _composite(input, p, train, torch.Tensor.mul)


def _dropout_(input: torch.Tensor, p: float, train: bool):
    return _composite(input, p, train, torch.Tensor.mul_)


_lib.impl("native_dropout", _native_dropout, "PrivateUse1")
_lib.impl("dropout", _dropout, "AutogradPrivateUse1")
_lib.impl("dropout_", _dropout_, "AutogradPrivateUse1")
