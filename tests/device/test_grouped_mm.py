"""torch._grouped_mm on neuron: CPU's results, one kernel in the cost model."""
import pytest
import torch

from torch_neuronx import cost_model

FORMS = {  # name: (mat_a, mat_b, offs)
    "2d-3d": ((300, 256), (4, 256, 512), [100, 100, 250, 300]),   # rows grouped, one empty
    "2d-2d": ((64, 304), (304, 32), [96, 96, 256, 304]),         # K grouped
    "3d-3d": ((4, 64, 32), (4, 32, 48), None),                   # batched
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", FORMS)
def test_grouped_mm_matches_cpu(form, dtype):
    sa, sb, offs = FORMS[form]
    torch.manual_seed(0)
    a, b = torch.randn(sa, dtype=dtype), torch.randn(sb, dtype=dtype)
    o = torch.tensor(offs, dtype=torch.int32) if offs else None
    want = torch._grouped_mm(a, b, o)
    args = (a.to("neuron"), b.to("neuron"), o.to("neuron") if o is not None else None)
    torch.neuron.synchronize()
    cost_model.reset_modelled_time()
    got = torch._grouped_mm(*args)
    t = cost_model.modelled_time()
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    assert t.launches == 1 and "_grouped_mm" in t.by_op and "mm" not in t.by_op
    m, k = sa[-2], sa[-1]
    n = sb[-1]
    batch = sa[0] if len(sa) == 3 else 1
    assert t.flops == pytest.approx(2.0 * batch * m * k * n)


def test_grouped_mm_gradients_match_cpu():
    torch.manual_seed(0)
    a = torch.randn(300, 256, requires_grad=True)
    b = torch.randn(4, 256, 512, requires_grad=True)
    offs = torch.tensor([100, 100, 250, 300], dtype=torch.int32)
    g = torch.randn(300, 512)
    torch._grouped_mm(a, b, offs).backward(g)
    an, bn = (t.detach().to("neuron").requires_grad_() for t in (a, b))
    torch._grouped_mm(an, bn, offs.to("neuron")).backward(g.to("neuron"))
    torch.testing.assert_close(an.grad.cpu(), a.grad, rtol=0, atol=0)
    torch.testing.assert_close(bn.grad.cpu(), b.grad, rtol=0, atol=0)
    an.grad = None
    torch._grouped_mm(an, bn, offs.to("neuron")).sum().backward()   # a broadcast gradient
    assert an.grad.shape == a.shape


def test_grouped_mm_mixed_devices_are_refused():
    a = torch.randn(8, 16, dtype=torch.bfloat16, device="neuron")
    with pytest.raises(RuntimeError, match="_grouped_mm: expected all tensors on neuron:0"):
        torch._grouped_mm(a, torch.randn(2, 16, 16, dtype=torch.bfloat16),
                          torch.tensor([4, 8], dtype=torch.int32, device="neuron"))
