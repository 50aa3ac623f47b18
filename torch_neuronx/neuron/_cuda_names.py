"""``torch.cuda`` names that CUDA programs call and that have a direct meaning on the
virtual NeuronCore: peer access, the sync-debug switch, ``torch.cuda.memory``'s deprecated
aliases and raw blocks (defined in ``memory``, as CUDA's are). Each answers as CUDA's does
for a device with these properties."""
from __future__ import annotations

import collections

import torch

from .. import _state
from ._device import _index, device_count
from .memory import (caching_allocator_alloc, caching_allocator_delete,  # noqa: F401
                     get_per_process_memory_fraction, max_memory_cached, memory_cached,
                     memory_stats_as_nested_dict, reset_max_memory_allocated,
                     reset_max_memory_cached)
from .random import _generator


def can_device_access_peer(device, peer_device) -> bool:
    """Every virtual core's memory is this process's host memory, so any two distinct visible
    cores can read each other's tensors; CUDA answers False for a device and itself."""
    a, b = _index(device), _index(peer_device)
    n = device_count()
    for i in (a, b):
        if not 0 <= i < n:
            raise RuntimeError(f"Invalid device index neuron:{i}: there are {n} visible "
                               "neuron device(s)")
    return a != b


def get_arch_list() -> list:
    """The NeuronCore version the runtime models, where CUDA lists its sm_* targets."""
    return [_state.config().profile.core_version]


_sync_debug_mode = 0


def set_sync_debug_mode(debug_mode) -> None:
    """Stored and reported like CUDA's (0/"default", 1/"warn", 2/"error"); host syncs on this
    device are free, so no op warns."""
    global _sync_debug_mode
    names = {"default": 0, "warn": 1, "error": 2}
    if isinstance(debug_mode, str):
        if debug_mode not in names:
            raise RuntimeError('invalid value of debug_mode, expected one of "default", '
                               f'"warn", "error", got {debug_mode!r}')
        debug_mode = names[debug_mode]
    if debug_mode not in (0, 1, 2):
        raise RuntimeError(f"invalid value of debug_mode {debug_mode}, expected 0, 1 or 2")
    _sync_debug_mode = int(debug_mode)


def get_sync_debug_mode() -> int:
    return _sync_debug_mode


def is_tf32_supported() -> bool:
    """Trainium's matmul engine has no TF32 mode that changes fp32 results."""
    return False


OutOfMemoryError = torch.OutOfMemoryError  # as torch.cuda.OutOfMemoryError

def device_memory_used(device=None) -> int:
    """Device memory in use, as nvidia-smi reports it for CUDA: the modelled HBM less what is
    free (``mem_get_info``)."""
    from .memory import mem_get_info
    free, total = mem_get_info(device)
    return total - free


class _DefaultGenerators(collections.abc.Sequence):
    """``torch.neuron.default_generators``: one generator per visible device, as CUDA's."""

    def __len__(self):
        return device_count()

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        if not -len(self) <= i < len(self):
            raise IndexError(f"neuron default_generators index {i} out of range")
        return _generator(i % len(self))


default_generators = _DefaultGenerators()

__all__ = ["OutOfMemoryError", "caching_allocator_alloc", "caching_allocator_delete",
           "can_device_access_peer", "default_generators", "device_memory_used", "get_arch_list",
           "get_per_process_memory_fraction", "get_sync_debug_mode",
           "is_tf32_supported", "max_memory_cached", "memory_cached", "memory_stats_as_nested_dict",
           "reset_max_memory_allocated", "reset_max_memory_cached", "set_sync_debug_mode"]
