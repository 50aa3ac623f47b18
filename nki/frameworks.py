"""Tensor frameworks whose tensors NKI kernels accept besides NumPy arrays.

NKI is a kernel language and simulator; it knows NumPy and nothing else. A framework (the
torch side of this project, ``torch_neuronx.nki_bridge``) teaches it its tensors by
registering a *bridge* under the ``nki.frameworks`` entry-point group. The arrow runs one
way: the framework imports ``nki``, never the reverse. A bridge is loaded the first time a
kernel meets an argument NKI does not know, or when a kernel is defined after the
framework's package was imported (so that a ``torch.compile`` trace never has to load it).

A bridge answers:

- ``owns(x)``: whether ``x`` is one of its tensors;
- ``device(x)``: where ``x`` lives (compared with ``==``); ``on_accelerator(device)``: whether
  that is the accelerator whose modelled time the kernel is charged to;
- ``host_view(x)``: a NumPy array over ``x``'s memory in its real dtype (no copy);
  ``mark_written(x)``: the kernel wrote ``x`` behind the framework's back;
- ``empty(shape, np_dtype, device)``: a new tensor (outputs written in place on the device);
  ``from_numpy(array, device)``: a result array as a tensor;
- ``kernel_ran(device, name, latency_ns)``: charge a kernel's modelled latency;
- ``compiling()`` and ``call_compiled(kernel, args, kwargs)``: a kernel call while the
  framework traces a graph becomes one node of that graph;
- optionally ``rounding(device)``: None, or the rounder (``(dtype name, float32 array) ->
  float32 array``) the device's runtime narrows to bf16/fp16 with, when it rounds
  stochastically (``nki.simulator.dtypes.stochastic_rounder``).
"""
from __future__ import annotations

import sys
from importlib.metadata import entry_points

_bridges: list = []
_loaded: set = set()            # entry-point names already loaded
_all_loaded = False


def register(bridge) -> None:
    """Add a bridge (normally called by the object an ``nki.frameworks`` entry point names)."""
    if bridge not in _bridges:
        _bridges.append(bridge)


def _load(only_imported: bool) -> None:
    global _all_loaded
    if _all_loaded:
        return
    _all_loaded = not only_imported
    for ep in entry_points(group="nki.frameworks"):
        if ep.name in _loaded:
            continue
        if only_imported and ep.module.split(".")[0] not in sys.modules:
            continue
        _loaded.add(ep.name)
        ep.load()()


def load_imported() -> None:
    """Load the bridges of frameworks whose package is already imported."""
    _load(only_imported=True)


def bridge_for(x):
    """The bridge owning ``x`` (an object that is not a NumPy array), or None."""
    for b in _bridges:
        if b.owns(x):
            return b
    if _all_loaded or not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return None
    _load(only_imported=False)
    return next((b for b in _bridges if b.owns(x)), None)


def tracing():
    """The bridge whose framework is tracing a graph now, or None."""
    return next((b for b in _bridges if b.compiling()), None)
