"""The modelled serving step: prefill of a batch of prompts and one decode step, under tensor
parallelism.

Prefill is the forward of ``batch x context`` tokens (the training step's forward terms).
A decode step produces one token per sequence: it streams every local weight and the KV cache
once from HBM and computes ``batch`` tokens, so its time per layer is the larger of the
TensorE time and the HBM time, plus the launches and the two tensor-parallel all-reduces of
a layer (latency-bound at decode sizes). KV cache: 2 (K and V) x layers x kv_dim x bytes per
token.
"""
from __future__ import annotations

from dataclasses import dataclass

from .estimate import _BYTES, _coll, _matmul_seconds
from .workload import Matmul


@dataclass
class ServeEstimate:
    tp: int
    batch: int
    context: int
    ttft_seconds: float
    itl_seconds: float
    tokens_per_second_per_chip: float
    kv_cache_bytes: int        # per device
    hbm_bytes: int             # per device: weights + KV cache
    hbm_capacity: int

    @property
    def fits(self) -> bool:
        return self.hbm_bytes <= self.hbm_capacity

    def __str__(self):
        return (f"tp={self.tp:<3d} batch {self.batch:4d} context {self.context:6d}: TTFT "
                f"{self.ttft_seconds * 1e3:8.2f} ms  ITL {self.itl_seconds * 1e3:7.3f} ms  "
                f"{self.tokens_per_second_per_chip:9.1f} tok/s/chip  KV {self.kv_cache_bytes / 2**30:.2f} GiB  "
                f"HBM {self.hbm_bytes / 2**30:.1f}/{self.hbm_capacity / 2**30:.0f} GiB"
                + ("" if self.fits else " DOES NOT FIT"))


def serving(model, cluster, tp: int, batch: int, context: int, dtype: str = "bfloat16") -> ServeEstimate:
    if model.heads % tp or (model.kv_heads or model.heads) % tp:
        raise ValueError(f"tp={tp} does not divide {model.heads} heads / {model.kv_heads or model.heads} kv heads")
    if tp > cluster.devices:
        raise ValueError(f"tp={tp} exceeds the {cluster.devices} devices of {cluster.name} x {cluster.chips}")
    p, lnc, bpe = cluster.profile, cluster.lnc, _BYTES[dtype]
    hbm_bw = p.core_hbm_bandwidth(lnc)
    launch = p.launch_overhead_ns * 1e-9
    kernels = 12

    # Prefill: the forward over batch x context tokens.
    seqs = model.__class__(**{**model.__dict__, "seq": context})
    mms = seqs.layer_matmuls(batch)
    t_mm = sum(_matmul_seconds(cluster, m, tp, dtype) for m in mms)
    t_elem = seqs.layer_elementwise_elems(batch) * bpe / tp / hbm_bw
    act = batch * context * model.hidden * bpe
    t_ar = 2 * _coll(cluster, "all_reduce", act, tp, 1)
    head = _matmul_seconds(cluster, Matmul("lm_head", 1, batch, model.hidden, model.vocab, "n"), tp, dtype)
    ttft = model.layers * (t_mm + t_elem + kernels * launch + t_ar) + head

    # Decode: one token per sequence against `context` cached tokens.
    weights = model.active_params() * bpe // tp
    kv_per_token = 2 * model.layers * model.kv_dim * bpe // tp
    kv = kv_per_token * batch * context
    dmms = [Matmul(m.name, m.count, batch if m.split != "batch" else 1, m.k, m.n, m.split)
            for m in model.layer_matmuls(1) if m.split != "batch"]
    t_dmm = sum(_matmul_seconds(cluster, m, tp, dtype) for m in dmms)
    t_attn = 2 * _matmul_seconds(cluster, Matmul("decode_attn", batch * model.heads, 1, model.head_dim,
                                                 context, "batch"), tp, dtype)
    layer_bytes = (weights - model.vocab * model.hidden * bpe // tp) / model.layers + kv / model.layers
    t_layer = max(t_dmm + t_attn, layer_bytes / hbm_bw) + kernels * launch + \
        2 * _coll(cluster, "all_reduce", batch * model.hidden * bpe, tp, 1)
    head_bytes = model.vocab * model.hidden * bpe // tp
    itl = model.layers * t_layer + max(head, head_bytes / hbm_bw)
    # A chip holds devices_per_chip / tp replicas (or a replica spans tp / devices_per_chip chips).
    per_chip = batch / itl * cluster.devices_per_chip / tp
    return ServeEstimate(tp, batch, context, ttft, itl, per_chip, kv,
                         weights + kv, p.core_hbm_bytes(lnc))
