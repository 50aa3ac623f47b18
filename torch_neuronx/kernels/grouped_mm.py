"""``torch._grouped_mm`` on neuron: one grouped-GEMM kernel, as on CUDA.

PyTorch's device-generic implementation (CompositeExplicitAutograd, what a PrivateUse1
device gets by default) reads ``offs`` to the host and issues one ``mm`` per group, so on
neuron a MoE layer paid a device synchronisation and a launch per expert, and the cost
model saw G small matmuls. Here the call runs CPU's kernel once on the device tensors' host
memory (results bit-identical to CPU), queued on the stream like any device work
(``csrc/aten/grouped_mm.cpp``), and is charged as one kernel: NKI-lib's grouped matmul at the
call's shape (``torch_neuronx.kernels.nkilib_routes.grouped_mm_seconds``).
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
    narrow = out_dtype or mat_a.dtype
    shape = _shape(mat_a, mat_b, offs, bias)
    # The stochastic-rounding switch on: the fp32 result, rounded once stochastically on the
    # device, as the hardware writes PSUM out (CPU's kernel would round to nearest even inside).
    rounded = stochastic_rounding._applies(narrow)
    operands = (mat_a, mat_b, offs, bias)
    if rounded:
        operands = tuple(t.float() if t is not None and t.is_floating_point() else t for t in operands)
    if shape is None:
        # Inputs the checks on meta tensors refuse: CPU's kernel now, on the host (it raises
        # its own error, or accepts what only CUDA refuses), once the queue has run
        host = [_C._cpu_alias(t) if t is not None else None for t in operands]
        out = _C._adopt_tensor(torch._grouped_mm(*host, torch.float32 if rounded else out_dtype),
                               dev.index if dev.index is not None else torch.neuron.current_device())
    else:
        out = _launch(*operands, torch.float32 if rounded else narrow, shape)
    _charge(dev, mat_a, mat_b, offs, out.numel() * narrow.itemsize)
    return stochastic_rounding._round(out, narrow) if rounded else out


def _layout(t):
    """What a meta function can see of a tensor: its metadata, not its values."""
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
            t.untyped_storage().nbytes())


# Meta results by the operands' layouts: a MoE layer calls with the same few every step, and
# the meta function costs more than the launch (tens of microseconds of Python).
_SHAPES: dict = {}


def _shape(mat_a, mat_b, offs, bias):
    key = tuple(_layout(t) for t in (mat_a, mat_b, offs, bias))
    try:
        return _SHAPES[key]
    except KeyError:
        pass
    if len(_SHAPES) >= 4096:
        _SHAPES.clear()
    shape = _SHAPES[key] = _meta_shape(mat_a, mat_b, offs, bias)
    return shape


def _meta_shape(mat_a, mat_b, offs, bias):
    """The result's shape from PyTorch's meta function, which carries CUDA's checks; None
    where they refuse. Its dtype check (bf16 only, CUDA's) is passed with bf16 stand-ins: CPU
    also takes fp32 and fp16. The offsets' values are read by the kernel on the queue, as on
    CUDA."""
    def stand_in(t):
        if t is None:
            return None
        m = to_meta(t)
        return m.to(torch.bfloat16) if m.is_floating_point() else m
    try:
        return torch.ops.aten._grouped_mm(*(stand_in(t) for t in (mat_a, mat_b, offs, bias))).shape
    except RuntimeError:
        return None


_GROUPED_MM = _C._grouped_mm_entry()


def _launch(mat_a, mat_b, offs, bias, dtype, shape):
    """A new device tensor of ``shape`` and ``dtype``: CPU's grouped GEMM, queued."""
    out = torch.empty(shape, dtype=dtype, device=mat_a.device)
    tensors = (mat_a, mat_b, offs, bias, out)
    # each tensor's data word (as an argument it stays alive while queued; an absent one 0),
    # then its TensorImpl for the kernel to rebuild it, then out's ScalarType
    kinds = "".join("i" if t is None else ("w" if t is out else "r") for t in tensors)
    impls = [(0, 0) if t is None else _C._tensor_impl(t) for t in tensors]
    args = [0 if t is None else t for t in tensors] + [i for i, _ in impls] + [impls[-1][1]]
    # A GEMM's work far outweighs its operands' bytes: weighed as the bytes a memory-bound op
    # of about its duration moves, so the host sleeps rather than spin on a core it needs.
    work = out.numel() * mat_a.size(-1) // 16
    _C._launch_kernel(_GROUPED_MM, "_grouped_mm", kinds + "i" * 6 + "h", *args, work)
    return out


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
