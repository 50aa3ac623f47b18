"""``torch.from_dlpack`` of a neuron tensor. torch's ``Tensor.__dlpack_device__`` names
PrivateUse1's DLPack device (``kDLExtDev``) only while the backend keeps the name
"privateuse1", so after the rename to "neuron" it raised "Unknown device type neuron for
Dlpack", although ``__dlpack__`` (C++) exports the tensor. The wrapper answers for neuron
tensors and leaves every other tensor to torch."""
from __future__ import annotations

import functools

import torch


def install() -> None:
    original = torch.Tensor.__dlpack_device__
    if getattr(original, "_neuron", False):
        return
    name = torch._C._get_privateuse1_backend_name()

    @functools.wraps(original)
    def __dlpack_device__(self):
        if not torch._C._has_torch_function_unary(self) and self.device.type == name:
            from torch.utils.dlpack import DLDeviceType
            return (DLDeviceType.kDLExtDev, self.device.index or 0)
        return original(self)

    __dlpack_device__._neuron = True
    torch.Tensor.__dlpack_device__ = __dlpack_device__
