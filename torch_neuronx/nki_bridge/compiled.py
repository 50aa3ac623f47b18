"""An ``@nki.jit`` kernel called inside ``torch.compile``: one ``nki_jit::call`` graph node.

AWS: inside ``torch.compile`` a kernel call becomes one node in the captured graph. Dynamo
cannot trace the simulator (NumPy), so while compiling ``Kernel.__call__`` routes through this
one generic custom op. Its arguments are the kernel's registry key, the non-tensor arguments
as a literal string, and the tensor arguments. The op is declared functional (PyTorch cannot
functionalize a custom op with a mutable tensor list), so a kernel that writes an input
raises here: declare the mutation with ``torch_neuronx.nki_op(..., mutates_args=...)``. Its fake runs the kernel once per shape on zeros
(see ``torch_neuronx.nki_op``). Results come back as a list: one tensor is returned as
itself, none as ``None``, several as a tuple. ``nki_op`` gives an exact schema instead.
"""
from __future__ import annotations

import ast

import torch

from nki.simulator.runner import KERNEL_FUNCS, run

from . import np_dtype, torch_dtype_of


_LITERALS = (int, float, bool, str, type(None))


def _literal(v):
    if isinstance(v, _LITERALS):
        return True
    if isinstance(v, tuple):
        return all(_literal(x) for x in v)
    return False


def _rebuild(template: str, tensors):
    launch, args, kwargs = ast.literal_eval(template)

    def dec(v):
        return tensors[v[1]] if isinstance(v, tuple) and len(v) == 2 and v[0] == "__nki_tensor__" else v
    return launch, ([dec(a) for a in args], {k: dec(v) for k, v in kwargs.items()})


def _run(kernel_key: str, template: str, tensors: list) -> list:
    func = KERNEL_FUNCS[kernel_key]
    (grid, target), (args, kwargs) = _rebuild(template, tensors)
    out, _ = run(func, args, kwargs, grid, target, readonly_inputs=True)
    if out is None:
        return []
    return list(out) if isinstance(out, (tuple, list)) else [out]


@torch.library.custom_op("nki_jit::call", mutates_args=())
def _call(kernel: str, template: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # Results never alias inputs: the runner returns fresh tensors (a returned input is copied).
    return _run(kernel, template, tensors)


@_call.register_fake
def _(kernel, template, tensors):
    import numpy as np
    key = (kernel, template, tuple((tuple(int(n) for n in t.shape), t.dtype) for t in tensors))
    metas = _FAKE_CACHE.get(key)
    if metas is None:
        # NumPy zeros, not torch tensors: under the fake mode torch would make fake tensors.
        zeros = [np.zeros(s, np_dtype(d)) for s, d in key[2]]
        metas = _FAKE_CACHE[key] = [(o.shape, torch_dtype_of(o.dtype)) for o in _run(kernel, template, zeros)]
    device = tensors[0].device if tensors else None
    return [torch.empty(s, dtype=d, device=device) for s, d in metas]


_FAKE_CACHE: dict = {}


def call(kernel, args, kwargs):
    """Kernel.__call__ while torch.compile traces: the graph records one nki_jit::call."""
    tensors = []

    def enc(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return ("__nki_tensor__", len(tensors) - 1)
        if not _literal(v):
            raise TypeError(f"NKI kernel {kernel.func.__name__!r} under torch.compile: argument "
                            f"{v!r} is neither a tensor nor a literal (int/float/bool/str/None/"
                            f"tuple); wrap the kernel with torch_neuronx.nki_op")
        return v
    launch = (tuple(kernel.grid), kernel.target)
    template = repr((launch, [enc(a) for a in args], {k: enc(v) for k, v in kwargs.items()}))
    outs = torch.ops.nki_jit.call(kernel._nki_key, template, tensors)
    if len(outs) == 0:
        return None
    return outs[0] if len(outs) == 1 else tuple(outs)
