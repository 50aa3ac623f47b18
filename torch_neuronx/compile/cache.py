"""The persistent compile cache of the neuron backend.

Compiled graphs are kept by Inductor's FX graph cache (generated kernels and wrappers, keyed
by the post-grad graph, input metadata and configuration) and AOTAutograd's cache (forward
and backward graphs keyed by the Dynamo graph), both on disk. A second process that
compiles the same model therefore finds both and generates or builds nothing.

The directory is ``TORCH_NEURONX_COMPILE_CACHE_DIR`` when set (otherwise Inductor's own,
``TORCHINDUCTOR_CACHE_DIR`` or ``/tmp/torchinductor_<user>``). ``TORCH_NEURONX_COMPILE_CACHE=0``
turns the persistent cache off.
"""
from __future__ import annotations

import os


def cache_dir() -> str:
    """The directory compiled graphs are stored in."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
    configure()
    return inductor_cache_dir()


def configure() -> None:
    """Point Inductor's caches at the neuron cache settings (cheap; called per compile)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    wanted = os.environ.get("TORCH_NEURONX_COMPILE_CACHE_DIR")
    if wanted:
        # Inductor reads this variable each time it resolves its cache directory.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(wanted)
    flag = os.environ.get("TORCH_NEURONX_COMPILE_CACHE")
    if flag is not None:
        # Only when asked: these switches are process-wide (CPU compiles share them).
        enabled = flag.strip().lower() not in ("0", "false", "no", "off")
        inductor_config.fx_graph_cache = enabled
        functorch_config.enable_autograd_cache = enabled


def clear() -> None:
    """Forget compiled graphs in memory (the next compile consults the disk cache)."""
    import torch
    torch._dynamo.reset()
    from torch._inductor.codecache import PyCodeCache
    PyCodeCache.cache_clear(purge=False) if hasattr(PyCodeCache, "cache_clear") else None
