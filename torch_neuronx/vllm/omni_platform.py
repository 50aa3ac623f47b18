"""``NeuronOmniPlatform``: vLLM-Omni's platform interface answered for the neuron device.

vLLM-Omni resolves its own platform (``vllm_omni.platforms.current_omni_platform``) from the
``vllm_omni.platform_plugins`` entry point group; it has no CPU platform, so without this
class its diffusion worker has no device to run on. The vLLM half (device, dtypes, memory,
eager mode) is ``NeuronPlatform``'s; this adds what Omni's diffusion worker asks.
"""
from __future__ import annotations

import torch
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from . import register as _register_llm
from .platform import NeuronPlatform

PLATFORM = "torch_neuronx.vllm.omni_platform.NeuronOmniPlatform"


def register() -> str | None:
    """Entry point of ``vllm_omni.platform_plugins``: the platform class path, or None when
    no neuron device is visible (``NEURON_RT_NUM_CORES=0``), as the LLM plugin decides."""
    return PLATFORM if _register_llm() is not None else None


# Diffusion attention through torch's scaled_dot_product_attention, which the device runs
# with CPU numerics; flash/sage/TRT-LLM backends are CUDA kernels.
_SDPA = "TORCH_SDPA"
ATTENTION = "torch_neuronx.vllm.omni_attention.NeuronSDPABackend"


class NeuronOmniPlatform(NeuronPlatform, OmniPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        if selected_backend is not None and selected_backend.upper() != _SDPA:
            raise ValueError(
                f"neuron: diffusion attention backend {selected_backend!r} is not available "
                f"on neuron (head_size={head_size}); only {_SDPA} is")
        return ATTENTION

    @classmethod
    def get_diffusion_worker_cls(cls) -> str:
        return "torch_neuronx.vllm.omni_worker.NeuronDiffusionWorker"

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # Omni would compile the transformer with Inductor's CPU/CUDA code; the device's
        # compile path is torch.compile(backend="neuron"), which Omni does not drive.
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("neuron") if local_rank is None else torch.device("neuron", local_rank)

    @classmethod
    def get_device_count(cls) -> int:
        return torch.neuron.device_count()

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        torch.neuron.synchronize()

    @classmethod
    def empty_cache(cls) -> None:
        torch.neuron.empty_cache()

    @classmethod
    def record_device_event(cls):
        event = torch.neuron.Event()
        event.record()
        return event

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return torch.neuron.mem_get_info(device)[0]

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        return torch.neuron.mem_get_info(device)

    @classmethod
    def memory_reserved(cls, device: torch.device | int | None = None) -> int:
        return int(torch.neuron.memory_reserved(device))

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        # Omni's own deploy configs, as its CUDA platform uses: they name no device.
        return "vllm_omni/deploy"
