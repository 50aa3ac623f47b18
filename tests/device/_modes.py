"""Context managers that switch a runtime mode for a block and restore it."""
from __future__ import annotations

import contextlib

import torch_neuronx


@contextlib.contextmanager
def _switched(get, set_, on: bool):
    prev = get()
    set_(on)
    try:
        yield
    finally:
        set_(prev)


def blocking(on: bool):
    """NEURON_LAUNCH_BLOCKING-style synchronous execution on or off."""
    return _switched(torch_neuronx.is_launch_blocking, torch_neuronx.set_launch_blocking, on)


def aee(on: bool):
    """Adaptive Eager fusion on or off."""
    return _switched(torch_neuronx.is_adaptive_eager_enabled, torch_neuronx.set_adaptive_eager, on)
