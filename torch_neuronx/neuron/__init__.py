"""``torch.neuron``: the device module of the virtual Trainium NeuronCore, with CUDA's API."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _state
from ._device import (current_device, device, device_count, device_of, is_available,
                      is_initialized, set_device, synchronize, _index)
from .memory import (empty_cache, max_memory_allocated, max_memory_reserved, mem_get_info,
                     memory_allocated, memory_reserved, memory_snapshot, memory_stats,
                     memory_summary, reset_accumulated_memory_stats, reset_peak_memory_stats,
                     set_per_process_memory_fraction)
from .random import (default_generator, get_rng_state, get_rng_state_all, initial_seed,
                     manual_seed, manual_seed_all, seed, seed_all, set_rng_state,
                     set_rng_state_all)
from ._cuda_names import *  # noqa: F401,F403
from ._cuda_names import __all__ as _cuda_names_all
from .streams import (Event, Stream, StreamContext, current_stream, default_stream, set_stream,
                      stream)
from .graphs import NeuronGraph, graph, graph_pool_handle, is_current_stream_capturing
from .graphed_callables import make_graphed_callables
from . import amp  # noqa: F401
from . import comm
from ._metadata import install as _install_metadata_hooks
from ._dlpack import install as _install_dlpack

# CUDA's lazy-init flag. The runtime starts with the process, so it is always set;
# torch.utils.checkpoint reads it to decide whether to stash and restore the device's RNG
# states around the recomputed forward (without them, dropout drew new masks).
_initialized = True

_install_metadata_hooks()
_install_dlpack()
comm.install()


@dataclass(frozen=True)
class NeuronDeviceProperties:
    name: str                   # platform type, as AWS reports it: trn1 | trn2 | trn3
    chip: str
    core_version: str
    platform: str               # trn1 | trn2 | trn3
    logical_nc_config: int      # physical NeuronCores per logical core
    physical_cores: int
    core_id: int                # visible logical core id
    total_memory: int           # modelled HBM bytes of this logical core
    hbm_bandwidth: float        # bytes/s
    peak_tflops: dict           # dense TFLOPS by dtype name
    sbuf_bytes: int
    psum_bytes: int
    multi_processor_count: int  # physical cores, where CUDA code looks for SMs
    is_virtual: bool = True
    major: int = 0
    minor: int = 0


def get_device_properties(device=None) -> NeuronDeviceProperties:
    idx = _index(device)
    cfg = _state.config()
    if not 0 <= idx < cfg.device_count:
        raise RuntimeError(f"Invalid device index neuron:{idx}: there are {cfg.device_count} "
                           "visible neuron device(s)")
    p, lnc = cfg.profile, cfg.lnc
    major = int(p.core_version.rsplit("v", 1)[-1])
    return NeuronDeviceProperties(
        name=p.name, chip=p.chip, core_version=p.core_version, platform=p.name,
        logical_nc_config=lnc, physical_cores=lnc, core_id=cfg.cores[idx],
        total_memory=cfg.hbm_bytes, hbm_bandwidth=p.core_hbm_bandwidth(lnc),
        peak_tflops={k: v * lnc for k, v in p.core_tflops.items()},
        sbuf_bytes=p.sbuf_bytes * lnc, psum_bytes=p.psum_bytes * lnc,
        multi_processor_count=lnc, major=major, minor=0)


def _describe(device=None) -> str:
    """One line for people: ``Trainium2 NeuronCore-v3 (virtual, LNC=2)``."""
    p = get_device_properties(device)
    return f"{p.chip} {p.core_version} (virtual, LNC={p.logical_nc_config})"


def get_device_name(device=None) -> str:
    """``"neuron"``, as AWS's torch_neuronx reports it: libraries match the accelerator on
    this name and then read the platform from ``get_device_properties().name`` (TorchTitan's
    MFU peak-FLOPs table does). The chip, core version and ``is_virtual`` are properties."""
    get_device_properties(device)   # an invalid index raises, as on CUDA
    return "neuron"


def get_device_capability(device=None) -> tuple:
    p = get_device_properties(device)
    return (p.major, p.minor)


def get_amp_supported_dtype() -> list:
    # float32 as on CUDA: autocast(dtype=torch.float32) is legal there (TorchTitan uses it
    # when mixed precision is off); without it torch disables autocast with a warning.
    return [torch.bfloat16, torch.float16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    pass


def init() -> None:
    pass


__all__ = [
    "Event", "NeuronGraph", "Stream", "StreamContext", "current_device", "current_stream", "default_generator",
    "default_stream", "device", "device_count", "device_of", "empty_cache",
    "get_amp_supported_dtype", "get_device_capability", "get_device_name",
    "get_device_properties", "get_rng_state", "get_rng_state_all", "graph", "graph_pool_handle",
    "init", "initial_seed", "is_current_stream_capturing", "make_graphed_callables",
    "is_available", "is_bf16_supported", "is_initialized", "manual_seed", "manual_seed_all",
    "max_memory_allocated", "max_memory_reserved", "mem_get_info", "memory_allocated",
    "memory_reserved", "memory_stats", "memory_summary", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "seed", "seed_all", "set_device", "set_per_process_memory_fraction",
    "set_rng_state", "set_rng_state_all", "set_stream", "stream", "synchronize",
] + _cuda_names_all
