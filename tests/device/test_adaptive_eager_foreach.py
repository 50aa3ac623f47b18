"""Adaptive Eager foreach windows: chains of `_foreach_` ops (an optimizer step) run as one
kernel, list index by list index, bit-identical to CPU, in program order where lists share
tensors."""
from __future__ import annotations

import pytest
import torch

import torch_neuronx

from _compare import assert_same_bits as _same  # noqa: E402

N = "neuron"


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


def _foreach_ops():
    import torch.testing._internal.common_methods_invocations as m
    names = sorted(n for n in dir(m) if n.startswith("foreach_") and n.endswith("_op_db"))
    return [op for n in names for op in getattr(m, n)]


def _to_neuron(v):
    # A 0-dim tensor moves; a standalone 1-D tensor is a `scalars` argument, which stays on
    # the CPU as CUDA requires.
    return v.to(N) if torch.is_tensor(v) and v.dim() == 0 else v


def _move(sample):
    inp = [t.to(N) for t in sample.input]
    args = [[t.to(N) if torch.is_tensor(t) else t for t in a] if isinstance(a, (list, tuple))
            else _to_neuron(a) for a in sample.args]
    return inp, args, dict(sample.kwargs)


@pytest.mark.parametrize("op", _foreach_ops(), ids=lambda op: op.name)
def test_foreach_opinfo_samples_match_cpu(op):
    samples = list(op.sample_inputs("cpu", torch.float32, num_input_tensors=[3]))[:4]
    compared = 0
    for k, s in enumerate(samples):
        for variant in (op.method_variant, op.inplace_variant):
            if variant is None:
                continue
            inp_c = [t.clone() for t in s.input]
            try:
                want = variant(inp_c, *s.args, **s.kwargs)
            except Exception:  # noqa: BLE001 - CPU rejects the sample: nothing to compare
                continue
            for _ in range(2):  # the first call of a signature learns it
                inp_d, args_d, kwargs_d = _move(s)
                got = variant(inp_d, *args_d, **kwargs_d)
            if variant is op.inplace_variant:
                want, got = inp_c, inp_d
            for w, g in zip(want, got):
                torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m: f"{op.name} sample {k}: {m}")
                compared += 1
    assert compared > 0
