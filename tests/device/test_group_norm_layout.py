"""GroupNorm's gradients on channels-last activations equal CPU's bit for bit: CPU's autograd
formula keeps the input's memory format for the backward kernel, and neuron restores it."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

CASES = [((4, 32, 8, 8), torch.channels_last), ((2, 16, 4, 4, 4), torch.channels_last_3d),
         ((4, 32, 8, 8), torch.contiguous_format), ((3, 16, 10), torch.contiguous_format)]


def _run(device, shape, fmt, state, x, g, double):
    m = nn.GroupNorm(8, shape[1]).to(device)
    m.load_state_dict(state)
    xi = x.to(device).clone().requires_grad_()
    y = m(xi)
    if double:   # a gradient penalty: the backward itself differentiated
        (gx,) = torch.autograd.grad((y * y).sum(), xi, create_graph=True)
        gx.pow(2).sum().backward()
        outs = [gx]
    else:
        y.backward(g.to(device))
        outs = [y]
    return [t.detach().cpu() for t in outs + [xi.grad, m.weight.grad, m.bias.grad
                                              if m.bias.grad is not None else m.weight]]


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("shape,fmt", CASES)
def test_group_norm_gradients_equal_cpu(shape, fmt, double):
    torch.manual_seed(0)
    ref = nn.GroupNorm(8, shape[1])
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    x = torch.randn(shape)
    g = torch.randn(shape)
    if len(shape) >= 4:
        x, g = x.to(memory_format=fmt), g.to(memory_format=fmt)
    want = _run("cpu", shape, fmt, ref.state_dict(), x, g, double)
    got = _run("neuron", shape, fmt, ref.state_dict(), x, g, double)
    for w, o in zip(want, got):
        assert o.stride() == w.stride()
        assert torch.equal(o, w)


def test_channels_last_unet_block_trains_like_cpu():
    torch.manual_seed(1)
    block = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                          nn.Conv2d(16, 8, 3, padding=1), nn.GroupNorm(2, 8))
    x = torch.randn(2, 8, 12, 12)
    grads = {}
    for device in ("cpu", "neuron"):
        m = copy.deepcopy(block).to(device).to(memory_format=torch.channels_last)
        m(x.to(device).to(memory_format=torch.channels_last)).square().mean().backward()
        grads[device] = [p.grad.detach().cpu() for p in m.parameters()]
    for w, o in zip(grads["cpu"], grads["neuron"]):
        assert torch.equal(o, w)
