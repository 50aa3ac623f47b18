"""``NeuronModelRunner``: vLLM's GPU model runner (continuous batching, prefix caching,
chunked prefill, sampling) on neuron devices, with the modelled Trainium time of each step."""
from __future__ import annotations

import contextlib
import functools

import torch
from vllm.distributed import get_tp_group
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from . import metrics


class NeuronModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        with _cuda_names_as_neuron():
            super().__init__(vllm_config, device)
        self.use_cuda_graph = False
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.modelled = metrics.StepClock(device, tp, publish=get_tp_group().rank_in_group == 0)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.modelled.begin()
        with _cuda_names_as_neuron():
            out = super().execute_model(scheduler_output, intermediate_tensors)
        self.modelled.step(scheduler_output)
        return out

    def sample_tokens(self, grammar_output):
        with _cuda_names_as_neuron():
            out = super().sample_tokens(grammar_output)
        self.modelled.sampled()
        return out

    def _sync_device(self) -> None:
        torch.neuron.synchronize(self.device)

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list:
        return sampled_token_ids.tolist()


@contextlib.contextmanager
def _cuda_names_as_neuron():
    """vLLM's GPU runner names ``torch.cuda`` streams and events: give it neuron's.

    Each callable is wrapped in its own ``functools.partial``: Dynamo keys handlers on the
    function objects and refuses one registered under two names."""
    saved = {k: getattr(torch.cuda, k) for k in
             ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream")}
    torch.cuda.Stream = torch.neuron.Stream
    torch.cuda.Event = _event
    torch.cuda.current_stream = functools.partial(torch.neuron.current_stream)
    torch.cuda.default_stream = functools.partial(torch.neuron.default_stream)
    torch.cuda.stream = functools.partial(torch.neuron.stream)
    torch.cuda.set_stream = functools.partial(torch.neuron.set_stream)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)


def _event(*args, blocking=None, **kwargs):
    # torch.neuron.Event, like torch.xpu's, has no ``blocking`` argument.
    return torch.neuron.Event(*args, **kwargs)
