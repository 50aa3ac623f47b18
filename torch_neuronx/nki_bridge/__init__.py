"""The torch side of NKI: torch tensors (CPU and ``neuron``) as kernel arguments, kernels'
modelled latency charged to the neuron device, and kernel calls inside ``torch.compile``.

``nki`` loads this through the ``nki.frameworks`` entry point (see ``nki.frameworks``); nki
itself imports neither torch nor this package. The neuron device's memory is host memory:
``_C._cpu_alias`` gives a CPU tensor over a device tensor's bytes and NumPy views those
bytes, so a float32 (or integer) input is simulated in place and a kernel's HBM output on a
neuron device is a neuron tensor the kernel writes directly.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

import nki.frameworks
from nki.errors import UnsupportedError

from .. import _C, cost_model
from ..profiling import _lanes

# torch dtypes NumPy lacks: viewed through an integer dtype of the same width.
_BITS = {"bfloat16": ("int16", ml_dtypes.bfloat16), "float8_e4m3fn": ("int8", ml_dtypes.float8_e4m3fn),
         "float8_e5m2": ("int8", ml_dtypes.float8_e5m2)}


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over t's memory (t itself on CPU)."""
    t = t.detach()
    if t.device.type == "neuron":
        return _C._cpu_alias(t)
    if t.device.type != "cpu":
        raise UnsupportedError(f"NKI kernels take CPU or neuron tensors, got a tensor on {t.device}")
    return t


def host_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array over a CPU/neuron tensor's memory, in its real dtype (bf16 via ml_dtypes)."""
    a = _alias(t)
    name = str(a.dtype).replace("torch.", "")
    if name in _BITS:
        bits, real = _BITS[name]
        return a.view(getattr(torch, bits)).numpy().view(real)
    if a.is_complex() or name.startswith(("float8", "float4", "uint16", "uint32", "uint64")):
        raise UnsupportedError(f"torch dtype {a.dtype} is not supported by the NKI simulator")
    return a.numpy()


def np_dtype(dtype) -> np.dtype:
    """The NumPy (or ml_dtypes) dtype of a torch dtype."""
    name = str(dtype).replace("torch.", "")
    if name in _BITS:
        return np.dtype(_BITS[name][1])
    return np.dtype(np.bool_ if name == "bool" else name)


def torch_dtype_of(np_dt) -> torch.dtype:
    """The torch dtype of a NumPy (or ml_dtypes) dtype."""
    name = np.dtype(np_dt).name
    return torch.bool if name == "bool" else getattr(torch, name)


class TorchBridge:
    """What ``nki`` asks of torch tensors (the protocol is documented in ``nki.frameworks``)."""

    def owns(self, x) -> bool:
        return isinstance(x, torch.Tensor)

    def device(self, x):
        return x.device

    def on_accelerator(self, device) -> bool:
        on = device is not None and device.type == "neuron"
        if on:  # asked before the kernel runs: refuse an unrecordable call during capture
            from ..neuron.graphs import _check_not_capturing_direct
            _check_not_capturing_direct("an NKI kernel called on neuron tensors")
        return on

    host_view = staticmethod(host_view)

    def mark_written(self, t) -> None:
        # The tensor changed behind autograd's back: bump its version like an in-place op does.
        torch.autograd.graph.increment_version(t)

    def empty(self, shape, dtype, device):
        return torch.empty(shape, dtype=torch_dtype_of(dtype), device=device)

    def from_numpy(self, a: np.ndarray, device):
        name = a.dtype.name
        if name in _BITS:
            cpu = torch.from_numpy(np.ascontiguousarray(a).view(_BITS[name][0])).view(getattr(torch, name))
        elif name.startswith(("float8", "float4")):
            cpu = torch.from_numpy(a.astype(np.float32))
        else:
            cpu = torch.from_numpy(np.ascontiguousarray(a))
        if device is None or device.type == "cpu":
            return cpu
        out = torch.empty(cpu.shape, dtype=cpu.dtype, device=device)
        host_view(out)[...] = host_view(cpu)
        return out

    def kernel_ran(self, device, name: str, latency_ns: float) -> None:
        if _lanes._collectors:  # a profile is recording: keep the kernel's instruction lanes
            from nki.simulator import context
            _lanes._capture(device.index or 0, f"nki:{name}", [tl.events for tl in context.current().timelines])
        cost_model._add_time(device, f"nki:{name}", latency_ns * 1e-9, engine="nki")

    def rounding(self, device):
        from ..kernels import stochastic_rounding
        return stochastic_rounding._nki_rounder(device)

    def compiling(self) -> bool:
        return torch.compiler.is_compiling()

    def call_compiled(self, kernel, args, kwargs):
        from .compiled import call
        return call(kernel, args, kwargs)


def register() -> None:
    """The ``nki.frameworks`` entry point: hand nki the bridge, and define the graph op a
    kernel call becomes under ``torch.compile`` now (a compile trace must not import it)."""
    from . import compiled  # noqa: F401
    nki.frameworks.register(TorchBridge())
