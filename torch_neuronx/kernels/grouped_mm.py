"""``torch._grouped_mm`` on neuron: one grouped-GEMM kernel, as on CUDA.

PyTorch's device-generic implementation (CompositeExplicitAutograd, what a PrivateUse1
device gets by default) reads ``offs`` to the host and issues one ``mm`` per group, so on
neuron a MoE layer paid a device synchronisation and a launch per expert, and the cost
model saw G small matmuls. Here the call runs CPU's kernel once on the device tensors' host
memory (results bit-identical to CPU) and is charged as one kernel: NKI-lib's grouped
matmul at the call's shape (``torch_neuronx.kernels.nkilib_routes.grouped_mm_seconds``).
With ``NEURON_RT_STOCHASTIC_ROUNDING_EN`` on, a bf16/fp16 result is the fp32 one rounded
stochastically (``kernels.stochastic_rounding``).
"""
from __future__ import annotations

import torch

from .. import _C, cost_model
from . import stochastic_rounding
from ._meta import to_meta

_lib = torch.library.Library("aten", "IMPL")


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    dev = mat_a.device
    for name, t in (("mat2", mat_b), ("offs", offs), ("bias", bias)):
        if t is not None and t.device != dev:
            raise RuntimeError(f"aten::_grouped_mm: expected all tensors on {dev}, but {name} is "
                               f"on {t.device}")
    # A broadcast operand (autograd's gradient of a sum) has zero strides, which the kernel's
    # operand checks refuse: give it memory of its own first.
    mat_a, mat_b = (t.contiguous() if 0 in t.stride() else t for t in (mat_a, mat_b))
    # CPU's kernel reads the group offsets on the host, as PyTorch's generic one does
    # (_cpu_alias waits for the queued work on the device first).
    host = [_C._cpu_alias(t) if t is not None else None for t in (mat_a, mat_b, offs, bias)]
    idx = dev.index if dev.index is not None else torch.neuron.current_device()
    narrow = out_dtype or mat_a.dtype
    if stochastic_rounding._applies(narrow):
        # The switch on: the fp32 result, rounded once stochastically on the device, as the
        # hardware writes PSUM out (CPU's kernel would round to nearest even inside).
        torch.ops.aten._grouped_mm(*(to_meta(t) for t in (mat_a, mat_b, offs, bias)), out_dtype)  # CPU's checks
        wide = torch._grouped_mm(*(t.float() if t is not None and t.is_floating_point() else t
                                   for t in host), out_dtype=torch.float32)
        _charge(dev, mat_a, mat_b, offs, wide.nbytes // 2)
        return stochastic_rounding._round(_C._adopt_tensor(wide, idx), narrow)
    out = torch._grouped_mm(*host[:2], host[2], host[3], out_dtype)
    _charge(dev, mat_a, mat_b, offs, out.nbytes)
    return _C._adopt_tensor(out, idx)


def _charge(dev, mat_a, mat_b, offs, out_nbytes):
    from . import nkilib_routes
    dtype = cost_model.priced_dtype(mat_a.dtype)
    seconds, flops = nkilib_routes.grouped_mm_seconds(tuple(mat_a.shape), tuple(mat_b.shape),
                                                      dtype, offs)
    scale = dtype.itemsize / mat_a.dtype.itemsize
    cost_model._add_time(dev, "_grouped_mm", seconds, engine="tensor", flops=flops,
                         hbm_bytes=cost_model.priced_nbytes(mat_a)
                         + cost_model.priced_nbytes(mat_b) + round(out_nbytes * scale))


_lib.impl("_grouped_mm", _grouped_mm, "PrivateUse1")
