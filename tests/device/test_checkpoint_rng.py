"""``torch.utils.checkpoint`` recomputes the forward with the device's RNG state of the first
pass, as on CUDA: dropout inside a checkpointed block draws the same mask twice, so outputs
and gradients equal the plain (and CPU's) training step bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp


def _step(device, mode):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.GELU(), nn.Linear(32, 4),
                      nn.Dropout(0.3)).to(device)
    x = torch.randn(8, 16).to(device).requires_grad_()
    torch.manual_seed(1)   # CPU's and the device's generators alike
    y = m(x) if mode == "plain" else cp.checkpoint(m, x, use_reentrant=mode == "reentrant")
    y.square().sum().backward()
    return [t.detach().cpu() for t in [y, x.grad, *(p.grad for p in m.parameters())]]


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointed_dropout_equals_the_plain_step(mode):
    want = _step("cpu", "plain")
    for got in (_step("neuron", mode), _step("neuron", "plain")):
        for w, g in zip(want, got):
            assert torch.equal(g, w)


def test_checkpoint_sees_an_initialized_device():
    # torch.utils.checkpoint stashes a device's RNG state only when the device module says
    # it is initialized, through CUDA's module flag
    assert torch.neuron._initialized is True and torch.neuron.is_initialized()
