"""The device-to-device copies behind ``nn.DataParallel`` and ``torch.nn.parallel.comm``.

``comm.broadcast``, ``broadcast_coalesced``, ``scatter`` and ``gather`` are written for any
accelerator in Python, but call ``torch._C._broadcast``, ``_broadcast_coalesced``,
``_scatter``, ``_gather`` (and their ``_out`` forms), which torch compiles only into its CUDA
builds (``torch/csrc/cuda/comm.cpp``). On this wheel ``nn.DataParallel(model)`` over neuron
devices therefore failed at its first scatter. These are CUDA's functions for neuron tensors:
the same arguments, checks and results (a tensor already on a target device is returned
uncopied; a gather to ``-1`` lands on the CPU), each copy queued non-blocking on the target
device, ordered by the runtime's streams as CUDA's copies are by its own. They are installed
only where ``torch._C`` lacks them, so a CUDA build keeps its own.
"""
from __future__ import annotations

import contextlib

import torch
from torch._utils import _flatten_dense_tensors, _take_tensors, _unflatten_dense_tensors

__all__ = ["broadcast", "broadcast_coalesced", "gather", "reduce_add", "reduce_add_coalesced",
           "scatter"]


def _device(index) -> torch.device:
    return torch.device(torch._C._get_privateuse1_backend_name(),
                        torch.neuron.current_device() if index is None or index < 0 else index)


def _on(tensor, index) -> bool:
    return tensor.device.type == _device(index).type and tensor.get_device() == index


def _check_device_tensor(t, what):
    if t.device.type != _device(None).type:
        raise RuntimeError(f"{what}: expected a neuron tensor, but got one on {t.device}")


def _stream(streams, i):
    s = streams[i] if streams else None
    return torch.neuron.stream(s) if s is not None else contextlib.nullcontext()


def _broadcast(tensor, devices):
    return [tensor if _on(tensor, d) else tensor.to(_device(d), non_blocking=True)
            for d in devices]


def _broadcast_out(tensor, out_tensors):
    for i, o in enumerate(out_tensors):
        _check_device_tensor(o, f"broadcast: output {i}")
        if o.shape != tensor.shape:
            raise RuntimeError(f"broadcast: output {i} has shape {tuple(o.shape)}, expected "
                               f"the input's {tuple(tensor.shape)}")
    for o in out_tensors:
        o.copy_(tensor, non_blocking=True)
    return list(out_tensors)


def _broadcast_coalesced(tensors, devices, buffer_size):
    """As CUDA's: the first device keeps the inputs; the others get copies, small dense
    tensors flattened into buckets of at most ``buffer_size`` bytes so each bucket is one
    copy per device. Copies are detached, with version counters of their own."""
    if not devices:
        raise RuntimeError("broadcast_coalesced: expected at least one device")
    for i, t in enumerate(tensors):
        if not _on(t, devices[0]):
            raise RuntimeError(f"broadcast_coalesced: all tensors must be on devices[0] "
                               f"({_device(devices[0])}), but tensor {i} is on {t.device}")
    outputs = [list(tensors)] + [[None] * len(tensors) for _ in devices[1:]]
    # _take_tensors groups by type, so each copy finds its slot again (a tensor listed twice
    # has two slots, filled in order)
    slots = {}
    for i, t in enumerate(tensors):
        slots.setdefault(id(t), []).append(i)
    for t in tensors:
        if t.is_sparse:
            i = slots[id(t)].pop(0)
            for k, copy in enumerate(_broadcast(t, devices[1:]), 1):
                outputs[k][i] = copy
    for bucket in _take_tensors([t for t in tensors if not t.is_sparse], buffer_size):
        flat = _flatten_dense_tensors(bucket)
        where = [slots[id(t)].pop(0) for t in bucket]
        for k, d in enumerate(devices[1:], 1):
            pieces = _unflatten_dense_tensors(flat.to(_device(d), non_blocking=True), bucket)
            for i, piece in zip(where, pieces):
                outputs[k][i] = piece.data
    return outputs


def _scatter(tensor, devices, chunk_sizes=None, dim=0, streams=None):
    if not devices:
        raise RuntimeError("scatter: expected at least one device to scatter to")
    if streams is not None and len(streams) != len(devices):
        raise RuntimeError(f"scatter: expected as many streams ({len(streams)}) as devices "
                           f"({len(devices)})")
    dim = dim % max(1, tensor.dim())
    if chunk_sizes is not None:
        if len(chunk_sizes) != len(devices):
            raise RuntimeError(f"scatter: expected as many chunk sizes ({len(chunk_sizes)}) "
                               f"as devices ({len(devices)})")
        if any(c <= 0 for c in chunk_sizes):
            raise RuntimeError(f"scatter: chunk sizes must be positive, got {list(chunk_sizes)}")
        if sum(chunk_sizes) != tensor.size(dim):
            raise RuntimeError(f"scatter: chunk sizes {list(chunk_sizes)} must add up to the "
                               f"size of dimension {dim} of the input ({tensor.size(dim)})")
        chunks = tensor.split_with_sizes(list(chunk_sizes), dim)
    else:
        chunks = tensor.chunk(len(devices), dim)
    out = []
    for i, chunk in enumerate(chunks):
        with _stream(streams, i):
            out.append(chunk.to(_device(devices[i]), non_blocking=True))
    return out


def _scatter_out(tensor, out_tensors, dim=0, streams=None):
    dim = dim % max(1, tensor.dim())
    sizes = [o.size(dim) for o in out_tensors]
    if sum(sizes) != tensor.size(dim):
        raise RuntimeError(f"scatter: the outputs' sizes {sizes} along dimension {dim} must add "
                           f"up to the input's {tensor.size(dim)}")
    for i, (o, chunk) in enumerate(zip(out_tensors, tensor.split_with_sizes(sizes, dim))):
        _check_device_tensor(o, f"scatter: output {i}")
        if o.shape != chunk.shape:
            raise RuntimeError(f"scatter: output {i} has shape {tuple(o.shape)}, expected "
                               f"{tuple(chunk.shape)}")
        with _stream(streams, i):
            o.copy_(chunk, non_blocking=True)
    return list(out_tensors)


def _gather_shape(tensors, dim):
    if not tensors:
        raise RuntimeError("gather: expected at least one tensor to gather from")
    first = tensors[0]
    dim = dim % max(1, first.dim())
    total = 0
    for i, t in enumerate(tensors):
        _check_device_tensor(t, f"gather: input {i}")
        if t.dim() != first.dim() or any(a != b for k, (a, b) in
                                          enumerate(zip(t.shape, first.shape)) if k != dim):
            raise RuntimeError(f"gather: input {i} has shape {tuple(t.shape)}, which does not "
                               f"match input 0's {tuple(first.shape)} outside dimension {dim}")
        total += t.size(dim)
    shape = list(first.shape)
    shape[dim] = total
    return shape, dim


def _gather_into(tensors, out, dim):
    offset = 0
    for t in tensors:
        out.narrow(dim, offset, t.size(dim)).copy_(t, non_blocking=out.device.type != "cpu")
        offset += t.size(dim)
    return out


def _memory_format(t):
    for fmt, nd in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if t.dim() == nd and not t.is_contiguous() and t.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


def _gather(tensors, dim=0, destination_index=None):
    shape, dim = _gather_shape(tensors, dim)
    device = torch.device("cpu") if destination_index == -1 else _device(destination_index)
    formats = {_memory_format(t) for t in tensors}
    fmt = formats.pop() if len(formats) == 1 else torch.contiguous_format
    out = torch.empty(shape, dtype=tensors[0].dtype, device=device, memory_format=fmt)
    return _gather_into(tensors, out, dim)


def _gather_out(tensors, out_tensor, dim=0):
    shape, dim = _gather_shape(tensors, dim)
    if list(out_tensor.shape) != shape:
        raise RuntimeError(f"gather: out has shape {tuple(out_tensor.shape)}, expected "
                           f"{tuple(shape)}")
    return _gather_into(tensors, out_tensor, dim)


_PRIMITIVES = {"_broadcast": _broadcast, "_broadcast_out": _broadcast_out,
               "_broadcast_coalesced": _broadcast_coalesced, "_scatter": _scatter,
               "_scatter_out": _scatter_out, "_gather": _gather, "_gather_out": _gather_out}


def install() -> None:
    for name, fn in _PRIMITIVES.items():
        if not hasattr(torch._C, name):
            setattr(torch._C, name, fn)


# ``torch.neuron.comm`` holds what ``torch.cuda.comm`` holds: torch's functions themselves.
from torch.nn.parallel.comm import (broadcast, broadcast_coalesced, gather,  # noqa: E402,F401
                                    reduce_add, reduce_add_coalesced, scatter)
