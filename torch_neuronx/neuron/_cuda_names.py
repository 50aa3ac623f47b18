"""``torch.cuda`` names that CUDA programs call and that have a direct meaning on the
virtual NeuronCore: deprecated memory aliases, memory-pool queries, peer access and the
sync-debug switch. Each answers as CUDA's does for a device with these properties."""
from __future__ import annotations

import collections
import warnings

import torch

from .. import _state
from ._device import _index, device_count
from .memory import (max_memory_allocated, max_memory_reserved, memory_reserved, memory_stats,
                     reset_peak_memory_stats)
from .random import _generator


def memory_cached(device=None) -> int:
    """Deprecated CUDA alias of ``memory_reserved``."""
    warnings.warn("torch.neuron.memory_cached has been renamed to memory_reserved",
                  FutureWarning, stacklevel=2)
    return memory_reserved(device)


def max_memory_cached(device=None) -> int:
    """Deprecated CUDA alias of ``max_memory_reserved``."""
    warnings.warn("torch.neuron.max_memory_cached has been renamed to max_memory_reserved",
                  FutureWarning, stacklevel=2)
    return max_memory_reserved(device)


def reset_max_memory_allocated(device=None) -> None:
    """As CUDA's: resets every peak statistic (it is ``reset_peak_memory_stats``)."""
    warnings.warn("torch.neuron.reset_max_memory_allocated now calls reset_peak_memory_stats, "
                  "which resets all peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device=None) -> None:
    warnings.warn("torch.neuron.reset_max_memory_cached now calls reset_peak_memory_stats, "
                  "which resets all peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def memory_stats_as_nested_dict(device=None) -> dict:
    """``memory_stats`` before flattening: ``"a.b.c"`` keys become nested dicts."""
    out: dict = {}
    for key, value in memory_stats(device).items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def get_per_process_memory_fraction(device=None) -> float:
    """The fraction set by ``set_per_process_memory_fraction`` (1.0 when none was set)."""
    from .memory import _fractions
    return _fractions.get(_index(device), 1.0)


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

# Raw blocks handed out by caching_allocator_alloc, by address: each stays alive (and
# counted in memory_allocated) until caching_allocator_delete.
_raw_blocks: dict = {}


def caching_allocator_alloc(size: int, device=None, stream=None) -> int:
    """``size`` bytes from the device's caching allocator, on ``stream`` (the device's current
    stream by default); returns the block's address, 0 for ``size`` 0, as CUDA's."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise TypeError(f"caching_allocator_alloc: expected a byte count (int >= 0), got {size!r}")
    idx = _index(device)
    if size == 0:
        return 0
    from . import streams
    s = stream if stream is not None else streams.current_stream(idx)
    if not isinstance(s, streams.Stream) or s.device_index != idx:
        raise TypeError(f"caching_allocator_alloc: stream must be a torch.neuron.Stream of "
                        f"neuron:{idx}, got {s!r}")
    with streams.stream(s):
        block = torch.UntypedStorage(size, device=torch.device("neuron", idx))
    _raw_blocks[block.data_ptr()] = block
    return block.data_ptr()


def caching_allocator_delete(mem_ptr: int) -> None:
    """Returns a block from ``caching_allocator_alloc`` to the allocator (0 is ignored)."""
    if mem_ptr == 0:
        return
    if _raw_blocks.pop(mem_ptr, None) is None:
        raise RuntimeError(f"caching_allocator_delete: {mem_ptr:#x} is not an address "
                           "caching_allocator_alloc returned, or it was deleted already")


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
