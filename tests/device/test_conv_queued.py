"""Convolutions are queued like other ops: CPU's values and strides, the host not waiting."""
import pytest
import torch
import torch.nn.functional as F

import torch_neuronx

CASES = [
    # (name, input shape, fn(x, w, b), weight shape, bias size, channels_last)
    ("conv1d", (2, 4, 33), lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1), (6, 4, 3), 6, False),
    ("conv2d", (2, 3, 17, 15), lambda x, w, b: F.conv2d(x, w, b, padding=2, dilation=2), (8, 3, 3, 3), 8, False),
    ("conv2d-cl", (2, 4, 16, 16), lambda x, w, b: F.conv2d(x, w, b, stride=2, groups=2), (6, 2, 3, 3), 6, True),
    ("conv3d", (1, 2, 5, 8, 8), lambda x, w, b: F.conv3d(x, w, b, padding=1), (4, 2, 3, 3, 3), 4, False),
    ("conv_transpose2d", (2, 4, 7, 9),
     lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1, groups=2),
     (4, 3, 3, 3), 6, False),
    ("conv2d-nobias", (2, 3, 10, 10), lambda x, w, b: F.conv2d(x, w, None), (5, 3, 1, 1), None, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_values_strides_and_grads_equal_cpu(case):
    _, xs, fn, ws, bs, cl = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(xs, generator=g)
    w = torch.randn(ws, generator=g)
    b = torch.randn(bs, generator=g) if bs else None
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    outs = {}
    for dev in ("cpu", "neuron"):
        xd = x.detach().to(dev, copy=True).requires_grad_()
        wd = w.detach().to(dev, copy=True).requires_grad_()
        bd = b.detach().to(dev, copy=True).requires_grad_() if b is not None else None
        y = fn(xd, wd, bd)
        (y * torch.linspace(-1, 1, y.numel(), device=dev).view_as(y)).sum().backward()
        outs[dev] = [y, xd.grad, wd.grad] + ([bd.grad] if bd is not None else [])
    for c, n in zip(outs["cpu"], outs["neuron"]):
        assert n.device.type == "neuron"
        assert n.shape == c.shape and n.stride() == c.stride()
        assert torch.equal(n.cpu(), c)


def test_convolution_does_not_wait_for_the_device():
    a = torch.randn(1536, 1536, device="neuron")
    x = torch.randn(2, 3, 32, 32, device="neuron")
    w = torch.randn(8, 3, 3, 3, device="neuron")
    torch.neuron.synchronize()
    torch_neuronx.queue_stats(reset=True)
    slow = a @ a @ a          # queued work the convolution must not wait for
    y = F.conv2d(x, w)
    stats = torch_neuronx.queue_stats()
    assert stats["launched"] > stats["executed"]   # the host got here first
    assert stats["synchronous_ops"] == {}
    torch.neuron.synchronize()
    assert torch.equal(y.cpu(), F.conv2d(x.cpu(), w.cpu()))
    del slow


def test_bad_shapes_fail_at_the_call_and_the_device_stays_usable():
    x = torch.randn(2, 3, 8, 8, device="neuron")
    w = torch.randn(4, 5, 3, 3, device="neuron")    # 5 input channels, the input has 3
    with pytest.raises(RuntimeError) as cpu_err:
        F.conv2d(x.cpu(), w.cpu())
    with pytest.raises(RuntimeError) as dev_err:
        F.conv2d(x, w)
    assert str(dev_err.value) == str(cpu_err.value)
    ok = torch.randn(4, 3, 3, 3, device="neuron")
    assert torch.equal(F.conv2d(x, ok).cpu(), F.conv2d(x.cpu(), ok.cpu()))


def test_queued_convolution_reads_its_arguments_as_launched():
    a = torch.randn(1536, 1536, device="neuron")
    x0 = torch.randn(2, 3, 12, 12)
    w0 = torch.randn(4, 3, 3, 3)
    x, w = x0.to("neuron"), w0.to("neuron")
    torch.neuron.synchronize()
    slow = a @ a @ a
    y = F.conv2d(x, w)
    x.set_(torch.zeros(2, 3, 12, 12, device="neuron"))    # after the launch, before the run
    w.set_(torch.ones(4, 3, 3, 3, device="neuron"))
    assert torch.equal(y.cpu(), F.conv2d(x0, w0))
    del slow
