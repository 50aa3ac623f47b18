"""Strided nested tensors on neuron (torch.nested's default layout, and what the jagged
layout's math SDPA converts to) run ATen's nested kernels over the device buffer: results
equal CPU's nested tensors."""
import pytest
import torch
import torch.nn.functional as F

import torch_neuronx  # noqa: F401


def _pair(*shapes):
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(*s, generator=g) for s in shapes]
    dev = torch.nested.nested_tensor([p.to("neuron") for p in parts])
    return torch.nested.nested_tensor(parts), dev


def _dense(t):
    return t.to_padded_tensor(0.0) if t.is_nested else t


OPS = {
    "matmul": lambda t: torch.matmul(t, t.transpose(-2, -1)),
    "softmax": lambda t: t.softmax(-1),
    "relu_mul_add": lambda t: t.relu() * 2 + t,
    "transpose_contiguous": lambda t: t.transpose(1, 2).contiguous(),
    "sdpa_math": lambda t: torch._scaled_dot_product_attention_math(t, t, t)[0],
    "unbind": lambda t: t.unbind()[1] * 2,
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_strided_nested_ops_equal_cpu(name):
    cpu, dev = _pair((2, 5, 8), (2, 7, 8))
    out = OPS[name](dev)
    assert out.device.type == "neuron"
    assert torch.equal(_dense(out).cpu(), _dense(OPS[name](cpu)))


def test_bmm_linear_and_padding_equal_cpu():
    cpu, dev = _pair((3, 4), (5, 4))
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(F.linear(dev, w.to("neuron")).to_padded_tensor(0.0).cpu(),
                       F.linear(cpu, w).to_padded_tensor(0.0))
    other_cpu, other_dev = _pair((4, 2), (4, 6))
    assert torch.equal(torch.bmm(dev, other_dev).to_padded_tensor(-1.0).cpu(),
                       torch.bmm(cpu, other_cpu).to_padded_tensor(-1.0))
    assert torch.equal(torch.nested.to_padded_tensor(dev, 0.5, (2, 6, 5)).cpu(),
                       torch.nested.to_padded_tensor(cpu, 0.5, (2, 6, 5)))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_jagged_sdpa_in_the_transposed_layout_equals_cpu(requires_grad):
    # [batch, heads, ragged seq, dim], as Transformers and torch's tutorial lay it out: its math
    # SDPA converts to strided nested tensors
    def run(dev):
        g = torch.Generator().manual_seed(0)
        parts = [torch.randn(5, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)]
        q = torch.nested.nested_tensor([p.to(dev) for p in parts], layout=torch.jagged,
                                       requires_grad=requires_grad)
        qt = q.transpose(1, 2)
        out = F.scaled_dot_product_attention(qt, qt, qt)
        if not requires_grad:
            return [out.values()]
        (out.values() ** 2).sum().backward()
        return [out.values(), q.grad.values()]
    for a, b in zip(run("neuron"), run("cpu")):
        assert torch.equal(a.cpu(), b)


def test_an_op_without_a_nested_kernel_names_itself_and_the_device_stays_usable():
    cpu, dev = _pair((3, 4), (5, 4))
    with pytest.raises(NotImplementedError, match="cumsum.*nested tensors on the neuron device"):
        torch.cumsum(dev, 0)
    with pytest.raises(NotImplementedError):
        torch.cumsum(cpu, 0)   # CPU has none either
    assert torch.equal((dev * 3).to_padded_tensor(0.0).cpu(), (cpu * 3).to_padded_tensor(0.0))


def test_nested_metadata_stays_on_the_host():
    _, dev = _pair((3, 4), (5, 4))
    for op in (torch.ops.aten._nested_tensor_size, torch.ops.aten._nested_tensor_strides,
               torch.ops.aten._nested_tensor_storage_offsets):
        assert op(dev).device.type == "cpu"
    assert torch.equal(torch.ops.aten._nested_tensor_size(dev), torch.tensor([[3, 4], [5, 4]]))


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_fast_path_with_padding_equals_cpu(norm_first):
    # eval + inference mode + a key padding mask: nn.TransformerEncoder packs the sequences
    # into a nested tensor (_nested_tensor_from_mask) and runs the fused encoder layer
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, norm_first=norm_first)
    cpu = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=not norm_first).eval()
    dev = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, norm_first=norm_first), 2,
        enable_nested_tensor=not norm_first).eval()
    dev.load_state_dict(cpu.state_dict())
    dev.to("neuron")
    x = torch.randn(3, 6, 16)
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])
    with torch.inference_mode():
        want = cpu(x, src_key_padding_mask=mask)
        got = dev(x.to("neuron"), src_key_padding_mask=mask.to("neuron"))
    assert torch.equal(got.cpu(), want)
