"""vLLM's fused CPU paged-attention kernels on neuron tensors, run on the device's queue.

vLLM's CPU build registers ``_C::cpu_attn_reshape_and_cache`` and
``_C::cpu_attention_with_kv_cache`` as catch-all composites: called with neuron tensors
they would run at once on the calling thread, racing the work still queued on the device.
``available()`` loads the build for this host's ISA (as vLLM's CPU platform does) and routes
both to the device (``_C._route_to_queue``): they then run on the device's queue in stream
order, asynchronously, like any op (they return nothing). The attention backend uses them
when ``usable()`` says vLLM's CPU kernels cover the layer; otherwise its plain-torch path.

Modelled time: one launch per layer and step that runs each request's attention as NKI-lib's
kernel at its shape (``attention_tkg`` for a decode, ``attention_cte`` for a prompt or chunk,
through the cost model's SDPA route) one after another; the cache write as a device copy of
the new keys and values.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from .. import _C, _state, cost_model
from ..kernels import nkilib_routes as routes
from . import LOGGER

log = logging.getLogger(LOGGER)

_OPS = ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache", "get_scheduler_metadata")
# vLLM's CPU_ATTN backend: its head sizes, and its kernels' block granularity (16 for the
# "vec16" ISA, which vLLM picks for blocks that are not a multiple of 32).
_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_BLOCK = 16


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """vLLM's CPU attention kernels are loaded and routed to the device's queue."""
    from vllm.platforms.cpu import CpuPlatform
    try:
        CpuPlatform.import_kernels()
    except Exception as e:     # a vLLM build without CPU kernels: the plain path serves
        log.info("neuron: vLLM's CPU attention kernels did not load (%r); paged attention "
                 "runs in plain torch", e)
        return False
    if not all(hasattr(torch.ops._C, name) for name in _OPS):
        log.info("neuron: this vLLM build has no CPU attention kernels; paged attention runs "
                 "in plain torch")
        return False
    for name in _OPS:
        _C._route_to_queue(f"_C::{name}")
    return True


def usable(head_size: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: str) -> bool:
    """Do vLLM's CPU kernels cover a layer with this head size, block size and cache dtype?"""
    return (kv_cache_dtype == "auto" and head_size in _HEAD_SIZES and block_size % _BLOCK == 0
            and dtype in (torch.float32, torch.bfloat16, torch.float16) and available())


def isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, block_size, head_size, "auto")


@dataclass
class FusedMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor      # device
    seq_lens: torch.Tensor             # device
    block_table: torch.Tensor          # device
    scheduler_metadata: torch.Tensor   # device (planned on the host)
    isa: str
    query_lens: list                   # host ints: what the modelled charge is priced from
    seq_lens_host: list


def build(common, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
          block_size: int, window: int = -1) -> FusedMetadata:
    """The kernels' metadata for a step. The work split is planned by vLLM's own planner from
    the device's sequence lengths: routed to the device, it waits for the queue (it reads the
    lengths on the host) and its result becomes device memory without a copy, which matters:
    the plan holds pointers into its own buffer. ``window``: the sliding window every layer
    of the group shares (-1: none), which the plan depends on."""
    from vllm import envs
    n = common.num_reqs
    qsl, seq = common.query_start_loc[:n + 1], common.seq_lens[:n]
    kind = isa(dtype, block_size, head_size)
    sched = torch.ops._C.get_scheduler_metadata(
        n, num_heads, num_kv_heads, head_size, seq, dtype, qsl, True, window, kind,
        envs.VLLM_CPU_ATTN_SPLIT_KV, None, "auto")
    starts = common.query_start_loc_cpu[:n + 1].tolist()
    return FusedMetadata(
        num_actual_tokens=common.num_actual_tokens, query_start_loc=qsl, seq_lens=seq,
        block_table=common.block_table_tensor[:n], scheduler_metadata=sched, isa=kind,
        query_lens=[starts[i + 1] - starts[i] for i in range(n)], seq_lens_host=seq.tolist())


def _split(kv_cache: torch.Tensor):
    """Key and value caches as the kernels read them: each block holds its keys, then its
    values ([num_blocks, heads, 2 * block_size, head_size] halves)."""
    if not kv_cache.is_contiguous():
        raise RuntimeError(f"neuron paged attention: vLLM's CPU kernels need a contiguous "
                           f"[blocks, heads, block_size, 2 * head_size] cache, got shape "
                           f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    nb, h, bs, _ = kv_cache.shape
    return kv_cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)


def update(key, value, kv_cache, slot_mapping, meta: FusedMetadata) -> None:
    k_cache, v_cache = _split(kv_cache)
    cfg = _state.config()
    nbytes = 2 * key.numel() * key.element_size()
    seconds = cost_model.copy_seconds(cfg.profile, cfg.lnc, "copy_d2d", nbytes)
    with routes.charged_as(key.device, "cpu_attn_reshape_and_cache", seconds, engine="dma",
                           hbm_bytes=2 * nbytes):
        torch.ops._C.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping,
                                                 meta.isa)


def attend(query, kv_cache, output, scale: float, num_kv_heads: int,
           meta: FusedMetadata, window: int = -1, softcap: float = 0.0) -> None:
    n = meta.num_actual_tokens
    k_cache, v_cache = _split(kv_cache)
    seconds, flops = _priced(query.shape[1], num_kv_heads, query.shape[2],
                             cost_model.priced_dtype(query.dtype),
                             tuple(zip(meta.query_lens, meta.seq_lens_host)))
    with routes.charged_as(query.device, "paged_attention", seconds, engine="tensor",
                           flops=flops):
        torch.ops._C.cpu_attention_with_kv_cache(
            query[:n], k_cache, v_cache, output[:n], meta.query_start_loc, meta.seq_lens, scale,
            True, None, window, meta.block_table, softcap, meta.scheduler_metadata, None,
            None)


def _priced(heads, kv_heads, d, dtype, requests):
    """(seconds, flops): one launch that runs each request's causal attention as NKI-lib's
    kernel at its shape, priced by the cost model's SDPA route (attention_tkg for decode
    shapes, else attention_cte), one after another."""
    cfg = _state.config()
    launch = cfg.profile.launch_overhead_ns * 1e-9
    seconds, flops = launch, 0.0
    for sq, skv in requests:
        if sq <= 8:     # a decode: attention_tkg reads the cache in 128-token tiles
            skv = max(skv, 128)
        s, f = _request(cfg.profile.name, cfg.lnc, heads, kv_heads, d, dtype, sq, skv)
        seconds += s - launch
        flops += f
    return seconds, flops


@functools.lru_cache(maxsize=4096)
def _request(chip, lnc, heads, kv_heads, d, dtype, sq, skv):
    p = _state.config().profile
    shapes = ((1, heads, sq, d), (1, kv_heads, skv, d), (1, kv_heads, skv, d))
    item = dtype.itemsize
    bytes_in = (heads * sq + 2 * kv_heads * skv) * d * item
    s, _, f = cost_model.op_seconds(p, lnc, routes.FWD, shapes, dtype, bytes_in,
                                    heads * sq * d * item, flags=1)
    return s, f
