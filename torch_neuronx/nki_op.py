"""``torch_neuronx.nki_op``: an NKI kernel as a PyTorch custom operator.

    from torch_neuronx import nki_op

    @nki_op("mylib::add", mutates_args=())
    @nki.jit
    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...

    @add.register_fake                      # optional for an @nki.jit kernel (see below)
    def _(a, b): return torch.empty_like(a)

    add.register_autograd(backward, setup_context=setup_context)

``nki_op`` takes the arguments of ``torch.library.custom_op`` (``name``, ``mutates_args``,
``device_types``, ``schema``) and returns its ``CustomOpDef``, so the op runs in eager mode on
``neuron`` (and CPU) tensors, appears as one node in ``torch.compile`` graphs, and takes
``register_fake``/``register_autograd``/``register_kernel`` like any custom op. The decorated
function is either an ``@nki.jit`` kernel (its annotated signature becomes the op's) or a
Python function that calls NKI kernels on the tensors it receives.

Neither form needs a fake implementation: by default the op's fake runs the kernel once in
the simulator (or the Python function once, on real zero tensors) on inputs of the same shapes
and dtypes (cached per shape) and returns empty tensors shaped like its outputs. Register a
fake to skip that run.
"""
from __future__ import annotations

import functools
import inspect
import typing

import torch

from .nki_bridge import np_dtype, torch_dtype_of

__all__ = ["nki_op"]


def _signature(func):
    """func's signature with string annotations resolved (custom_op infers the schema from it)."""
    sig = inspect.signature(func)
    try:
        hints = typing.get_type_hints(func)
    except (NameError, TypeError):
        hints = {}
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
    ret = hints.get("return", sig.return_annotation)
    # get_type_hints turns "-> None" into NoneType; custom_op's schema inference wants None.
    return sig.replace(parameters=params, return_annotation=None if ret is type(None) else ret)


def _kernel_impl(kernel, sig):
    def impl(*args, **kwargs):
        return kernel(*args, **kwargs)
    impl.__signature__ = sig
    impl.__name__ = kernel.func.__name__
    impl.__qualname__ = kernel.func.__qualname__
    impl.__module__ = kernel.func.__module__
    impl.__doc__ = kernel.func.__doc__
    return impl


def _shape_key(v):
    if isinstance(v, torch.Tensor):
        # An NKI kernel is built for concrete shapes (AWS compiles one per shape), so a
        # symbolic size specializes here.
        return ("T", tuple(int(n) for n in v.shape), v.dtype)
    return ("C", repr(v))


def _cached_fake(sig, outputs_of):
    """A fake implementation that learns its output metadata once per input shapes/dtypes:
    ``outputs_of(zeros, device)`` runs the real thing on zero inputs (``zeros(make)``: the
    arguments by name, each tensor replaced by ``make(shape, dtype)``) and returns the metas."""
    cache: dict = {}

    def fake(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        key = tuple((k, _shape_key(v)) for k, v in bound.arguments.items())
        device = next((v.device for v in bound.arguments.values() if isinstance(v, torch.Tensor)), None)
        metas = cache.get(key)
        if metas is None:
            def zeros(make):
                return {k: (make(kv[1], kv[2]) if kv[0] == "T" else bound.arguments[k])
                        for k, kv in key}
            metas = cache[key] = outputs_of(zeros, device)
        return _empties(metas, device)
    return fake


def _auto_fake(kernel, sig):
    """A fake implementation that learns the output shapes by simulating the kernel on zeros."""
    import numpy as np

    def outputs_of(zeros, device):
        from nki.simulator.runner import run
        np_args = zeros(lambda shape, dtype: np.zeros(shape, np_dtype(dtype)))
        out, _ = run(kernel.func, (), np_args, kernel.grid, kernel.target)
        return _metas(out)
    return _cached_fake(sig, outputs_of)


def _auto_fake_function(f, sig):
    """A fake for a Python function that calls NKI kernels: run it once per input shape and
    dtype on real zero tensors of the fake inputs' device (fake mode lifted for the run), and
    return empty tensors shaped like its outputs. Its kernels then infer their own output
    shapes, as AWS's guide expects of a wrapped function under torch.compile."""
    def outputs_of(zeros, device):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily(), torch.no_grad():
            real = zeros(lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
            return _torch_metas(f(**real))
    return _cached_fake(sig, outputs_of)


def _torch_metas(out):
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return ("T", tuple(out.shape), out.dtype)
    if isinstance(out, (tuple, list)):
        return (type(out), [_torch_metas(o) for o in out])
    raise TypeError(f"nki_op: the function returned {type(out).__name__}; return a tensor, a "
                    f"tuple of tensors or None")


def _metas(out):
    import numpy as np
    if out is None:
        return None
    if isinstance(out, np.ndarray):
        return ("T", out.shape, torch_dtype_of(out.dtype))
    if isinstance(out, (tuple, list)):
        return (type(out), [_metas(o) for o in out])
    raise TypeError(f"nki_op: kernel returned {type(out).__name__}; return a tensor, a tuple of "
                    f"tensors or None")


def _empties(meta, device):
    if meta is None:
        return None
    if meta[0] == "T":
        return torch.empty(meta[1], dtype=meta[2], device=device)
    return meta[0](_empties(m, device) for m in meta[1])


def nki_op(name, fn=None, /, *, mutates_args, device_types=None, schema=None):
    """Register ``fn`` (an ``@nki.jit`` kernel or a function calling NKI kernels) as the custom
    op ``name`` ("namespace::op"); returns a ``torch.library.CustomOpDef``. Usable as
    ``@nki_op("ns::op", mutates_args=())`` or ``nki_op("ns::op", fn, mutates_args=())``."""
    def register(f):
        from nki import Kernel
        kernel = f if isinstance(f, Kernel) else None
        target = kernel.func if kernel is not None else f
        sig = _signature(target)
        if schema is None:
            missing = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
            if missing or sig.return_annotation is inspect.Signature.empty:
                what = f"parameters {', '.join(missing)}" if missing else "the return value"
                raise ValueError(f"nki_op({name!r}): {target.__qualname__} needs type annotations "
                                 f"(e.g. torch.Tensor) on {what} to define the op's schema, or pass "
                                 f"schema=")
        impl = _kernel_impl(kernel, sig) if kernel is not None else functools.wraps(f)(
            lambda *a, **k: f(*a, **k))
        if kernel is None:
            impl.__signature__ = sig
        op = torch.library.custom_op(name, impl, mutates_args=mutates_args,
                                     device_types=device_types, schema=schema)
        op.register_fake(_auto_fake(kernel, sig) if kernel is not None else _auto_fake_function(f, sig))
        return op

    return register if fn is None else register(fn)
