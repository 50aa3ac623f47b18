"""Dropout on the device's generator.

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
