"""OpInfo elementwise, reduction and matmul ops compiled on neuron versus eager on CPU.

Compiling one graph per op would take minutes (each Inductor compile builds C++), so the
ops of a family are compiled together: one Dynamo graph computes every op of a chunk on
its first float32 sample input, forward, then backward of the sum of all outputs. Each
output and each input gradient is compared with the same op run eagerly on CPU.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import (BinaryUfuncInfo,
                                                                ReductionOpInfo,
                                                                UnaryUfuncInfo, op_db)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

DEV = "neuron"
# Random, in-place-only, or value-dependent-shape ops: not comparable / not graphable.
_SKIP = {"bernoulli", "normal", "rand_like", "randn_like", "randint_like", "nn.functional.dropout",
         "nonzero", "unique", "masked_select", "item", "to_sparse", "nn.functional.rrelu",
         "special.zeta", "polygamma", "mvlgamma", "nanquantile", "quantile", "mode", "median",
         "nanmedian", "kthvalue", "histc", "bincount", "count_nonzero", "argwhere", "cummax",
         "cummin", "logcumsumexp", "special.airy_ai", "special.scaled_modified_bessel_k0",
         "special.scaled_modified_bessel_k1", "special.modified_bessel_k0",
         "special.modified_bessel_k1", "special.bessel_y0", "special.bessel_y1",
         "sgn", "std_mean", "var_mean", "frexp", "ldexp",
         "chalf", "cfloat", "cdouble", "view_as_complex", "polar", "complex"}
_MATMUL = {"mm", "bmm", "matmul", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "inner",
           "outer", "nn.functional.linear", "einsum", "tensordot", "addr", "linalg.vecdot"}


def _family(op) -> str | None:
    if (op.name in _SKIP or op.variant_test_name not in ("", "default")
            or "jiterator" in op.name):          # CUDA-only ops
        return None
    if torch.float32 not in op.supported_dtypes("cpu"):
        return None
    if op.name in _MATMUL:
        return "matmul"
    if isinstance(op, ReductionOpInfo):
        return "reduction"
    if isinstance(op, UnaryUfuncInfo):
        return "unary"
    if isinstance(op, BinaryUfuncInfo):
        return "binary"
    return None


def _cases(family):
    out = []
    for op in op_db:
        if _family(op) != family:
            continue
        grad = op.supports_autograd
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=grad))
        sample = next((s for s in samples if isinstance(s.input, torch.Tensor)
                       and s.input.numel() > 1), None)
        if sample is None:
            continue
        out.append((op, sample, grad))
    return out


def _chunks(family, size):
    cases = _cases(family)
    return [cases[i:i + size] for i in range(0, len(cases), size)]


_CHUNKS = {f: _chunks(f, s) for f, s in (("unary", 40), ("binary", 30), ("reduction", 20),
                                         ("matmul", 20))}
_PARAMS = [(f, i) for f, chunks in _CHUNKS.items() for i in range(len(chunks))]


def _leaves(sample):
    return tree_flatten(((sample.input,) + tuple(sample.args), sample.kwargs))


def _run_all(cases, flat_inputs, specs):
    outs = []
    for (op, _, _), spec, flat in zip(cases, specs, flat_inputs):
        (args, kwargs) = tree_unflatten(list(flat), spec)
        outs.append(op(*args, **kwargs))
    return outs


def _float_outputs(out):
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


@pytest.mark.parametrize("family,chunk", _PARAMS, ids=[f"{f}{i}" for f, i in _PARAMS])
def test_opinfo_compiled_matches_cpu(family, chunk):
    cases = _CHUNKS[family][chunk]
    flat_cpu, specs = [], []
    for _, sample, _ in cases:
        leaves, spec = _leaves(sample)
        flat_cpu.append([t.detach().clone().requires_grad_(t.requires_grad)
                         if isinstance(t, torch.Tensor) else t for t in leaves])
        specs.append(spec)
    flat_dev = [[t.detach().to(DEV).requires_grad_(t.requires_grad)
                 if isinstance(t, torch.Tensor) else t for t in leaves] for leaves in flat_cpu]

    ref = _run_all(cases, flat_cpu, specs)
    compiled = torch.compile(_run_all, backend="neuron")
    got = compiled(cases, flat_dev, specs)

    failures = []
    grad_ref, grad_got = [], []
    for (op, _, grad), r, g in zip(cases, ref, got):
        try:
            torch.testing.assert_close(tree_map(lambda t: t.detach().cpu()
                                                if isinstance(t, torch.Tensor) else t, g),
                                       tree_map(lambda t: t.detach()
                                                if isinstance(t, torch.Tensor) else t, r),
                                       atol=1e-4, rtol=1e-4, equal_nan=True)
        except AssertionError as exc:
            failures.append(f"{op.name} forward: {str(exc).splitlines()[0]}")
        if grad:
            grad_ref += [t for t in _float_outputs(r) if t.requires_grad]
            grad_got += [t for t in _float_outputs(g) if t.requires_grad]

    # Backward (float32): d(sum of all outputs)/d(inputs), compiled graph vs CPU eager.
    if grad_ref:
        sum(t.sum() for t in grad_ref).backward()
        sum(t.sum() for t in grad_got).backward()
        for (op, _, grad), fc, fd in zip(cases, flat_cpu, flat_dev):
            for a, b in zip(fc, fd):
                if isinstance(a, torch.Tensor) and a.requires_grad and a.grad is not None:
                    try:
                        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-3, rtol=1e-3,
                                                   equal_nan=True)
                    except (AssertionError, AttributeError) as exc:
                        failures.append(f"{op.name} backward: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)
    assert len(cases) > 0
