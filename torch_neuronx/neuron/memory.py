"""Memory APIs of ``torch.neuron``, with CUDA's names and meanings.

The numbers come from the runtime's caching allocator (C++), read through
``torch.accelerator``'s device-allocator interface.
"""
from __future__ import annotations

import inspect
import pickle
import sys
import warnings

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


# Memory history and snapshots, with torch.cuda.memory's private names, signatures and dict
# format (torch.cuda._memory_viz and pytorch.org/memory_viz read it). The allocator (C++)
# keeps the history; torch 2.13's torch.accelerator.memory._snapshot asks torch.cuda or
# torch.xpu only, and c10's DeviceAllocator has no snapshot hook, so these are the way in.
_ENABLED = ("state", "all")
_CONTEXTS = ("state", "alloc", "all")
_STACKS = ("python", "all")
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
            "oom", "snapshot")


def _record_memory_history(enabled="all", *args, **kwargs) -> None:
    """Start (``"all"``: live blocks' stacks and a history of allocator actions; ``"state"``:
    live blocks' stacks only) or stop (``None``) recording, as
    ``torch.cuda.memory._record_memory_history``. A bool ``enabled`` takes CUDA's legacy
    arguments. Recording covers every neuron device; stopping forgets what was recorded."""
    if isinstance(enabled, bool):
        return _record_memory_history_legacy(enabled, *args, **kwargs)
    return _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_impl(enabled="all", context="all", stacks="all",
                                max_entries: int = sys.maxsize, device=None,
                                clear_history: bool = False, compile_context: bool = False,
                                global_record_annotations: bool = False,
                                skip_actions=None) -> None:
    if enabled is not None and enabled not in _ENABLED:
        raise ValueError(f"_record_memory_history: enabled must be 'state', 'all' or None, "
                         f"got {enabled!r}")
    if context is not None and context not in _CONTEXTS:
        raise ValueError(f"_record_memory_history: context must be 'state', 'alloc', 'all' or "
                         f"None, got {context!r}")
    if stacks not in _STACKS:
        raise ValueError(f"_record_memory_history: stacks must be 'python' or 'all', got {stacks!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
        raise ValueError(f"_record_memory_history: max_entries must be an int >= 0, "
                         f"got {max_entries!r}")
    if device is not None:
        _index(device)  # a bad device raises; as on CUDA, every device records
    for name, value in (("compile_context", compile_context),
                        ("global_record_annotations", global_record_annotations)):
        if value:
            raise NotImplementedError(f"_record_memory_history: {name}=True is not supported on "
                                      f"neuron (the allocator records Python and C++ frames only)")
    skip = list(skip_actions or [])
    bad = [a for a in skip if a not in _ACTIONS]
    if bad:
        raise ValueError(f"_record_memory_history: skip_actions {bad} are not actions; "
                         f"valid: {list(_ACTIONS)}")
    on = enabled is not None
    trace = enabled == "all"
    _C._memory_record_history(
        on, trace, max_entries if trace else 0,
        on and context is not None,                 # stacks of live blocks
        on and context in ("alloc", "all"),         # ... of alloc entries
        trace and context == "all",                 # ... of free entries
        on and context is not None and stacks == "all",
        bool(clear_history), skip)


# As torch.cuda's: help() and inspect show the arguments of the current form.
_record_memory_history.__signature__ = inspect.signature(_record_memory_history_impl)


def _record_memory_history_legacy(enabled: bool, record_context=True, trace_alloc_max_entries=1,
                                  trace_alloc_record_context=False, device=None,
                                  record_context_cpp=False, clear_history=False,
                                  compile_context=False, global_record_annotations=False,
                                  skip_actions=None) -> None:
    # CUDA's legacy form: a ring of trace_alloc_max_entries; stacks on blocks
    # (record_context) and on trace entries (trace_alloc_record_context).
    context = "alloc" if trace_alloc_record_context else ("state" if record_context else None)
    _record_memory_history_impl("all" if enabled else None, context,
                                "all" if record_context_cpp else "python",
                                trace_alloc_max_entries, device, clear_history, compile_context,
                                global_record_annotations, skip_actions)


def _snapshot(device=None, augment_with_fx_traces: bool = False) -> dict:
    """The allocator's state now, as ``torch.cuda.memory._snapshot``: ``segments`` (each block
    is a segment of its own: the allocator never splits) and ``device_traces`` (per device,
    the recorded actions, oldest first). Blocks handed out before recording started are not
    listed (the allocator keeps no table of live blocks while history is off)."""
    if device is not None:
        _index(device)  # as on CUDA, the snapshot covers every device
    s = _C._memory_snapshot()
    if augment_with_fx_traces:
        from torch._utils import _augment_memory_snapshot_stack_traces
        s = _augment_memory_snapshot_stack_traces(s)
    return s


def memory_snapshot(mempool_id=None, include_traces: bool = True) -> list:
    """The allocator's segments on every device, as ``torch.cuda.memory_snapshot``: the
    ``segments`` of ``_snapshot()``. The allocator has one pool, ``(0, 0)``; ``include_traces``
    (CUDA's switch for a lighter snapshot) does not change the segments."""
    if mempool_id is not None and tuple(mempool_id) != (0, 0):
        raise ValueError(f"memory_snapshot: mempool_id {mempool_id!r} is not a pool of the neuron "
                         f"allocator (it has one, (0, 0))")
    return _C._memory_snapshot()["segments"]


def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """Pickle ``_snapshot()`` to ``filename`` for ``python -m torch.cuda._memory_viz`` or
    pytorch.org/memory_viz."""
    s = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
    with open(filename, "wb") as f:
        pickle.dump(s, f)


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
    return _fractions.get(_index(device), 1.0)


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
