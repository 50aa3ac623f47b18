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


def test_plain_tensor_deepcopy_keeps_metadata_and_values():
    x = torch.randn(5, 2)
    d = x.to(DEV)
    torch._utils.set_tensor_metadata(d, META)
    c = copy.deepcopy(d)
    assert torch._utils.get_tensor_metadata(c) == META
    assert torch.equal(c.cpu(), x) and c.data_ptr() != d.data_ptr()
    torch._utils.set_tensor_metadata(c, {"packed": False})
    assert torch._utils.get_tensor_metadata(d)["packed"] is True
    both = copy.deepcopy([d, d])  # the memo returns one copy for both
    assert both[0] is both[1] and torch._utils.get_tensor_metadata(both[0]) == META
    assert torch._utils.get_tensor_metadata(copy.deepcopy(torch.ones(2, device=DEV))) == {}
    cpu = copy.deepcopy(x)  # CPU tensors are torch's business, unchanged
    assert torch.equal(cpu, x)


def test_fake_tensor_of_a_neuron_tensor_carries_its_metadata():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    d = torch.randn(4, 4, device=DEV)
    torch._utils.set_tensor_metadata(d, META)
    mode = FakeTensorMode()
    f = mode.from_tensor(d)
    assert isinstance(f, FakeTensor) and f.device == d.device
    assert torch._utils.get_tensor_metadata(f) == META
    assert torch._utils.get_tensor_metadata(mode.from_tensor(torch.randn(2, device=DEV))) == {}


def test_metadata_visible_to_a_dynamo_traced_function():
    # Dynamo fakifies graph inputs through FakeTensorConverter: a backend reading an input's
    # fake value (the placeholder's example_value) sees the real tensor's metadata.
    seen = []

    def backend(gm, example_inputs):
        from torch._subclasses.fake_tensor import FakeTensor
        fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        assert fakes and all(isinstance(t, FakeTensor) for t in fakes)
        seen.extend(torch._utils.get_tensor_metadata(t) for t in fakes)
        return gm.forward

    d = torch.randn(3, device=DEV)
    torch._utils.set_tensor_metadata(d, META)
    torch._dynamo.reset()
    out = torch.compile(lambda t: t * 2, backend=backend)(d)
    assert torch.equal(out.cpu(), d.cpu() * 2)
    assert META in seen
