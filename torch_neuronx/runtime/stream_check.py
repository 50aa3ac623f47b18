"""The stream checker: reports unordered cross-stream accesses to one device buffer.

On the chip every stream is an independent queue, so a buffer written on one stream and read
or written on another needs an event, ``wait_stream`` or a synchronize between the two. With
the checker on (``TORCH_NEURONX_STREAM_CHECK=1``, or ``with torch_neuronx.stream_check():``)
the runtime tracks, per buffer, which stream last wrote and read it and, with vector clocks,
what each stream has waited for; an op that completes a race raises ``RuntimeError`` naming
both ops, both streams and both source lines. A tensor freed while another stream used it,
without ``record_stream``, is reported when its memory is next written.
"""
from __future__ import annotations

import os

from .. import _C


def enabled() -> bool:
    return _C._stream_check_enabled()


class stream_check:
    """Turn the stream checker on for a block (history starts empty each time)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._prev = False

    def __enter__(self):
        self._prev = _C._stream_check_enabled()
        _C._set_stream_check(self.enabled)
        return self

    def __exit__(self, *exc):
        _C._set_stream_check(self._prev)
        return False


def _from_environment() -> None:
    if os.environ.get("TORCH_NEURONX_STREAM_CHECK", "0") not in ("", "0"):
        _C._set_stream_check(True)
