"""Device selection for ``torch.neuron``."""
from __future__ import annotations

import torch

from .. import _C


def device_count() -> int:
    return _C._device_count()


def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    return True


def current_device() -> int:
    return _C._current_device()


def _index(device=None, optional: bool = True) -> int:
    """The device index a user's argument names (None: the current device)."""
    if device is None:
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, but got: {device}")
        return current_device() if device.index is None else device.index
    if isinstance(device, int):
        return device
    raise TypeError(f"Expected a neuron device (int, str or torch.device), got {type(device).__name__}")


def set_device(device) -> None:
    idx = _index(device)
    if idx >= 0:
        _C._set_device(idx)


class device:
    """Context manager that makes ``device`` current for the block."""

    def __init__(self, device):
        self.idx = -1 if device is None else _index(device)
        self.prev = -1

    def __enter__(self):
        self.prev = current_device()
        if self.idx >= 0 and self.idx != self.prev:
            _C._set_device(self.idx)

    def __exit__(self, *exc):
        if self.idx >= 0 and self.prev != current_device():
            _C._set_device(self.prev)
        return False


class device_of(device):
    """Context manager that makes the device of ``obj`` (a tensor) current."""

    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "neuron" else None)


def synchronize(device=None) -> None:
    """Wait for all queued work on the device (queues drain as work is issued)."""
    torch._C._accelerator_synchronizeDevice(_index(device))
