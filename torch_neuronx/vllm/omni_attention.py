"""Diffusion attention on neuron: vLLM-Omni's SDPA backend, dispatched for this platform.

Omni's attention implementations pick their forward by platform (CUDA, ROCm, NPU, XPU,
MUSA) and raise for any other; ``scaled_dot_product_attention`` on neuron tensors runs with
CPU numerics, so the neuron forward is the SDPA implementation's own, with the key-padding
mask broadcast as on CUDA.
"""
from __future__ import annotations

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class NeuronSDPAImpl(SDPAImpl):
    def forward(self, query, key, value, attn_metadata=None):
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class NeuronSDPABackend(SDPABackend):
    @staticmethod
    def get_name() -> str:
        return "NEURON_SDPA"

    @staticmethod
    def get_impl_cls() -> type[NeuronSDPAImpl]:
        return NeuronSDPAImpl
