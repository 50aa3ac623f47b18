"""torch._grouped_mm on neuron: CPU's results, one kernel in the cost model."""
import pytest
import torch

from torch_neuronx import cost_model

FORMS = {  # name: (mat_a, mat_b, offs)
    "2d-3d": ((300, 256), (4, 256, 512), [100, 100, 250, 300]),   # rows grouped, one empty
    "2d-2d": ((64, 304), (304, 32), [96, 96, 256, 304]),         # K grouped
    "3d-3d": ((4, 64, 32), (4, 32, 48), None),                   # batched
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
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


def test_grouped_mm_is_queued_without_waiting_for_the_device():
    # CPU's kernel reads the offsets; on neuron it runs on the queue, behind the work before
    # it, so the host does not wait for the device (a MoE layer's launches keep flowing)
    from torch_neuronx import _C
    sa, sb, offs = FORMS["2d-3d"]
    a, b = torch.randn(sa, dtype=torch.bfloat16), torch.randn(sb, dtype=torch.bfloat16)
    o = torch.tensor(offs, dtype=torch.int32)
    want = torch._grouped_mm(a, b, o)
    a, b, o = a.to("neuron"), b.to("neuron"), o.to("neuron")
    x = torch.randn(1024, 1024, device="neuron")
    torch.neuron.synchronize()
    for _ in range(8):
        x = x @ x / 1024  # tens of milliseconds of queued work
    got = torch._grouped_mm(a, b, o)
    launched, executed = _C._queue_counts(0)
    assert executed < launched
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_grouped_mm_inputs_cuda_refuses_still_run_cpus_kernel():
    # The checks on meta tensors are CUDA's (e.g. 16-byte aligned strides); what only they
    # refuse runs CPU's kernel on the host, with CPU's result
    a, b = torch.randn(64, 20), torch.randn(4, 20, 12)
    o = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    want = torch._grouped_mm(a, b, o)
    got = torch._grouped_mm(a.to("neuron"), b.to("neuron"), o.to("neuron"))
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
