"""vLLM platform plugin: serve models on the neuron device through vLLM's own engine.

Loaded by vLLM through the ``vllm.platform_plugins`` entry point, never by
``import torch_neuronx`` (vLLM lives in its own environment, ``make serving-setup``).
"""
from __future__ import annotations

PLATFORM = "torch_neuronx.vllm.platform.NeuronPlatform"
# A child of vLLM's logger: vLLM's handler and VLLM_LOGGING_LEVEL apply, in every process.
LOGGER = "vllm.neuron"


def register() -> str | None:
    """Entry point of ``vllm.platform_plugins``: the platform class path, or None when no
    neuron device is visible (``NEURON_RT_NUM_CORES=0``), so vLLM keeps its built-in
    platforms. A failing ``import torch_neuronx`` raises (vLLM logs it at debug level)."""
    import torch
    import torch_neuronx  # noqa: F401  (torch's autoload may be switched off)

    return PLATFORM if torch.neuron.is_available() else None
