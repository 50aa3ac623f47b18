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

__all__ = ["can_device_access_peer", "default_generators", "get_arch_list",
           "get_per_process_memory_fraction", "get_sync_debug_mode",
           "is_tf32_supported", "max_memory_cached", "memory_cached", "memory_stats_as_nested_dict",
           "reset_max_memory_allocated", "reset_max_memory_cached", "set_sync_debug_mode"]
