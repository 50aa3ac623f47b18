"""torch_neuronx: the neuron device, a virtual AWS Trainium NeuronCore for PyTorch.

Importing this package (which ``import torch`` does through the ``torch.backends`` entry
point) registers PrivateUse1 as ``"neuron"``, installs ``torch.neuron``, and sizes the
devices from the NEURON_* environment.
"""
from __future__ import annotations


def _autoload() -> None:
    """Entry point of the ``torch.backends`` group: importing the package did the work.

    Defined before ``import torch``: when this package is imported first, torch's own
    autoload finds it half-initialised and calls this.
    """


import os
import torch  # noqa: E402

from . import _C  # noqa: F401  (registers allocator, guard, hooks, kernels)
from . import _state
from . import kernels  # noqa: F401,E402  (CUDA paths CPU lacks: RNN cells, dropout RNG, dtypes)

__version__ = "0.1.0"


def _register() -> None:
    if torch._C._get_privateuse1_backend_name() != "neuron":
        torch.utils.rename_privateuse1_backend("neuron")
    from . import neuron as device_module
    if getattr(torch, "neuron", None) is not device_module:
        torch._register_device_module("neuron", device_module)
        # `import torch.neuron.memory` (as `import torch.cuda.memory`) must find these
        # modules, not load second copies whose relative imports point into torch.
        import sys
        for name, mod in list(sys.modules.items()):
            if name.startswith(device_module.__name__ + "."):
                sys.modules["torch.neuron" + name[len(device_module.__name__):]] = mod
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
    _C._route_composites_to_cpu()
    cfg = _state.config()
    _C._set_device_count(cfg.device_count)
    for i in range(cfg.device_count):
        _C._set_memory_limit(i, cfg.hbm_bytes)
    import atexit
    atexit.register(_stop_autograd_workers)
    # Backward runs on the thread that calls it, as on CPU: the device's ops are queued
    # anyway, and autograd's device thread only added two hand-offs per backward and a
    # second OpenMP team competing with this thread's for the host's cores (same-process
    # pairs, neuron/CPU: Wan eager 1.34 -> 1.19, Mixtral eager 1.50 -> 1.40, RSSM compiled
    # 1.06 -> 1.00; bench/RESULTS.md). Autograd's own switch, per thread:
    # set_multithreading_enabled(True) restores it.
    torch.autograd.set_multithreading_enabled(False)
    # Trainium's native mixed precision is bf16 (autocast's per-device default is fp16).
    torch.set_autocast_dtype("neuron", torch.bfloat16)


def _stop_autograd_workers() -> None:
    """At exit, let autograd's device worker threads finish while Python is still alive.

    Torn down later, during interpreter finalization, a worker that re-takes the GIL is
    force-unwound and the process aborts ("terminate called without an active exception").
    """
    import os
    import time
    _C._stop_autograd_workers()

    def workers_left() -> bool:
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    if f.read().startswith("pt_autograd"):
                        return True
            except OSError:
                continue  # a thread that exited between the listing and the read
        return False

    deadline = time.monotonic() + 10.0
    try:
        while workers_left() and time.monotonic() < deadline:
            time.sleep(0.002)  # releases the GIL the exiting workers need
    except OSError:
        return  # no /proc: nothing to watch


_register()

# AWS's memory-profiling guide calls these on the torch_neuronx module itself.
from .neuron.memory import (empty_cache, max_memory_allocated, max_memory_reserved,  # noqa: E402
                            memory_allocated, memory_reserved, memory_stats, memory_summary,
                            reset_peak_memory_stats)
from .cost_model import modelled_time, price_as, reset_modelled_time  # noqa: E402
from .runtime.stream_check import _from_environment as _stream_check_from_env  # noqa: E402
from .runtime.stream_check import stream_check  # noqa: E402
from .runtime import sharing as _sharing  # noqa: E402,F401  (neuron tensors through torch.multiprocessing)

_stream_check_from_env()

from .runtime.queue import _drain_at_exit  # noqa: E402
from .runtime.queue import _from_environment as _queue_from_env  # noqa: E402
from .runtime.queue import (adaptive_eager_stats, is_adaptive_eager_enabled,  # noqa: E402
                            get_device_threads, is_launch_blocking, queue_stats,
                            set_adaptive_eager, set_device_threads, set_launch_blocking)

_queue_from_env()
import atexit as _atexit  # noqa: E402

_atexit.register(_drain_at_exit)  # registered after the autograd one, so it runs first

# The "neuron" c10d backend: only registers a name with torch.distributed (already imported
# by ``import torch``); the process group module loads when a group is created.
from .distributed import _register as _register_distributed  # noqa: E402

_register_distributed()

# torch.compile support: registers neuron with Dynamo and Inductor lazily, when they are
# first imported (importing them here would slow down ``import torch``).
from .compile import _install_hooks as _install_compile_hooks  # noqa: E402

_install_compile_hooks()


def __getattr__(name):
    # ``torch_neuronx.nki_op`` loads the NKI integration on first use, so ``import torch``
    # stays fast and does not import nki.
    if name == "nki_op":
        import importlib
        fn = importlib.import_module(".nki_op", __name__).nki_op
        globals()["nki_op"] = fn        # the submodule import bound the module; rebind
        return fn
    raise AttributeError(f"module 'torch_neuronx' has no attribute {name!r}")


__all__ = ["modelled_time", "reset_modelled_time", "price_as", "stream_check", "set_launch_blocking",
           "is_launch_blocking", "queue_stats", "adaptive_eager_stats", "set_adaptive_eager",
           "is_adaptive_eager_enabled", "memory_allocated", "max_memory_allocated",
           "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
           "memory_summary", "empty_cache", "set_device_threads", "get_device_threads"]


def _quiet_printing() -> None:
    # Printing formats through float64 reductions on the device; those are ours, not the
    # user's, so they must not raise the "will not port" warning.
    import torch._tensor_str as ts
    if getattr(ts._str, "_neuron_quiet", False):
        return
    inner = ts._str

    def _str(self, *, tensor_contents=None):
        if self.device.type != "neuron":
            return inner(self, tensor_contents=tensor_contents)
        prev = _C._quiet()
        _C._set_quiet(True)
        try:
            return inner(self, tensor_contents=tensor_contents)
        finally:
            _C._set_quiet(prev)

    _str._neuron_quiet = True
    ts._str = _str


_quiet_printing()

if os.environ.get("NEURON_RT_INSPECT_ENABLE", "0") not in ("", "0"):
    from .profiling import _start_from_env
    _start_from_env()
