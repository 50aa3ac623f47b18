"""The CPU tensors gloo works on for one collective: zero-copy aliases of device memory
(device memory is host memory), staged copies of non-contiguous tensors, and the steps that
finish a collective on the host (AVG's division, copying staged results back)."""
from __future__ import annotations

import torch


def _find_runtime_alias():
    from .. import _C
    return getattr(_C, "_cpu_alias", None)


_runtime_alias = _find_runtime_alias()


def cpu_alias(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same memory as neuron tensor ``t`` (same sizes, strides, offset).

    The device runtime's ``_C._cpu_alias`` keeps the device storage alive; the fallback here
    (for runtimes without it) does not own the memory, so callers keep ``t`` alive anyway.
    """
    if _runtime_alias is not None:
        return _runtime_alias(t)
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    cpu_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), torch.device("cpu"), storage.nbytes())
    return torch.empty(0, dtype=t.dtype).set_(cpu_storage, t.storage_offset(), t.size(), t.stride())


class HostTensors:
    """The CPU tensors gloo uses for one collective, and what to do once it completes."""

    __slots__ = ("keep", "fixups", "copyback")

    def __init__(self):
        self.keep = []       # device tensors whose memory gloo is using
        self.fixups = []     # run first on completion (AVG division), on host tensors
        self.copyback = []   # then copy staged results into non-contiguous outputs

    def get(self, t: torch.Tensor, write: bool, as_bytes: bool = False) -> torch.Tensor:
        if t.device.type == "neuron":
            self.keep.append(t)
            h = cpu_alias(t)
        else:
            h = t
        if not h.is_contiguous():
            staged = h.contiguous()
            if write:
                self.copyback.append((h, staged))
            h = staged
        if as_bytes:
            h = h.reshape(-1).view(torch.uint8) if h.dim() else h.reshape(1).view(torch.uint8)
        return h

    def finish(self) -> None:
        for f in self.fixups:
            f()
        for dst, src in self.copyback:
            dst.copy_(src)
        self.keep = []
