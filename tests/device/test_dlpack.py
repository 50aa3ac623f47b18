"""DLPack exchange of neuron tensors, as CUDA tensors exchange theirs: ``torch.from_dlpack``
aliases the device memory (same device, same data pointer), a ``device="cpu"`` request
copies, and consumers that accept only host memory refuse it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.dlpack import DLDeviceType, to_dlpack


def test_from_dlpack_aliases_the_device_tensor():
    x = torch.arange(12., device="neuron:1").view(3, 4) * 2
    assert x.__dlpack_device__() == (DLDeviceType.kDLExtDev, 1)
    for y in (torch.from_dlpack(x), torch.from_dlpack(to_dlpack(x.t()))):
        assert y.device == torch.device("neuron", 1)
    y = torch.from_dlpack(x)
    assert y.data_ptr() == x.data_ptr()
    y[0, 0] = 100.0
    want = torch.arange(12.).view(3, 4) * 2
    want[0, 0] = 100.0
    assert torch.equal(x.cpu(), want)
    t = torch.from_dlpack(to_dlpack(x.t()))
    assert t.stride() == (1, 4) and torch.equal(t.cpu(), want.t())
    assert torch.equal(torch.from_dlpack(x, device="cpu"), want)
    p = torch.nn.Parameter(x.clone())
    assert torch.from_dlpack(p.detach()).device == p.device


def test_host_only_consumers_refuse_as_for_cuda():
    with pytest.raises(RuntimeError, match="Unsupported device"):
        np.from_dlpack(torch.ones(3, device="neuron"))
