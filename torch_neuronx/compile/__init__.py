"""``torch_neuronx.compile``: the ``torch.compile`` backend of the neuron device.

Importing this package is cheap: it installs import hooks that register the device with
Dynamo and Inductor the first time either is imported (``import torch`` must stay fast and
must not import them), and one that wraps Transformers' MoE experts functions
(``kernels/moe.py``). The backend itself is ``"neuron"`` in Dynamo's registry (entry point
``torch_dynamo_backends``); ``torch.compile(model)`` with Inductor also works on neuron.

Public API:

- ``neuron_backend``: the Dynamo backend (also ``torch.compile(backend="neuron")``);
- ``compile_aten_graph(gm, example_inputs)``: the code generator on its own;
- ``modelled_graph_time()`` / ``reset_modelled_graph_time()``: modelled Trainium time of
  compiled graphs (their fused kernels also add into ``torch_neuronx.modelled_time()``);
- ``cache_dir()``: where compiled graphs persist;
- ``NeuronCompileError``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys

__all__ = ["neuron_backend", "compile_aten_graph", "modelled_graph_time",
           "reset_modelled_graph_time", "cache_dir", "NeuronCompileError", "GraphTime"]

_LAZY = {
    "neuron_backend": (".backend", "neuron_backend"),
    "get_backend": (".backend", "get_backend"),
    "compile_aten_graph": (".backend", "compile_aten_graph"),
    "modelled_graph_time": (".cost", "modelled_graph_time"),
    "reset_modelled_graph_time": (".cost", "reset_modelled_graph_time"),
    "GraphTime": (".cost", "GraphTime"),
    "cache_dir": (".cache", "cache_dir"),
    "NeuronCompileError": (".passes", "NeuronCompileError"),
}


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod, __name__), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _on_dynamo(_module) -> None:
    from . import codegen, passes
    codegen.register_dynamo()
    passes.install_recompile_reasons_hook()


def _on_inductor_common(_module) -> None:
    from . import codegen
    codegen.register_inductor()


def _on_inductor_decomposition(_module) -> None:
    from . import decompositions
    decompositions.install()


def _on_flex_attention(_module) -> None:
    from . import flex
    flex.allow_neuron_device()


def _on_inductor_flex(_module) -> None:
    from . import flex
    flex.install_inductor_lowerings()


def _on_transformers_moe(module) -> None:
    # not a compiler hook: the same post-import mechanism lets the device charge
    # Transformers' MoE experts as NKI-lib's kernels (kernels/moe.py)
    from ..kernels import moe
    moe.install(module)


_HOOKS = {"torch._dynamo": _on_dynamo, "torch._inductor.codegen.common": _on_inductor_common,
          "torch._inductor.decomposition": _on_inductor_decomposition,
          "torch.nn.attention.flex_attention": _on_flex_attention,
          "torch._inductor.kernel.flex.flex_attention": _on_inductor_flex,
          "transformers.integrations.moe": _on_transformers_moe}


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs a callback right after a watched module finishes executing."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_hook(module, _exec=exec_module, _name=fullname):
            _exec(module)
            callback = _HOOKS.pop(_name, None)
            if callback is not None:
                _run_hook(_name, callback, module)

        # The loader belongs to this one module's spec, so patching it is local.
        loader.exec_module = exec_and_hook
        return spec


def _run_hook(name, callback, module) -> None:
    # A failing registration must not break the import of a PyTorch module (that would
    # leave it half-initialised for everyone); report it and carry on without neuron.
    try:
        callback(module)
    except Exception as exc:  # noqa: BLE001
        import warnings
        warnings.warn(f"torch_neuronx: registering the neuron device with {name} failed: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)


def _install_hooks() -> None:
    """Register with Dynamo/Inductor now if they are loaded, else when they get imported."""
    for name in list(_HOOKS):
        if name in sys.modules:
            _run_hook(name, _HOOKS.pop(name), sys.modules[name])
    if _HOOKS and not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())
