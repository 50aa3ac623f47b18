"""Paged-KV attention for vLLM on neuron: vLLM's own fused CPU kernels run on the device's
queue where they cover the layer (cpu_attention.py), otherwise plain torch, as below.

The KV cache of a layer is vLLM's ``[num_blocks, num_kv_heads, block_size, head_size +
head_size_v]`` in its identity layout (LBHNC, the one vLLM's CPU kernels read); the plain path
keeps keys then values in the last dimension of each slot, the fused kernels each block's
keys then its values. The plain path writes new keys and values through the slot mapping.
One ``scaled_dot_product_attention`` per layer covers all the decoding requests of a step
(one new token each; their cached keys and values gathered through the block table, padded
to the longest and masked), one more all the prompts
processed whole (their own new keys and values, padded and masked causally). A chunk that
continues cached tokens (chunked prefill, prefix-cache hit) is attended on its own with a
bottom-right causal mask; a lone whole prompt with plain causal SDPA, which the cost model
charges as NKI-lib's ``attention_cte`` (torch_neuronx/kernels/nkilib_routes.py). Masked calls
are charged on the roofline (an explicit mask keeps SDPA off NKI-lib's kernels).

Sliding windows (Mistral, Gemma 2/3) and logit soft caps (Gemma 2) are arguments of vLLM's
fused kernels. On the plain path a window narrows each of those masks to the window's keys,
and a soft cap has the scores computed here (``_attention``: ``cap * tanh(s / cap)`` before
the mask and softmax, as Transformers' eager attention does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl,
                                       AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers
from vllm.v1.kv_cache_layout import KVCacheLayout

from . import cpu_attention


class NeuronAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        # vLLM's registry has one slot for an out-of-tree backend.
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        # vLLM's CPU kernels read head-major block interiors; the plain path reads any.
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def get_supported_head_sizes(cls) -> list:
        return []   # any

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls():
        return NeuronAttentionImpl

    @staticmethod
    def get_builder_cls():
        return NeuronAttentionMetadataBuilder


@dataclass
class NeuronAttentionMetadata:
    num_actual_tokens: int
    query_starts: list          # host ints, num_reqs + 1
    seq_lens: list              # host ints, tokens in the cache after this step
    block_ids: dict             # prefill request -> device tensor of its blocks
    slot_blocks: torch.Tensor   # per new token: cache block (device)
    slot_offsets: torch.Tensor  # per new token: slot within the block (device)
    prefills: list              # requests attended one by one
    decode: tuple | None        # (token index, cache blocks, offsets, mask) of the decodes
    prompts: tuple | None       # (token index [n, L], valid flat index, mask) of whole prompts


class NeuronAttentionMetadataBuilder(AttentionMetadataBuilder[NeuronAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.head_size = kv_cache_spec.head_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.num_heads = (get_num_attention_heads_from_layers(vllm_config, layer_names) or
                          vllm_config.model_config.get_num_attention_heads(
                              vllm_config.parallel_config))
        self.dtype = vllm_config.model_config.dtype
        # Decided once per layer group, so the cache is written and read by the same kernels.
        # The fused kernels' work plan, shared by the group, may assume a sliding window only
        # where every layer has it (-1: none); each layer passes its own to the kernel (as
        # vLLM's CPU backend does for Gemma's windowed and global layers in one group).
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()
        windows = {getattr(layer.impl, "sliding_window", None) for layer in layers}
        self.window = (next(iter(windows)) or -1) if len(windows) == 1 else -1
        self.fused = cpu_attention.usable(self.head_size, self.block_size, self.dtype,
                                          vllm_config.cache_config.cache_dtype)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False):
        m = common_attn_metadata
        if self.fused:
            return cpu_attention.build(m, self.num_heads, self.num_kv_heads, self.head_size,
                                       self.dtype, self.block_size, self.window)
        n_req, n_tok, bs = m.num_reqs, m.num_actual_tokens, self.block_size
        # One host read per step, shared by every layer.
        starts = m.query_start_loc_cpu[:n_req + 1].tolist()
        seq_lens = m.seq_lens[:n_req].cpu().tolist()
        slots = m.slot_mapping[:n_tok]
        table = m.block_table_tensor
        lq = [starts[i + 1] - starts[i] for i in range(n_req)]
        decodes = [i for i in range(n_req) if lq[i] == 1]
        whole = [i for i in range(n_req) if 1 < lq[i] == seq_lens[i]]
        prefills = [i for i in range(n_req) if 1 < lq[i] < seq_lens[i]]
        if len(whole) == 1:
            prefills, whole = prefills + whole, []
        block_ids = {i: table[i, :(seq_lens[i] + bs - 1) // bs] for i in prefills}
        return NeuronAttentionMetadata(
            num_actual_tokens=n_tok, query_starts=starts, seq_lens=seq_lens,
            block_ids=block_ids, slot_blocks=torch.div(slots, bs, rounding_mode="floor"),
            slot_offsets=torch.remainder(slots, bs), prefills=prefills,
            decode=self._decode(decodes, starts, seq_lens, table) if decodes else None,
            prompts=_prompts(whole, starts, lq, table.device) if whole else None)

    def _decode(self, rows, starts, seq_lens, table):
        """Where each decoding request's cached tokens are, padded to the longest: padding
        points at the request's first token (finite data, unlike unwritten cache) and is
        masked out."""
        bs, dev = self.block_size, table.device
        lens = torch.tensor([seq_lens[i] for i in rows])
        width = int(lens.max())
        pos = torch.arange(width)
        valid = pos[None, :] < lens[:, None]
        pos = torch.where(valid, pos[None, :], 0)
        host_table = table[:max(rows) + 1, :(width + bs - 1) // bs].cpu()
        blocks = host_table[torch.tensor(rows)[:, None], pos // bs].to(torch.int64)
        tokens = torch.tensor([starts[i] for i in rows])
        return (tokens.to(dev), blocks.to(dev), (pos % bs).to(dev),
                valid[:, None, None, :].to(dev))


def _prompts(rows, starts, lq, dev):
    """Whole prompts padded to the longest: padding repeats the prompt's first token, and
    each query sees its own prompt's keys up to itself."""
    lens = torch.tensor([lq[i] for i in rows])
    width = int(lens.max())
    pos = torch.arange(width)
    valid = pos[None, :] < lens[:, None]
    tokens = torch.tensor([starts[i] for i in rows])[:, None] + torch.where(valid, pos, 0)
    mask = valid[:, None, None, :] & _band(width, width)
    flat = valid.flatten().nonzero().squeeze(1)
    return tokens.to(dev), flat.to(dev), tokens.flatten()[flat].to(dev), mask.to(dev)


class NeuronAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None) -> None:
        unsupported = [name for name, v in (("ALiBi", alibi_slopes),
                                            ("attention sinks", sinks)) if v]
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"{attn_type} attention")
        if unsupported:
            raise NotImplementedError(
                f"neuron paged attention: {', '.join(unsupported)} not supported "
                f"(num_heads={num_heads}, head_size={head_size})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # A query attends to itself and the sliding_window - 1 keys before it.
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        meta = meta.get(layer.layer_name) if isinstance(meta, dict) else meta
        if meta is None:    # a profiling run without a cache
            return
        if isinstance(meta, cpu_attention.FusedMetadata):
            return cpu_attention.update(key, value, kv_cache, slot_mapping, meta)
        n, d = meta.num_actual_tokens, key.shape[-1]
        blk, off = meta.slot_blocks, meta.slot_offsets
        kv_cache[blk, :, off, :d] = key[:n]
        kv_cache[blk, :, off, d:] = value[:n]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("neuron paged attention: fused output quantization "
                                      "is not supported")
        if attn_metadata is None:   # profiling run
            return output
        if isinstance(attn_metadata, cpu_attention.FusedMetadata):
            cpu_attention.attend(query, kv_cache, output, self.scale, self.num_kv_heads,
                                 attn_metadata, self.sliding_window or -1,
                                 self.logits_soft_cap or 0.0)
            return output
        m, d, w = attn_metadata, self.head_size, self.sliding_window
        out = output.view(output.shape[0], self.num_heads, -1)
        if m.decode is not None:
            tokens, blocks, offsets, mask = m.decode
            kv = kv_cache[blocks, :, offsets].transpose(1, 2)     # [n, Hkv, width, d + dv]
            k, v = kv[..., :d], kv[..., d:]
            q = query.index_select(0, tokens).unsqueeze(2)          # [n, Hq, 1, d]
            if w is not None:   # keys at or after position len - w
                lens = mask.sum(-1, keepdim=True)
                mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= lens - w)
            o = self._attention(q, k, v, mask=mask)
            out.index_copy_(0, tokens, o.squeeze(2))
        if m.prompts is not None:
            tokens, flat, dest, mask = m.prompts
            n, width = tokens.shape
            q = query[tokens].transpose(1, 2)                       # [n, Hq, width, d]
            k = key[tokens].transpose(1, 2)                         # [n, Hkv, width, d]
            v = value[tokens].transpose(1, 2)
            if w is not None:
                mask = mask & _band(width, width, w, mask.device)
            o = self._attention(q, k, v, mask=mask)
            o = o.transpose(1, 2).flatten(0, 1).index_select(0, flat)
            out.index_copy_(0, dest, o)
        for i in m.prefills:
            s = m.seq_lens[i]
            q0, q1 = m.query_starts[i], m.query_starts[i + 1]
            lq = q1 - q0
            blocks = kv_cache.index_select(0, m.block_ids[i])      # [nb, Hkv, bs, d + dv]
            kv = blocks.transpose(0, 1).flatten(1, 2)[:, :s]       # [Hkv, s, d + dv]
            k, v = kv[..., :d], kv[..., d:]
            q = query[q0:q1].transpose(0, 1).unsqueeze(0)          # [1, Hq, lq, d]
            if lq == s and w is None:   # the whole sequence: plain causal
                o = self._attention(q, k.unsqueeze(0), v.unsqueeze(0), causal=True)
            else:                   # a chunk after cached tokens: bottom-right causal
                o = self._attention(q, k.unsqueeze(0), v.unsqueeze(0),
                                    mask=_band(lq, s, w, q.device))
            out[q0:q1] = o.squeeze(0).transpose(0, 1)
        return output

    def _attention(self, q, k, v, mask=None, causal=False):
        """Attention of q [.., Hq, lq, d] over k, v [.., Hkv, s, d]: SDPA (grouped-query
        heads share their K/V inside it, no copies), or with a logit soft cap the scores
        computed here."""
        gqa = self.num_heads != self.num_kv_heads
        cap = self.logits_soft_cap
        if cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  scale=self.scale, enable_gqa=gqa)
        if gqa:
            r = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * self.scale / cap) * cap
        if causal:
            mask = _band(*scores.shape[-2:], device=q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def _band(lq: int, s: int, w: int | None = None, device=None) -> torch.Tensor:
    """[lq, s] bottom-right causal mask: query i (position s - lq + i) sees the keys up to
    itself, with a sliding window ``w`` only the w - 1 before it."""
    ones = torch.ones(lq, s, dtype=torch.bool, device=device)
    return ones.tril(s - lq) if w is None else ones.tril(s - lq) & ones.triu(s - lq - (w - 1))
