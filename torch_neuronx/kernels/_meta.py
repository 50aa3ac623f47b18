"""Meta stand-ins for neuron arguments, so that PyTorch's meta functions can check
arguments and infer results (dtypes, shapes) without touching device memory.

A neuron tensor becomes a meta tensor over a storage of the same size, with the same
sizes, strides and storage offset: meta functions that reason about overlap or offsets see
what the real kernel would. ``device="neuron"`` arguments become ``"meta"``; lists and
tuples are converted element-wise; anything else is returned unchanged.
"""
from __future__ import annotations

import torch


def to_meta(x):
    if isinstance(x, torch.Tensor) and x.device.type == "neuron":
        base = torch.empty(x.untyped_storage().nbytes() // x.element_size() + 1, dtype=x.dtype,
                           device="meta")
        return base.as_strided(x.shape, x.stride(), x.storage_offset())
    if isinstance(x, torch.device) and x.type == "neuron":
        return torch.device("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(to_meta(t) for t in x)
    return x
