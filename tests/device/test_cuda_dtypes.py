"""What CUDA runs, neuron runs: every OpInfo op whose CUDA dtypes exceed its CPU dtypes, in
each of those dtypes, on neuron. References are computed on the CPU in a wider dtype
(float64 / complex128 / int64), as OpInfo's own reference checks do, and compared at the
narrow dtype's tolerance. The list is generated from the installed torch's op_db."""
import numpy as np
import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

from torch_neuronx.kernels.cuda_only import _OPS

DEV = "neuron"
_REF = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
        # CUDA computes chalf in complex<float>; a complex128 reference would differ where
        # half's range overflows (pow), which is not what the check is about.
        torch.complex32: torch.complex64, torch.complex64: torch.complex128,
        torch.bool: torch.int64, torch.int8: torch.float64, torch.uint8: torch.float64,
        torch.int16: torch.float64, torch.int32: torch.float64, torch.int64: torch.float64}
_TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.complex32: dict(rtol=2e-3, atol=4e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
_RANDOM = {"nn.functional.rrelu"}  # draws noise in training mode: checked for dtype and range


def _cases():
    for op in op_db:
        for dtype in sorted(set(op.dtypesIfCUDA) - set(op.dtypes), key=str):
            yield pytest.param(op, dtype, id=f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}-{str(dtype)[6:]}")


def _map(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _cuda_only_op(op):
    name = getattr(op.op, "__name__", "")
    return op.name.startswith("torch.ops.aten.") and op.name.split(".")[-1] in _OPS or name in _OPS


def _tuple(x):
    return x if isinstance(x, (list, tuple)) else (x,)


def _numpy_nan_reduce(name, x, dim=None, keepdim=False, dtype=None):
    a = x.to(torch.complex128 if x.is_complex() else torch.float64).numpy()
    axis = None if dim is None or dim == [] else (tuple(dim) if isinstance(dim, (list, tuple)) else dim)
    fn = np.nansum if name == "nansum" else np.nanmean
    return torch.from_numpy(np.asarray(fn(a, axis=axis, keepdims=keepdim)))


@pytest.mark.parametrize("op,dtype", list(_cases()))
def test_cuda_dtype_runs_on_neuron(op, dtype):
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:4]
    assert samples
    for s in samples:
        args = (s.input,) + tuple(s.args)
        if _cuda_only_op(op):
            # CUDA's attention library entries: neuron refuses them by name (test_cuda_only_ops).
            with pytest.raises(NotImplementedError, match="is not available on the neuron device"):
                op(*_map(args, lambda t: t.to(DEV)), **_map(s.kwargs, lambda t: t.to(DEV)))
            continue
        got = op(*_map(args, lambda t: t.to(DEV)), **_map(s.kwargs, lambda t: t.to(DEV)))
        if op.name in _RANDOM:
            assert got.dtype == dtype and got.device.type == DEV
            continue

        try:  # where CPU has the dtype too, neuron must equal it exactly
            cpu = op(*args, **s.kwargs)
        except (RuntimeError, NotImplementedError):
            cpu = None
        if cpu is not None:
            for g, r in zip(_tuple(got), _tuple(cpu)):
                if isinstance(g, torch.Tensor):
                    torch.testing.assert_close(g.cpu(), r, rtol=0, atol=0, equal_nan=True)
            continue

        def widen(t):
            return t.to(_REF.get(t.dtype, t.dtype)) if t.dtype == dtype else t
        if op.name == "histc":  # CUDA converts the bounds to the input's integer dtype
            kw = dict(s.kwargs)
            for k in ("min", "max"):
                if k in kw:
                    kw[k] = float(int(kw[k]))
            ref = op(*_map(args, widen), **kw)
        elif op.name in ("nansum", "nanmean"):  # CPU has no complex nansum: NumPy's
            ref = _numpy_nan_reduce(op.name, s.input, **s.kwargs)
        else:
            ref = op(*_map(args, widen), **_map(s.kwargs, widen))
        for g, r in zip(_tuple(got), _tuple(ref)):
            if not isinstance(g, torch.Tensor):
                continue
            assert g.device.type == DEV
            r = r.to(g.dtype)
            torch.testing.assert_close(g.cpu(), r, equal_nan=True, **_TOL.get(g.dtype, {}))
    assert (torch.ones(2, device=DEV) + 1).cpu().tolist() == [2.0, 2.0]


def test_integer_histc_is_queued_without_waiting_for_the_device():
    # CPU's kernel refuses integer histc; the device computes CUDA's result with device ops
    # before the host would wait to find that out, as Transformers' MoE routing relies on
    # ("use histc to avoid bincount's device-to-host sync")
    from torch_neuronx import _C
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 14, (2000,), generator=g, dtype=torch.int32)
    want = torch.histc(x.double(), bins=5, min=0, max=9).to(torch.int32)  # values outside dropped
    xd = x.to(DEV)
    torch.histc(xd, bins=5, min=0, max=9)  # a shape's first ops learn their outputs' shapes
    y = torch.randn(1024, 1024, device=DEV)
    torch.neuron.synchronize()
    for _ in range(8):
        y = y @ y / 1024  # tens of milliseconds of queued work
    got = torch.histc(xd, bins=5, min=0, max=9)
    launched, executed = _C._queue_counts(0)
    assert executed < launched
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    out = torch.empty(0, dtype=torch.int32, device=DEV)
    torch.histc(xd, bins=5, min=0, max=9, out=out)
    assert torch.equal(out.cpu(), want)
