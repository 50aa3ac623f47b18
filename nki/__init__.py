"""NKI, the Neuron Kernel Interface: write Trainium kernels in Python and run them in a
hardware-faithful simulator with an engine-level timing model.

    import nki, nki.language as nl, nki.isa as nisa

    @nki.jit
    def kernel(a): ...
    kernel(np_array)                       # simulate
    nki.benchmark(kernel)(np_array)        # modelled latency, engine use, trace
"""
import importlib

from . import errors  # noqa: F401
from .errors import NkiError, NkiRuleError  # noqa: F401

__version__ = "0.7.0"
__all__ = ["jit", "simulate", "cpu_simulate", "benchmark", "profile", "language", "isa", "lnc", "typing", "errors",
           "Kernel", "BenchmarkResult", "NkiError", "NkiRuleError", "dtype"]

# The language, the instructions and the runner load on first use: a program that only needs
# the engine timeline (nki.simulator.timing, as torch's compiled-graph cost does) does not pay
# for the dtype tables (ml_dtypes: ~0.5 s).
_SUBMODULES = {"isa", "language", "lnc", "typing"}
_RUNNER = {"BenchmarkResult", "Kernel", "benchmark", "cpu_simulate", "jit", "profile", "simulate"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _RUNNER:
        return getattr(importlib.import_module(".simulator.runner", __name__), name)
    if name == "dtype":          # the dtype class (AWS's kernels annotate parameters with it)
        return importlib.import_module(".simulator.dtypes", __name__).DType
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
