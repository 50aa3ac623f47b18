"""Which neuron device a rank uses: torchrun's LOCAL_RANK, as CUDA code does with NCCL.

``torchrun --nproc-per-node N train.py`` starts N processes with LOCAL_RANK=0..N-1 and
LOCAL_WORLD_SIZE=N; ``dist.init_process_group("neuron")`` makes ``neuron:LOCAL_RANK`` the
current device of each. Asking for more ranks on one instance than it has visible NeuronCores
(``torch.neuron.device_count()``, set by NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES) is an
error raised on every rank before any collective runs, so no rank waits for another.
"""
from __future__ import annotations

import os

import torch


def _env_int(name: str):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"neuron backend: environment variable {name}={value!r} is not an integer") from None


def local_rank():
    """torchrun's LOCAL_RANK of this process, or None outside a launcher."""
    return _env_int("LOCAL_RANK")


def local_world_size():
    """torchrun's LOCAL_WORLD_SIZE (ranks on this instance), or None outside a launcher."""
    return _env_int("LOCAL_WORLD_SIZE")


def _check_capacity(n_local, n_devices: int) -> None:
    if n_local is not None and n_local > n_devices:
        raise RuntimeError(
            f"neuron backend: {n_local} ranks were launched on this instance "
            f"(LOCAL_WORLD_SIZE={n_local}) but only {n_devices} neuron device(s) are visible; "
            "launch at most that many processes per node (torchrun --nproc-per-node), or make "
            "more NeuronCores visible with NEURON_RT_NUM_CORES / NEURON_RT_VISIBLE_CORES, or "
            "use logical NeuronCore config NEURON_LOGICAL_NC_CONFIG=1")


def bind_device() -> int:
    """Make ``neuron:LOCAL_RANK`` current (when launched by torchrun); return the device index.

    Called when the default (world) process group of the neuron backend is created.
    """
    n = torch.neuron.device_count()
    _check_capacity(local_world_size(), n)
    lr = local_rank()
    if lr is None:
        return torch.neuron.current_device()
    if not 0 <= lr < n:
        raise RuntimeError(
            f"neuron backend: LOCAL_RANK={lr} has no device: {n} neuron device(s) are visible "
            "(neuron:0..neuron:%d); launch fewer processes per node or make more NeuronCores "
            "visible with NEURON_RT_NUM_CORES / NEURON_RT_VISIBLE_CORES" % (n - 1))
    torch.neuron.set_device(lr)
    return lr
