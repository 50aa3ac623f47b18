"""``rms_norm`` on neuron charged as NKI-lib's ``rmsnorm_tkg``; norms executed by NKI-lib's
kernels under ``TORCH_NEURONX_NKI_EXECUTE=1``.

``rms_norm`` is a composite op: on CPU, and so on neuron, it runs as pow, mean, add, rsqrt
and mul. The kernel here calls that same composite with autograd active, so results and
gradients are CPU's bit for bit; only the forward's modelled time changes: its ops run
unrecorded and the call is charged as one launch of ``rmsnorm_tkg`` at its shape
(``nkilib_routes.charged_as``, priced by ``cost_model.op_seconds``). The backward keeps its
ops' roofline cost (NKI-lib has no norm backward kernel). ``layer_norm`` needs nothing here:
it runs as the single op ``native_layer_norm``, which the cost model prices as
``layernorm_tkg`` from the runtime's record. Calls the kernel does not cover, and calls seen
while tracing (fake, functional or functorch-wrapped tensors) or during graph capture, run
the composite charged as its ops, with a debug log on ``torch_neuronx.nkilib`` where a
device call is declined.

Under ``TORCH_NEURONX_NKI_EXECUTE=1`` (read at import) the forward of both is NKI-lib's
kernel run in the simulator (charged its simulated time by the NKI bridge): ``rms_norm``'s
backward recomputes CPU's composite and differentiates it; ``native_layer_norm`` returns
CPU's mean and rstd beside the kernel's output, for its backward.
"""
from __future__ import annotations

import functools
import math

import torch
from torch._C import DispatchKey

from .. import _C, _state, cost_model
from . import nkilib_routes as routes

_COMPOSITE = DispatchKey.CompositeImplicitAutograd
_RMS = torch.ops.aten.rms_norm.default


def _device_tensor(t) -> bool:
    """A tensor of the device itself, not a tracer's stand-in for one."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "neuron"
            and not torch._is_functional_tensor(t)
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    args = (input, normalized_shape, weight, eps)
    if not (_device_tensor(input) and (weight is None or _device_tensor(weight))):
        return _RMS._op_dk(_COMPOSITE, *args)
    stream = torch.neuron.current_stream(input.device)
    if _C._is_capturing(stream.device_index, stream.stream_id):
        routes._decline("rms_norm", "graph capture (replays charge the ops)")
        return _RMS._op_dk(_COMPOSITE, *args)
    if routes.EXECUTE:
        out = _execute_rms_norm(*args)
        if out is not None:
            return out
    cfg = _state.config()
    dtype = cost_model.priced_dtype(input.dtype)
    priced = _priced(cfg.profile.name, cfg.lnc, tuple(input.shape),
                     tuple(int(s) for s in normalized_shape), dtype,
                     None if weight is None else cost_model.priced_dtype(weight.dtype))
    if priced is None:
        return _RMS._op_dk(_COMPOSITE, *args)
    seconds, engine, shapes, bytes_in, bytes_out = priced
    with routes.charged_as(input.device, "rms_norm", seconds, engine=engine,
                           hbm_bytes=bytes_in + bytes_out, shapes=shapes, dtype=dtype,
                           bytes_in=bytes_in, bytes_out=bytes_out):
        return _RMS._op_dk(_COMPOSITE, *args)


@functools.lru_cache(maxsize=1024)
def _priced(chip, lnc, shape, normalized_shape, dtype, weight_dtype):
    """(seconds, engine, shapes, bytes in, bytes out) of the call as one rmsnorm_tkg launch
    on ``chip`` (the selected profile's name), or None when the kernel does not cover it
    (logged once per shape)."""
    p = _state.config().profile
    shapes = (shape, normalized_shape)
    if routes.norm_kernel_seconds("rms_norm", p, lnc, shapes, dtype) is None:
        return None
    numel = math.prod(shape)
    out_dtype = dtype if weight_dtype is None else torch.promote_types(dtype, weight_dtype)
    bytes_in = numel * dtype.itemsize + (0 if weight_dtype is None else
                                         math.prod(normalized_shape) * weight_dtype.itemsize)
    bytes_out = numel * out_dtype.itemsize
    seconds, engine, _ = cost_model.op_seconds(p, lnc, "rms_norm", list(shapes), dtype,
                                               bytes_in, bytes_out)
    return seconds, engine, shapes, bytes_in, bytes_out


_lib = torch.library.Library("aten", "IMPL")
_lib.impl("rms_norm", _rms_norm, "AutogradPrivateUse1")
_lib.impl("rms_norm", _rms_norm, "PrivateUse1")     # inference mode, where autograd is skipped


# ----------------------------------------------------------------------- execution mode
def _covered(op, x, H, params) -> bool:
    if x.dtype not in routes._DTYPES or x.numel() == 0 or H == 0:
        routes._decline(op, f"dtype {x.dtype} or an empty input (execution mode)")
        return False
    if any(t is not None and (t.dtype != x.dtype or t.numel() != H) for t in params):
        routes._decline(op, "weight or bias of another dtype or shape (execution mode)")
        return False
    return True


def _kernel(op, x, H, weight, bias, eps):
    """``rmsnorm_tkg`` / ``layernorm_tkg`` over the call's rows."""
    def row(t):
        return t.reshape(1, H).contiguous() if t is not None else None
    g = row(weight) if weight is not None else torch.ones(1, H, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, H).contiguous()
    if op == "rms_norm":
        out = routes.on_cores(routes.rmsnorm_tkg)(x2, g, eps=float(eps))
    else:
        out = routes.on_cores(routes.layernorm_tkg)(x2, g, beta=row(bias), eps=float(eps))
    return out.reshape(x.shape)


def _execute_rms_norm(input, normalized_shape, weight, eps):
    H = math.prod(int(s) for s in normalized_shape)
    if not _covered("rms_norm", input, H, (weight,)):
        return None
    # ATen's default: the epsilon of the op math type (float32 for every covered dtype)
    eps = eps if eps is not None else torch.finfo(torch.float32).eps
    return _ExecutedRMSNorm.apply(normalized_shape, eps, H, input, weight)


class _ExecutedRMSNorm(torch.autograd.Function):
    """Forward: NKI-lib's kernel. Backward: CPU's composite recomputed and differentiated."""

    @staticmethod
    def forward(ctx, normalized_shape, eps, H, input, weight):
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        ctx.save_for_backward(input, weight)
        return _kernel("rms_norm", input, H, weight, None, eps)

    @staticmethod
    def backward(ctx, grad):
        x, w = (t.detach().requires_grad_(need) if t is not None else None
                for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[3:]))
        wrt = [t for t in (x, w) if t is not None and t.requires_grad]
        with torch.enable_grad():
            out = _RMS._op_dk(_COMPOSITE, x, ctx.normalized_shape, w, ctx.eps)
            got = iter(torch.autograd.grad(out, wrt, grad))
        return (None, None, None, *(next(got) if t is not None and t.requires_grad else None
                                    for t in (x, w)))


def _execute_layer_norm(input, normalized_shape, weight, bias, eps):
    op = torch.ops.aten.native_layer_norm.default
    # CPU's statistics: native_layer_norm_backward reads them
    out, mean, rstd = routes._on_cpu(op, input, normalized_shape, weight, bias, eps)
    H = math.prod(int(s) for s in normalized_shape)
    if not _covered("native_layer_norm", input, H, (weight, bias)):
        return out, mean, rstd
    return _kernel("native_layer_norm", input, H, weight, bias, eps), mean, rstd


if routes.EXECUTE:
    _lib.impl("native_layer_norm", _execute_layer_norm, "PrivateUse1")
