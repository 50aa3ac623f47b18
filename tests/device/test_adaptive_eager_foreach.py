"""Adaptive Eager foreach windows: chains of `_foreach_` ops (an optimizer step) run as one
kernel, list index by list index, bit-identical to CPU, in program order where lists share
tensors."""
from __future__ import annotations

import pytest
import torch

import torch_neuronx

N = "neuron"


def _bits(t):
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b, what=""):
    same = torch.equal(_bits(a.detach().cpu()), _bits(b.detach()))
    assert same, f"{what}: results differ"


def _params(device, shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).to(dtype).to(device).requires_grad_() for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(dtype).to(device)
    return ps


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3, foreach=True),
], ids=["adamw", "adam", "sgd", "rmsprop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_steps_fuse_and_match_cpu(make, dtype):
    shapes = [(1 << 18,), (300, 700), (70001,), (5,)]
    pc, pn = _params("cpu", shapes, dtype), _params(N, shapes, dtype)
    oc, on = make(pc), make(pn)
    fused = 0
    for step in range(4):
        oc.step()
        torch_neuronx.adaptive_eager_stats(reset=True)
        on.step()
        torch.neuron.synchronize()
        fused += torch_neuronx.adaptive_eager_stats()["fused_kernels"]
        for k, (a, b) in enumerate(zip(pn, pc)):
            _same(a, b, f"step {step} param {k}")
            for name, v in oc.state[b].items():
                if torch.is_tensor(v) and v.dim() > 0:
                    _same(on.state[a][name], v, f"step {step} {name} {k}")
    assert fused >= 1


def test_functional_foreach_outputs_the_program_keeps_are_written():
    xs = [torch.randn(40000) for _ in range(3)]
    ds = [x.to(N) for x in xs]

    def f(xs):
        s = torch._foreach_sqrt(torch._foreach_abs(xs))
        torch._foreach_add_(s, 1.0)
        torch._foreach_mul_(xs, s)
        return s
    want = f([x.clone() for x in xs])
    f([d.clone() for d in ds])
    got = f(ds)
    for g, w in zip(got, want):
        _same(g, w)


def test_lists_that_share_tensors_keep_program_order():
    a, b = torch.randn(50000), torch.randn(50000)

    def f(a, b):
        torch._foreach_mul_([a, b], 2.0)
        torch._foreach_add_([b, a], [1.0, 3.0])       # a and b at other indices
        torch._foreach_mul_([a, a], [0.5, 0.25])      # one tensor twice in a list
        torch._foreach_addcmul_([b], [a], [a], 0.1)
        return [a, b]
    want = f(a.clone(), b.clone())
    ad, bd = a.to(N), b.to(N)
    f(ad.clone(), bd.clone())
    got = f(ad, bd)
    for g, w in zip(got, want):
        _same(g, w)
