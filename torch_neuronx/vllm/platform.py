"""``NeuronPlatform``: what vLLM asks of a device, answered for the neuron device."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch_neuronx  # noqa: F401  (registers the device when torch's autoload is off)
from vllm.platforms.interface import Platform, PlatformEnum

from . import LOGGER

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(LOGGER)

WORKER = "torch_neuronx.vllm.worker.NeuronWorker"
ATTENTION = "torch_neuronx.vllm.attention.NeuronAttentionBackend"
# Tokens per KV-cache block when the user names none: one NKI-lib decode tile of keys
# would be 128, but small blocks waste less of a short request's cache.
DEFAULT_BLOCK_SIZE = 32


class NeuronPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "neuron"
    device_type: str = "neuron"
    # vLLM registers its torch.ops.vllm.* ops under this key; ours is PrivateUse1.
    dispatch_key: str = "PrivateUse1"
    # Tensor-parallel workers reduce and gather neuron tensors through our c10d backend
    # (vLLM makes its own gloo group for CPU-side coordination).
    dist_backend: str = "neuron"
    device_control_env_var: str = "NEURON_RT_VISIBLE_CORES"
    simple_compile_backend: str = "eager"
    supported_quantization: list = []

    @property
    def supported_dtypes(self) -> list:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"neuron: model dtype {dtype} is not supported for serving "
                             "(bfloat16, float16 or float32)")

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.neuron._describe(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.neuron.get_device_properties(device_id).total_memory

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        p = torch.neuron.get_device_properties(device_id)
        return f"neuron-{p.platform}-core{p.core_id}"

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.neuron.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.neuron.manual_seed_all(seed)

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(torch.neuron.memory_allocated(device))

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def inference_mode(cls):
        return torch.inference_mode(mode=True)

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's compiled ops are CPU/CUDA kernels; every op the plugin runs is plain
        # torch on neuron, so nothing is imported (a missing vllm._C is not an error).
        return None

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from vllm.triton_utils.dispatcher import register_kernels

        from .kernels import OVERRIDES
        register_kernels(OVERRIDES)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if getattr(attn_selector_config, "use_mla", False):
            raise NotImplementedError("neuron: MLA attention is not supported by the "
                                      "neuron vLLM plugin's paged attention backend")
        if getattr(attn_selector_config, "use_sparse", False):
            raise NotImplementedError("neuron: sparse attention is not supported by the "
                                      "neuron vLLM plugin's paged attention backend")
        if selected_backend is not None and selected_backend.name != "CUSTOM":
            log.info("neuron: attention backend %s is not available on neuron; using "
                     "the plugin's paged SDPA backend", selected_backend.name)
        return ATTENTION

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return ("vllm.distributed.device_communicators.base_device_communicator."
                "DeviceCommunicatorBase")

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("neuron: LoRA serving is not supported by the neuron "
                                  "vLLM plugin yet")

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER
        _check_parallel(parallel)
        if parallel.enable_dbo:
            parallel.enable_dbo = False

        # Eager execution: no CUDA graphs, no torch.compile of the model (the device's
        # compile path is torch.compile(backend="neuron"), which vLLM does not drive).
        comp = vllm_config.compilation_config
        comp.mode = CompilationMode.NONE
        comp.cudagraph_mode = CUDAGraphMode.NONE
        comp.cudagraph_capture_sizes = []
        if vllm_config.model_config is not None:
            vllm_config.model_config.enforce_eager = True

        # The device runtime has executor threads; a forked engine process would inherit
        # their locks but not the threads.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = DEFAULT_BLOCK_SIZE
        # The model runner's step is synchronous: the host finishes a step before the
        # scheduler plans the next one.
        vllm_config.scheduler_config.async_scheduling = False


def _check_parallel(parallel) -> None:
    """Tensor parallelism over the visible neuron devices (one worker each); the other
    kinds of model parallelism are refused by name."""
    refused = [("pipeline parallel", "pipeline_parallel_size"),
               ("prefill context parallel", "prefill_context_parallel_size"),
               ("decode context parallel", "decode_context_parallel_size"),
               ("data parallel", "data_parallel_size")]
    for what, attr in refused:
        size = getattr(parallel, attr)
        if size > 1:
            hint = ("; for data parallelism run one server per neuron device "
                    "(NEURON_RT_VISIBLE_CORES)" if attr == "data_parallel_size" else "")
            raise NotImplementedError(
                f"neuron: {what} serving ({attr}={size}) is not supported by the neuron "
                f"vLLM plugin; only tensor parallelism is{hint}")
    if parallel.world_size > 1 and os.environ.get("VLLM_DISTRIBUTED_USE_SPLIT_GROUP", "0") != "0":
        # vLLM's split-group path binds its default group to "cuda:<rank>" and NCCL.
        raise NotImplementedError(
            "neuron: VLLM_DISTRIBUTED_USE_SPLIT_GROUP="
            f"{os.environ['VLLM_DISTRIBUTED_USE_SPLIT_GROUP']} is not supported with tensor "
            "parallelism on neuron (vLLM's split-group path is CUDA-only); unset it")
    if parallel.nnodes > 1:
        raise NotImplementedError(
            f"neuron: multi-node serving (nnodes={parallel.nnodes}) is not supported by the "
            "neuron vLLM plugin; tensor parallelism runs on one host's neuron devices")
    tp = parallel.tensor_parallel_size
    count = torch.neuron.device_count()
    if tp > count:
        raise ValueError(
            f"neuron: tensor_parallel_size={tp} needs {tp} neuron devices (one worker each) "
            f"but {count} are visible (torch.neuron.device_count(); set by "
            "NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES)")
