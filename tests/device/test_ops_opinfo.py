"""Every OpInfo op on neuron against CPU: forward in float32/bfloat16/float16, gradients in
float32. The device runs CPU's kernels on device memory, so results must be identical (bit for
bit, NaNs in the same places); the few exceptions are listed below with their reasons.

Each forward sample runs twice on the device: the first call of an argument signature runs
synchronously and teaches the runtime the op's outputs, the second is an asynchronous launch
(queued kernel, outputs allocated up front), so both paths are compared with CPU."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

DEVICE = "neuron"
FORWARD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_SAMPLES = 3

# Exclusions, each with its reason. Keys: op name (with variant), or (name, dtype), or
# (name, "grad") for the gradient test only.
EXCLUDE = {
    ("nn.functional.linear_cross_entropy.chunked", torch.bfloat16):
        "PyTorch's chunked path accumulates in fp32 only on CPU/CUDA (a Python policy in "
        "torch/nn/modules/linear_cross_entropy_options.py); other devices (MPS, XPU, neuron) "
        "accumulate in the input dtype",
    ("nn.functional.linear_cross_entropy.chunked", torch.float16): "same as bfloat16",
    ("nn.functional.linear_cross_entropy.chunked_none", torch.bfloat16): "same as chunked",
    ("nn.functional.linear_cross_entropy.chunked_none", torch.float16): "same as chunked",
    ("sparse.mm.reduce", "grad"):
        "KNOWN BUG: SIGSEGV inside CPU's sparse-CSR spmm_reduce backward kernel (amax/amin) on "
        "device CSR inputs; forward passes",
    "as_strided.partial_views": "samples read storage outside the view; moving a sample to "
                                "another device copies only the view, so the devices see "
                                "different memory (a property of the test, same on CUDA)",
}

# Ops whose results legitimately differ between two CPU runs (random or
# uninitialised output): compared by shape/dtype/device only.
NONDETERMINISTIC = {
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "torch.empty", "uniform", "normal", "bernoulli", "multinomial", "randint_like", "rand_like",
    "randn_like", "randint", "cauchy", "exponential", "geometric", "log_normal",
}


def _name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _to(x, device):
    # Factory ops and .to() name their device in arguments: that is the device under test.
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device(device)
    if isinstance(x, str) and x == "cpu":
        return device
    if isinstance(x, torch.Tensor):
        return x.detach().to(device).requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


# Arguments that must stay on the host, as on CUDA (the op reads them on the host).
HOST_ARGS = {"tensor_split": "indices_or_sections is read on the host, as on CUDA"}


def _move_sample(sample, device, op_name=""):
    if op_name in HOST_ARGS:
        return _to(sample.input, device), sample.args, sample.kwargs
    return _to(sample.input, device), _to(sample.args, device), _to(sample.kwargs, device)


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flatten(o)]
    return []


def _run(op, inp, args, kwargs, seed=1234):
    torch.manual_seed(seed)
    return op(inp, *args, **kwargs)


def _compare(op_name, got, want):
    got_t, want_t = _flatten(got), _flatten(want)
    assert len(got_t) == len(want_t), f"{op_name}: {len(got_t)} outputs vs {len(want_t)} on CPU"
    for g, w in zip(got_t, want_t):
        assert g.device.type == DEVICE, f"{op_name}: output on {g.device}"
        assert g.shape == w.shape and g.dtype == w.dtype, (op_name, g.shape, w.shape, g.dtype, w.dtype)
        if op_name in NONDETERMINISTIC or op_name.split(".")[0] in NONDETERMINISTIC:
            continue
        g = g.cpu()
        if w.layout != torch.strided:
            g, w = g.to_dense(), w.to_dense()
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, check_stride=False,
                                   msg=lambda m: f"{op_name}: {m}")
    if not isinstance(want, (torch.Tensor, list, tuple)):
        assert got == want, f"{op_name}: {got} != {want}"


def _cases():
    for op in op_db:
        name = _name(op)
        for dtype in FORWARD_DTYPES:
            reason = EXCLUDE.get(name) or EXCLUDE.get((name, dtype))
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            yield pytest.param(op, dtype, id=f"{name}-{str(dtype)[6:]}", marks=marks)


@pytest.mark.parametrize("op,dtype", list(_cases()))
def test_forward(op, dtype):
    if dtype not in op.supported_dtypes("cpu"):
        pytest.skip(f"CPU has no {dtype} kernel for {op.name}")
    name = _name(op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:MAX_SAMPLES]
        for sample in samples:
            try:
                want = _run(op, sample.input, sample.args, sample.kwargs)
            except Exception as e:  # CPU rejects the sample: neuron must reject it too
                for _ in range(2):
                    inp, args, kwargs = _move_sample(sample, DEVICE, name)
                    with pytest.raises(type(e)):
                        _run(op, inp, args, kwargs)
                        torch.neuron.synchronize()
                continue
            for _ in range(2):
                inp, args, kwargs = _move_sample(sample, DEVICE, name)
                got = _run(op, inp, args, kwargs)
                _compare(name, got, want)


def _grad_cases():
    for op in op_db:
        if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu"):
            name = _name(op)
            reason = EXCLUDE.get(name) or EXCLUDE.get((name, "grad"))
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            yield pytest.param(op, id=name, marks=marks)


def _grads(op, sample_input, args, kwargs):
    out = _run(op, sample_input, args, kwargs)
    outs = [o for o in _flatten(out) if o.requires_grad and o.dtype.is_floating_point]
    leaves = [t for t in _flatten([sample_input, list(args), list(kwargs.values())])
              if t.requires_grad]
    if not outs or not leaves:
        return None
    total = sum((o.float() * torch.linspace(0.5, 1.5, o.numel(), device=o.device).reshape(o.shape)).sum()
                for o in outs)
    return torch.autograd.grad(total, leaves, allow_unused=True)


@pytest.mark.parametrize("op", list(_grad_cases()))
def test_grad_float32(op):
    name = _name(op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))[:MAX_SAMPLES]
        for sample in samples:
            try:
                want = _grads(op, sample.input, sample.args, sample.kwargs)
            except Exception:
                continue
            if want is None:
                continue
            inp, args, kwargs = _move_sample(sample, DEVICE, name)
            got = _grads(op, inp, args, kwargs)
            for g, w in zip(got, want):
                if w is None:
                    assert g is None
                    continue
                if name in NONDETERMINISTIC or name.split(".")[0] in NONDETERMINISTIC:
                    continue
                torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0, equal_nan=True,
                                           check_stride=False, msg=lambda m: f"{name} grad: {m}")
