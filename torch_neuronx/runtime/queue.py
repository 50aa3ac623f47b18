"""The device's work queues, as the user sees them.

Every op on a neuron tensor is launched asynchronously, as on the chip: the call returns once
the work is queued, and the device (an executor thread per device) runs it in launch order.
Host reads (``.cpu()``, ``.item()``, printing, ``.tolist()``), ``torch.neuron.synchronize()``,
``Stream.synchronize()`` and ``Event.synchronize()`` wait for the work they depend on. An
error inside queued work is raised by the next such call, naming the op and the Python line
that launched it; the device stays usable.

``NEURON_LAUNCH_BLOCKING=1`` (read at import) or ``set_launch_blocking(True)`` runs every op
synchronously, so an error is raised by the op that caused it (like
``CUDA_LAUNCH_BLOCKING``). The stream checker also runs ops synchronously while it is on.
"""
from __future__ import annotations

import os

import torch

from .. import _C


def set_launch_blocking(enabled: bool) -> None:
    """Run ops synchronously (``True``) or queue them (``False``, the default)."""
    _C._set_launch_blocking(bool(enabled))


def is_launch_blocking() -> bool:
    return _C._launch_blocking()


def queue_stats(device=None, reset: bool = False) -> dict:
    """Launch counters of a device's queue.

    ``launched``/``executed``: work items queued and run so far (kernels, copies, event
    records). ``synchronous_ops``: ops that ran on the host thread although launches were
    asynchronous, by name (data-dependent outputs such as ``nonzero`` or ``item``, random
    ops, ops without a Meta kernel for their arguments), summed over devices; ``reset``
    clears them.
    """
    index = torch.device("neuron", torch.neuron.current_device() if device is None else
                         torch.device(device).index if not isinstance(device, int) else device).index
    launched, executed = _C._queue_counts(index if index is not None else 0)
    return {"launched": launched, "executed": executed,
            "synchronous_ops": dict(_C._sync_op_counts(reset))}


def adaptive_eager_stats(reset: bool = False) -> dict:
    """Adaptive Eager Execution's counters since start (or the last reset).

    ``ops``: ops launched to the queues (before fusion); ``kernels``: kernels the queues ran
    for them (after fusion); ``fused_kernels`` of those were fused, holding ``fused_ops``;
    ``one_pass_ops`` of those ran in one-pass runs (exact fp32 arithmetic, ``exp`` and
    last-dim reductions, evaluated in one pass over the data; see docs/device.md).
    """
    ops, kernels, fused_kernels, fused_ops, one_pass_ops = _C._adaptive_eager_stats(reset)
    return {"ops": ops, "kernels": kernels, "fused_kernels": fused_kernels,
            "fused_ops": fused_ops, "one_pass_ops": one_pass_ops}


def set_device_threads(n: int | None) -> None:
    """Give queued work its own intra-op thread count, or ``None`` to follow the launcher.

    By default each op runs on the device with the ``torch.get_num_threads()`` of the thread
    that launched it, so its results equal CPU's bit for bit. The device's executor runs
    beside the calling thread: on a host with few cores, a device using every core while
    Python keeps issuing work oversubscribes them, and its parallel loops wait for threads
    the scheduler has parked. ``set_device_threads(n)`` runs queued work with ``n`` threads
    instead (``TORCH_NEURONX_DEVICE_THREADS=n`` at import does the same); results then equal
    CPU's computed with ``torch.set_num_threads(n)``, which can differ in the last bits from
    CPU's at another count (parallel reductions, the split of elementwise loops). Waits for
    queued work first. docs/device.md, "The device's own thread count".
    """
    if n is None:
        n = 0
    elif isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"set_device_threads: expected a thread count >= 1 or None, got {n!r}")
    _C._set_device_threads(n)


def get_device_threads() -> int | None:
    """The count ``set_device_threads`` set, or ``None`` when work follows its launcher."""
    return _C._device_threads() or None


def set_adaptive_eager(enabled: bool) -> None:
    """Turn Adaptive Eager fusion on (the default) or off for the process.

    It is also off under ``torch.use_deterministic_algorithms(True)`` or
    ``torch.set_deterministic_debug_mode(...)`` (not "default"), and when
    ``TORCH_NEURONX_ADAPTIVE_EAGER=0`` at import.
    """
    _C._set_adaptive_eager(bool(enabled))


def is_adaptive_eager_enabled() -> bool:
    return _C._adaptive_eager_enabled()


def _from_environment() -> None:
    if os.environ.get("NEURON_LAUNCH_BLOCKING", "0") not in ("", "0"):
        _C._set_launch_blocking(True)
    threads = os.environ.get("TORCH_NEURONX_DEVICE_THREADS", "")
    if threads:
        try:
            n = int(threads)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError("TORCH_NEURONX_DEVICE_THREADS: expected a thread count >= 1, got "
                             f"{threads!r}")
        _C._set_device_threads(n)


def _drain_at_exit() -> None:
    # Queued work must not run while the interpreter tears down; an error it raised after
    # the program's last synchronization is reported, not lost.
    try:
        _C._synchronize_all()
    except RuntimeError as e:
        import sys
        print(f"torch_neuronx: queued work failed after the last synchronization: {e}",
              file=sys.stderr)
