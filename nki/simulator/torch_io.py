"""Kernel arguments and results as torch tensors, without copies where the dtype allows.

The ``neuron`` device's memory is host memory: ``torch_neuronx._C._cpu_alias`` gives a CPU
tensor over a device tensor's bytes, and NumPy views those bytes. So a float32 (or integer)
input is simulated in place, a kernel's HBM output on a neuron device is allocated as a neuron
tensor the kernel writes directly, and only dtypes the simulator stores widened (bf16, fp16,
fp8: tiles hold float32) pay one conversion pass. torch is imported only when a tensor comes in.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import errors as E
from .dtypes import as_dtype

_BITS = {"bfloat16": ("int16", ml_dtypes.bfloat16), "float8_e4m3fn": ("int8", ml_dtypes.float8_e4m3fn),
         "float8_e5m2": ("int8", ml_dtypes.float8_e5m2)}


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _alias(t):
    """A CPU tensor over t's memory (t itself on CPU)."""
    t = t.detach()
    if t.device.type == "neuron":
        import torch_neuronx
        return torch_neuronx._C._cpu_alias(t)
    if t.device.type != "cpu":
        raise E.UnsupportedError(f"NKI kernels take CPU or neuron tensors, got a tensor on {t.device}")
    return t


def host_view(t) -> np.ndarray:
    """A NumPy array over a CPU/neuron tensor's memory, in its real dtype (bf16 via ml_dtypes)."""
    a = _alias(t)
    name = str(a.dtype).replace("torch.", "")
    if name in _BITS:
        import torch
        bits, real = _BITS[name]
        return a.view(getattr(torch, bits)).numpy().view(real)
    if a.is_complex() or name.startswith(("float8", "float4", "uint16", "uint32", "uint64")):
        raise E.UnsupportedError(f"torch dtype {a.dtype} is not supported by the NKI simulator")
    return a.numpy()


def torch_dtype(dt):
    import torch
    return getattr(torch, {"bool": "bool"}.get(dt.name, dt.name), None)


class Origin:
    """Where an input tensor's data lives, so the kernel's writes reach it."""

    __slots__ = ("tensor", "host", "in_place")

    def __init__(self, tensor, host, in_place):
        self.tensor, self.host, self.in_place = tensor, host, in_place


def wrap(x):
    """(storage array, Origin) of an input tensor: its own memory when the simulator's
    storage dtype matches and it is contiguous, else a converted copy."""
    host = host_view(x)
    d = as_dtype(host.dtype)
    if host.dtype == d.storage and host.flags.c_contiguous and host.flags.writeable:
        return host, Origin(x, host, True)
    store = d.round(host.astype(np.float32)) if d.is_float else np.ascontiguousarray(host, d.storage)
    return np.array(store, dtype=d.storage, copy=True), Origin(x, host, False)


def write_back(origin: Origin, dtype, store):
    if not origin.in_place:
        origin.host[...] = dtype.to_real(store).astype(origin.host.dtype, copy=False)
    import torch
    # The tensor changed behind autograd's back: bump its version like an in-place op does.
    torch.autograd.graph.increment_version(origin.tensor)


def device_hbm(shape, dtype, device):
    """(neuron tensor, NumPy view of its memory) for a kernel output the kernel can write
    directly, or None when the simulator stores this dtype widened."""
    if dtype.storage != np.dtype(dtype.real):
        return None
    td = torch_dtype(dtype)
    if td is None:
        return None
    import torch
    t = torch.empty(shape, dtype=td, device=device)
    return t, host_view(t)


def to_torch(a: np.ndarray, device):
    """A result array as a torch tensor on ``device`` (one pass into device memory)."""
    import torch
    name = a.dtype.name
    if name in _BITS:
        bits = _BITS[name][0]
        cpu = torch.from_numpy(np.ascontiguousarray(a).view(bits)).view(getattr(torch, name))
    elif name.startswith(("float8", "float4")):
        cpu = torch.from_numpy(a.astype(np.float32))
    else:
        cpu = torch.from_numpy(np.ascontiguousarray(a))
    if device is None or device.type == "cpu":
        return cpu
    out = torch.empty(cpu.shape, dtype=cpu.dtype, device=device)
    host_view(out)[...] = host_view(cpu)
    return out


def np_dtype(dtype):
    """The NumPy (or ml_dtypes) dtype of a torch dtype."""
    name = str(dtype).replace("torch.", "")
    if name in _BITS:
        return np.dtype(_BITS[name][1])
    return np.dtype(np.bool_ if name == "bool" else name)


def torch_dtype_of(np_dt):
    """The torch dtype of a NumPy (or ml_dtypes) dtype."""
    import torch
    name = np.dtype(np_dt).name
    return torch.bool if name == "bool" else getattr(torch, name)
