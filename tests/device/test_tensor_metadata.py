"""Backend tensor metadata (torch._utils.set_tensor_metadata) through clone and deepcopy."""
import copy

import torch

DEV = "neuron"
META = {"packed": True, "sharded": False}


def test_clone_keeps_metadata_and_values_equal_cpu():
    x = torch.randn(3, 4)
    d = x.to(DEV)
    torch._utils.set_tensor_metadata(d, META)
    for fmt in (torch.preserve_format, torch.contiguous_format):
        c = d.clone(memory_format=fmt)
        assert torch._utils.get_tensor_metadata(c) == META
        assert torch.equal(c.cpu(), x)
        v, ref = d.t().clone(memory_format=fmt), x.t().clone(memory_format=fmt)
        assert torch.equal(v.cpu(), ref) and v.stride() == ref.stride()
    c = d.clone()
    torch._utils.set_tensor_metadata(c, {"packed": False})
    assert torch._utils.get_tensor_metadata(d)["packed"] is True  # each copy its own map
    assert torch._utils.get_tensor_metadata(torch.randn(2, device=DEV).clone()) == {}


def test_module_deepcopy_keeps_parameter_metadata():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3).to(DEV)
    torch._utils.set_tensor_metadata(m.weight, META)
    m2 = copy.deepcopy(m)
    assert torch._utils.get_tensor_metadata(m2.weight) == META
    assert torch._utils.get_tensor_metadata(m2.bias) == {}
    assert torch.equal(m2.weight.cpu(), m.weight.cpu()) and m2.weight.data_ptr() != m.weight.data_ptr()
