"""NKI, the Neuron Kernel Interface: write Trainium kernels in Python and run them in a
hardware-faithful simulator with an engine-level timing model.

    import nki, nki.language as nl, nki.isa as nisa

    @nki.jit
    def kernel(a): ...
    kernel(np_array)                       # simulate
    nki.benchmark(kernel)(np_array)        # modelled latency, engine use, trace
"""
from . import errors, isa, language, typing  # noqa: F401
from .errors import NkiError, NkiRuleError  # noqa: F401
from .simulator.runner import (BenchmarkResult, Kernel, benchmark, cpu_simulate, jit,  # noqa: F401
                               profile, simulate)

__version__ = "0.7.0"
__all__ = ["jit", "simulate", "cpu_simulate", "benchmark", "profile", "language", "isa", "typing", "errors",
           "Kernel", "BenchmarkResult", "NkiError", "NkiRuleError"]
