"""``NeuronWorker``: vLLM's GPU worker with the device, memory sizing and warm-up of neuron."""
from __future__ import annotations

import contextlib
import logging
import os

import psutil
import torch
from vllm.config import set_current_vllm_config
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from . import LOGGER

log = logging.getLogger(LOGGER)

# The KV cache lives in the device's memory, which is host memory: never size it beyond
# this share of what the host has free, whatever the modelled HBM would allow.
_HOST_SHARE = 0.5


class NeuronWorker(Worker):
    def init_device(self):
        if self.use_v2_model_runner:
            raise NotImplementedError(
                "neuron: vLLM's V2 model runner is not supported by the neuron plugin; "
                "unset VLLM_USE_V2_MODEL_RUNNER")
        count = torch.neuron.device_count()
        if not 0 <= self.local_rank < count:
            raise RuntimeError(f"neuron: worker rank {self.local_rank} has no device "
                               f"({count} visible neuron device(s))")
        self.device = torch.device("neuron", self.local_rank)
        current_platform.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        # The "neuron" backend binds each rank to neuron:LOCAL_RANK when the world group is
        # created, as torchrun ranks expect; vLLM's workers are one host's ranks, so say
        # which (as vLLM's XPU worker does for oneCCL). An inherited LOCAL_RANK would
        # otherwise move this worker, and its collectives, to another device.
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(self.parallel_config.world_size)
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank,
            current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        self._init_workspace_and_model_runner()

    def _make_model_runner(self):
        from .model_runner import NeuronModelRunner
        return NeuronModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str):
        # No sleep-mode memory pools: weights, workspace and KV cache use the device's
        # caching allocator directly.
        return contextlib.nullcontext()

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: ``kv_cache_memory_bytes`` when given, else the modelled
        HBM times ``gpu_memory_utilization`` less the peak of a profiling run (as on CUDA),
        capped at half the host's free memory."""
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit:
            return int(explicit)
        torch.neuron.reset_peak_memory_stats(self.device)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.profile_run()
        peak = torch.neuron.max_memory_allocated(self.device)
        total = current_platform.get_device_total_memory(self.device.index)
        util = self.cache_config.gpu_memory_utilization
        budget = int(total * util) - peak
        if budget <= 0:
            raise ValueError(
                f"neuron: no memory left for the KV cache on {self.device}: the model and a "
                f"profiling step peak at {peak / 2**30:.2f} GiB of the "
                f"{total / 2**30:.2f} GiB modelled HBM x gpu_memory_utilization {util}. "
                "Raise gpu_memory_utilization or TORCH_NEURONX_HBM_BYTES, or set "
                "kv_cache_memory_bytes.")
        host = int(psutil.virtual_memory().available * _HOST_SHARE)
        if budget > host:
            log.info("neuron: KV cache limited to %.2f GiB (half the host's free memory) "
                     "instead of %.2f GiB of modelled HBM", host / 2**30, budget / 2**30)
            budget = host
        return budget

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Eager execution: nothing to compile or capture.
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def modelled_summary(self) -> dict:
        """The modelled serving cost so far (``LLM.collective_rpc("modelled_summary")``)."""
        return self.model_runner.modelled.summary.as_dict()

    def reset_modelled_summary(self) -> None:
        self.model_runner.modelled.reset()

    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError("neuron: sleep mode is not supported by the neuron plugin")

    def wake_up(self, tags=None) -> None:
        raise NotImplementedError("neuron: sleep mode is not supported by the neuron plugin")
