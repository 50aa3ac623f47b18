"""Backend tensor metadata (``torch._utils.set_tensor_metadata``) where torch gives a backend
no hook: ``copy.deepcopy`` of a plain tensor, and the fake tensor that stands for a real one
during tracing (Dynamo, AOTAutograd, export). torch's own paths already carry it through
``torch.save``/``torch.load`` and ``detach()``; ``clone()`` is the neuron kernel's
(csrc/aten/kernels.cpp). Both wrappers copy the map only from a neuron tensor that has one,
and leave every other tensor to torch untouched."""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensorConverter

_get, _set = torch._utils.get_tensor_metadata, torch._utils.set_tensor_metadata


def _carry(src, dst):
    if isinstance(src, torch.Tensor) and src.device.type == "neuron" and dst is not src:
        meta = _get(src)
        if meta:
            _set(dst, meta)
    return dst


def install() -> None:
    if getattr(torch.Tensor.__deepcopy__, "_neuron_metadata", False):
        return
    deepcopy = torch.Tensor.__deepcopy__

    # torch's Tensor.__deepcopy__ copies the storage and set_()s it into a new_empty([]), so no
    # kernel sees the source tensor; memo returns an earlier copy that already has the map.
    @functools.wraps(deepcopy)
    def __deepcopy__(self, memo):
        return _carry(self, deepcopy(self, memo))

    __deepcopy__._neuron_metadata = True
    torch.Tensor.__deepcopy__ = __deepcopy__

    from_real = FakeTensorConverter.from_real_tensor

    @functools.wraps(from_real)
    def from_real_tensor(self, fake_mode, t, *args, **kwargs):
        return _carry(t, from_real(self, fake_mode, t, *args, **kwargs))

    FakeTensorConverter.from_real_tensor = from_real_tensor
