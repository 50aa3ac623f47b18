"""Plain-torch versions of the Triton kernels vLLM's model runner launches on its device.

Registered through vLLM's ``register_kernels`` (``NeuronPlatform.register_triton_kernel_overrides``),
so they run as ordinary ops on neuron tensors."""
from __future__ import annotations

import torch


def compute_slot_mapping(num_tokens, max_num_tokens, query_start_loc, positions, block_table,
                         block_table_stride, slot_mapping, KV_CACHE_BLOCK_SIZE,
                         TOTAL_CP_WORLD_SIZE=1, TOTAL_CP_RANK=0,
                         CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1, BLOCK_SIZE=1024):
    """The cache slot of every scheduled token: its request's block for the token's
    position, times the block size, plus the position within the block; PAD_ID after."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("neuron: context parallelism (decode/prefill context "
                                  f"parallel world size {TOTAL_CP_WORLD_SIZE}) is not supported")
    bs = KV_CACHE_BLOCK_SIZE
    tokens = torch.arange(num_tokens, device=positions.device)
    req = torch.searchsorted(query_start_loc[1:].to(torch.int64), tokens, right=True)
    pos = positions[:num_tokens]
    blocks = block_table[req, torch.div(pos, bs, rounding_mode="floor")].to(torch.int64)
    slot_mapping[:num_tokens] = blocks * bs + torch.remainder(pos, bs)
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


OVERRIDES = {
    "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
}
