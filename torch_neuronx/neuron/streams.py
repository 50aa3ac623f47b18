"""Streams and events of ``torch.neuron``.

Each stream is an in-order queue of the device. Work executes when it is issued, so every
queue is drained by the time the host looks at it; events carry the device clock for
``elapsed_time``.
"""
from __future__ import annotations

import torch

from ._device import _index


class Stream(torch.Stream):
    """``torch.neuron.Stream(device=None, priority=0)``: a new in-order queue."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if kwargs:  # rebuilt from (stream_id, device_index, device_type)
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device("neuron", _index(device)), priority=priority)

    def __repr__(self):
        return f"<torch.neuron.Stream device=neuron:{self.device_index} stream_id={self.stream_id}>"

    # One in-order executor serves all of a device's streams, so they share one priority
    # level: as CUDA clamps a requested priority into its range, every stream reports 0.
    @property
    def priority(self) -> int:
        return 0

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(least, greatest) priority, as ``torch.cuda.Stream.priority_range()``: (0, 0)."""
        return (0, 0)


class _EventMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.Event) and obj.device.type == "neuron"


class Event(metaclass=_EventMeta):
    """``torch.neuron.Event(enable_timing=False, blocking=False, interprocess=False)``.

    Returns a ``torch.Event`` on the current neuron device: PyTorch's event methods accept
    only that exact type, so this is a constructor rather than a subclass.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return torch.Event(device=torch.device("neuron", torch.accelerator.current_device_index()),
                           enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device=None) -> Stream:
    return _wrap(torch.accelerator.current_stream(_index(device)))


def default_stream(device=None) -> Stream:
    idx = _index(device)
    return Stream(stream_id=0, device_index=idx,
                  device_type=torch.accelerator.current_stream(idx).device_type)


def set_stream(stream) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes ``stream`` current on its device for the ``with`` block. As CUDA's: setting a
    stream also makes its device current, so on exit the stream's device gets its previous
    stream back and then the device current at entry gets its own (which makes that device
    current again)."""

    def __init__(self, stream):
        self.stream = stream
        self._src_prev = self._dst_prev = None

    def __enter__(self):
        if self.stream is None:
            return None
        self._src_prev = torch.accelerator.current_stream()
        if self._src_prev.device_index != self.stream.device_index:
            self._dst_prev = torch.accelerator.current_stream(self.stream.device_index)
        torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self._dst_prev is not None:
            torch.accelerator.set_stream(self._dst_prev)
        if self._src_prev is not None:
            torch.accelerator.set_stream(self._src_prev)
        self._src_prev = self._dst_prev = None
        return False


def stream(stream) -> StreamContext:
    return StreamContext(stream)
