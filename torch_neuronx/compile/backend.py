"""The Dynamo backend ``"neuron"``.

``torch.compile(model, backend="neuron")``, ``torch.compiler.set_default_backend("neuron")``
then ``model.compile()``, and Transformers' automatic choice for Neuron devices all arrive
at ``neuron_backend``. A Dynamo graph goes through:

1. Dynamo-level FX passes (``passes.py``): FlexAttention calls become Neuron block-sparse
   attention ops, unsupported constructs raise an error naming the op and source line;
2. AOTAutograd (forward and backward graphs, functionalised), with Inductor's decompositions
   with Neuron's rules (``decompositions.py``) and the post-grad Neuron pass;
3. Inductor lowering and scheduling, with the neuron code generator (``codegen.py``): fused
   C++ kernels that run on the device buffers in place;
4. the persistent caches (Inductor's FX graph cache and AOTAutograd's cache, in
   ``TORCH_NEURONX_COMPILE_CACHE_DIR``; ``cache.py``).

Options (``torch.compile(..., options={...})``): ``fallback_execution`` (bool; overrides
``TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION``), and any Inductor config key.
``mode`` other than ``"default"`` warns and compiles with the default mode, as AWS's
backend does.

``compile_aten_graph(gm, example_inputs)`` is the entry point for code that holds an FX
graph of ATen ops and does not go through Dynamo:

    >>> fn = compile_aten_graph(gm, [a, b])   # gm: torch.fx.GraphModule of ATen ops
    >>> outs = fn(a, b)                         # neuron tensors in, list of neuron tensors out

It takes an FX ``GraphModule`` whose nodes call ATen ops (``torch.ops.aten.*``; a graph of
``torch.*`` functions works as well), the example inputs (neuron tensors, or SymInts/ints),
and returns a callable taking the same positional inputs and returning the graph's outputs
as a list. It does not run Dynamo; it runs AOTAutograd's functionalisation (so in-place ops
are allowed), the Neuron decompositions and passes, and Inductor lowering with this code
generator. Results go through Inductor's FX graph cache, so an identical graph is compiled
once per cache directory.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch

from . import cache, codegen, host, passes
from .decompositions import install as install_decompositions

log = logging.getLogger(__name__)

_BACKEND_OPTIONS = {"fallback_execution"}
# Inductor options this backend always sets: the C++ code generator (device memory is host
# memory), and no CUDA graphs (there is no graph capture on this device).
_INDUCTOR_PATCHES = {
    "cpu_backend": "cpp",
    "triton.cudagraphs": False,
}


NeuronCompileError = passes.NeuronCompileError


def _fallback_enabled(options: dict) -> bool:
    if "fallback_execution" in options:
        return bool(options["fallback_execution"])
    flag = os.environ.get("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1").strip().lower()
    return flag in ("0", "false", "no", "off")


def _compile_graph(gm, example_inputs, *, decompositions=None, config_patches=None):
    """AOTAutograd + Inductor with the neuron code generator; returns the compiled callable."""
    from torch._inductor.compile_fx import compile_fx

    codegen.register()
    cache.configure()
    patches = dict(_INDUCTOR_PATCHES)
    patches.update(config_patches or {})
    # Inductor's table (with the neuron rules installed into it) is used when no table is
    # passed; passing one explicitly would make the FX graph cache bypass the graph.
    install_decompositions()
    return compile_fx(gm, example_inputs, inner_compile=host.inner_compile,
                      decompositions=decompositions, config_patches=patches)


def _stochastic_rounding() -> bool:
    from ..kernels.stochastic_rounding import _stochastic_rounding_enabled
    return _stochastic_rounding_enabled()


def neuron_backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None,
                   **kwargs):
    """Dynamo backend compiling ``gm`` for the neuron device (registered as ``"neuron"``)."""
    options = dict(options or {})
    if kwargs:
        raise TypeError(f"neuron backend: unexpected arguments {sorted(kwargs)}")
    if mode not in (None, "default"):
        warnings.warn(f"torch.compile(mode={mode!r}) is not supported by the neuron backend; "
                      "compiling with mode='default'", stacklevel=2)
    fallback = _fallback_enabled(options)
    inductor_patches = {k: v for k, v in options.items() if k not in _BACKEND_OPTIONS}
    passes.report_recompile(gm)
    try:
        passes.check_graph(gm)
        gm = passes.lower_flex_attention(gm)
        passes.note_source_lines(gm)
        if _stochastic_rounding():
            # Generated kernels round to nearest even: op by op, each bf16/fp16 result goes
            # through the device's stochastic rounding (docs/precision.md).
            return gm.forward
        return _compile_graph(gm, example_inputs, config_patches=inductor_patches)
    except Exception as exc:  # noqa: BLE001 - reported or turned into fallback below
        err = passes.explain_failure(exc, gm)
        if not fallback:
            if err is exc:
                raise
            raise err from exc
        warnings.warn(f"{err}; running this graph eagerly (fallback execution is enabled)",
                      stacklevel=2)
        return gm.forward


def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs, *, decompositions=None):
    """Compile ``gm`` (an FX graph of ATen ops) for neuron; see the module docstring.

    Returns a callable ``fn(*inputs) -> list[Tensor]``. ``example_inputs`` must match what
    the callable will receive (dtypes, devices, ranks; sizes are specialised unless they are
    SymInts).
    """
    compiled = _compile_graph(gm, list(example_inputs), decompositions=decompositions)

    def run(*inputs):
        out = compiled(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    run.__name__ = f"neuron_compiled_{getattr(gm, '_get_name', lambda: 'graph')()}"
    return run


def get_backend():
    """The backend callable (for ``torch.compile(backend=torch_neuronx.compile.get_backend())``)."""
    return neuron_backend
