"""Memory APIs of ``torch.neuron``, with CUDA's names and meanings.

The numbers come from the runtime's caching allocator (C++), read through
``torch.accelerator``'s device-allocator interface.
"""
from __future__ import annotations

import torch

from .. import _C
from ._device import _index


def memory_stats(device=None) -> dict:
    """CUDA-compatible flat dict: ``allocated_bytes.all.current``, ``num_ooms``, ..."""
    raw = torch._C._accelerator_getDeviceStats(_index(device))
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    for metric, x in v.items():
                        out[f"{key}.{sub}.{metric}"] = x
                else:
                    out[f"{key}.{sub}"] = v
        else:
            out[key] = value
    return dict(sorted(out.items()))


def memory_allocated(device=None) -> int:
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None) -> int:
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None) -> int:
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device=None) -> int:
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device=None) -> None:
    torch._C._accelerator_resetPeakStats(_index(device))


def reset_accumulated_memory_stats(device=None) -> None:
    torch._C._accelerator_resetAccumulatedStats(_index(device))


def empty_cache() -> None:
    """Release cached, unused device memory back to the host."""
    torch._C._accelerator_emptyCache()


def mem_get_info(device=None) -> tuple:
    """(free, total) bytes of the device's modelled HBM."""
    return tuple(torch._C._accelerator_getMemoryInfo(_index(device)))


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """Cap this process's use of the device at ``fraction`` of its modelled HBM."""
    from .._state import config
    if not 0 <= fraction <= 1:
        raise ValueError(f"set_per_process_memory_fraction: fraction {fraction} is not in [0, 1]")
    _C._set_memory_limit(_index(device), int(config().hbm_bytes * fraction))
    _fractions[_index(device)] = float(fraction)


_fractions: dict = {}  # per device, for get_per_process_memory_fraction


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A table of the allocator's statistics for one device."""
    idx = _index(device)
    s = memory_stats(idx)
    free, total = mem_get_info(idx)
    rows = [
        ("Allocated memory", "allocated_bytes.all", True),
        ("Active memory", "active_bytes.all", True),
        ("Requested memory", "requested_bytes.all", True),
        ("Reserved memory", "reserved_bytes.all", True),
        ("Allocations", "allocation.all", False),
        ("Active allocs", "active.all", False),
        ("Segments", "segment.all", False),
    ]
    line = "=" * 79
    out = [line, f" neuron:{idx} memory summary (virtual NeuronCore, modelled HBM {_fmt(total)}, "
                 f"free {_fmt(free)})", line,
           f" {'Metric':<24}{'Current':>13}{'Peak':>13}{'Tot Alloc':>14}{'Tot Freed':>14}", "-" * 79]
    for name, key, is_bytes in rows:
        vals = [s.get(f"{key}.{m}", 0) for m in ("current", "peak", "allocated", "freed")]
        f = _fmt if is_bytes else str
        out.append(f" {name:<24}{f(vals[0]):>13}{f(vals[1]):>13}{f(vals[2]):>14}{f(vals[3]):>14}")
    if not abbreviated:
        out.append("-" * 79)
        for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
            out.append(f" {key:<24}{s.get(key, 0):>13}")
    out.append(line)
    return "\n".join(out)
