"""The modelled training step of a transformer on a cluster under a layout.

Every term is named in the breakdown, and each comes from the chip profile, the collective
model the distributed backend charges (``torch_neuronx.distributed.collectives_model``) or
the cost model's TensorE timing (``torch_neuronx.cost_model``); nothing is fitted.

- compute: per device, the layer matmuls (TensorE time of each, from the cost model, with
  tensor parallelism dividing its split dim) and element-wise passes (HBM time), forward and
  backward (2x forward; one more forward with activation checkpointing), for this device's
  layers and tokens;
- launch: the runtime's fixed cost per kernel launch, per kernel;
- tensor-parallel communication (exposed, on the critical path): two all-reduces of the layer
  output forward and two backward (Megatron), or an all-gather and a reduce-scatter each
  with sequence parallelism;
- FSDP communication (overlapped): per layer an all-gather of its parameters forward and
  backward and a reduce-scatter of its gradients; only what exceeds that layer's compute is
  exposed (one layer prefetched, as FSDP2 does);
- data-parallel all-reduce of gradients, overlapped with the backward pass: the excess is
  exposed;
- expert-parallel all-to-all: two (dispatch, combine) forward and two backward per MoE layer,
  exposed;
- pipeline: point-to-point activation sends, exposed, and the 1F1B bubble of (pp - 1) stage
  micro-batch times (Narayanan et al. 2021, eq. 1);
- optimizer: AdamW's HBM traffic per local parameter (read fp32 master, gradient, m, v;
  write master, m, v and the bf16 copy: 30 bytes) at HBM bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..cost_model import _tensore_seconds
from ..distributed.collectives_model import collective_seconds
from .layout import Layout, nodes_spanned

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}
_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8": torch.float8_e4m3fn}
_ADAMW_BYTES_PER_PARAM = 30
# Weights (bf16) + gradients (bf16) + fp32 master, m and v: mixed-precision AdamW state.
_STATE_BYTES_PER_PARAM = 2 + 2 + 12


@dataclass
class Estimate:
    layout: Layout
    step_seconds: float
    tokens_per_second: float
    mfu: float
    breakdown: dict = field(default_factory=dict)   # term -> seconds on the critical path
    hbm_bytes: int = 0                              # per device, peak
    hbm_capacity: int = 0
    flops: float = 0.0                              # whole step, all devices

    @property
    def fits(self) -> bool:
        return self.hbm_bytes <= self.hbm_capacity

    def __str__(self):
        terms = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in self.breakdown.items() if v > 0)
        fit = "fits" if self.fits else "DOES NOT FIT"
        return (f"{str(self.layout):28s} step {self.step_seconds * 1e3:9.2f} ms  "
                f"{self.tokens_per_second:12.0f} tok/s  MFU {self.mfu * 100:5.1f}%  "
                f"HBM {self.hbm_bytes / 2**30:7.1f}/{self.hbm_capacity / 2**30:.0f} GiB {fit}  [{terms} ms]")


def _matmul_seconds(cluster, mm, tp: int, dtype: str) -> float:
    m, k, n, count = mm.m, mm.k, mm.n, mm.count
    if mm.split == "n":
        n = max(1, n // tp)
    elif mm.split == "k":
        k = max(1, k // tp)
    elif mm.split == "batch":
        count = max(1, count // tp)
    return _tensore_seconds(cluster.profile, (count, m, k, n), _TORCH[dtype], cluster.lnc)


def _coll(cluster, op, nbytes, group, stride):
    if group <= 1:
        return 0.0
    nodes = nodes_spanned(group, stride, cluster.devices_per_node)
    return collective_seconds(op, nbytes, group, nodes, cluster.fabric, cluster.lnc)


def training_step(model, cluster, layout: Layout, batch: int, dtype: str = "bfloat16") -> Estimate:
    """Model one training step of ``batch`` sequences (global) under ``layout``."""
    layout.check(model, cluster, batch)
    p, lnc, tp = cluster.profile, cluster.lnc, layout.tp
    bpe = _BYTES[dtype]
    hbm_bw = p.core_hbm_bandwidth(lnc)
    replicas = layout.dp * layout.fsdp
    seqs_mb = batch // replicas // layout.microbatches      # sequences per micro-batch
    tokens_mb = seqs_mb * model.seq
    layers = model.layers // layout.pp

    # One layer, one micro-batch, forward, on one device.
    mms = model.layer_matmuls(seqs_mb)
    if layout.ep > 1:  # each device runs its experts over the tokens routed to them
        mms = [type(m)(m.name, m.count // layout.ep, m.m * layout.ep, m.k, m.n, m.split)
               if m.name.startswith("mlp") else m for m in mms]
    t_mm = sum(_matmul_seconds(cluster, m, tp, dtype) for m in mms)
    t_elem = model.layer_elementwise_elems(seqs_mb) * bpe / tp / hbm_bw
    kernels = len(mms) + 6  # matmuls + norms, residuals, activation, softmax
    t_launch = kernels * p.launch_overhead_ns * 1e-9
    fwd = t_mm + t_elem
    # Backward: two matmuls per forward matmul; activation checkpointing reruns the forward.
    layer_compute = (4 if layout.recompute else 3) * fwd
    # The LM head sits on the last stage; its matmul is vocab-parallel under tp.
    head = _matmul_seconds(cluster, model.head_matmul(seqs_mb), tp, dtype) * 3

    act_bytes = tokens_mb * model.hidden * bpe
    tp_op = "all_gather" if layout.sp else "all_reduce"
    t_tp = 4 * _coll(cluster, tp_op, act_bytes, tp, 1) if not layout.sp else \
        2 * (_coll(cluster, "all_gather", act_bytes, tp, 1) + _coll(cluster, "reduce_scatter", act_bytes, tp, 1))
    layer_param_bytes = model.layer_params() // tp * bpe
    fsdp_comm = (2 * _coll(cluster, "all_gather", layer_param_bytes, layout.fsdp, tp)
                 + _coll(cluster, "reduce_scatter", layer_param_bytes, layout.fsdp, tp))
    t_fsdp_exposed = max(0.0, fsdp_comm - layer_compute)
    t_ep = 0.0
    if layout.ep > 1:
        routed = tokens_mb * model.top_k * model.hidden * bpe // tp
        t_ep = 4 * _coll(cluster, "all_to_all", routed, layout.ep, tp)

    per_layer = layer_compute + 3 * t_launch + t_tp + t_fsdp_exposed + t_ep
    stage_mb = layers * per_layer + head / layout.pp  # the head's share on the critical path
    t_p2p = 0.0
    if layout.pp > 1:
        stride = tp * layout.fsdp * layout.dp
        t_p2p = 2 * _coll(cluster, "send", act_bytes // (tp if layout.sp else 1), 2, stride)
    m = layout.microbatches
    bubble = (layout.pp - 1) * (stage_mb + t_p2p)

    expert_params = model.layers * (model.layer_params() - model.layer_params_dense())
    local_params = int((model.params() - expert_params * (1 - 1 / layout.ep))) // (tp * layout.pp * layout.fsdp)
    grad_bytes = local_params * bpe
    backward_total = m * layers * 2 * fwd
    t_dp = _coll(cluster, "all_reduce", grad_bytes, layout.dp, tp * layout.fsdp)
    t_dp_exposed = max(0.0, t_dp - backward_total * (layers - 1) / max(1, layers))
    t_opt = local_params * _ADAMW_BYTES_PER_PARAM / hbm_bw + 8 * p.launch_overhead_ns * 1e-9

    breakdown = {
        "compute": m * (layers * layer_compute + head / layout.pp),
        "launch": m * layers * 3 * t_launch,
        "tp_comm": m * layers * t_tp,
        "fsdp_exposed": m * layers * t_fsdp_exposed,
        "ep_all_to_all": m * layers * t_ep,
        "pp_p2p": m * t_p2p,
        "pp_bubble": bubble,
        "dp_exposed": t_dp_exposed,
        "optimizer": t_opt,
    }
    step = sum(breakdown.values())
    flops = model.train_flops(batch)
    peak = p.peak_flops(dtype, lnc) * cluster.devices
    # Activations kept for the backward, per layer and micro-batch (Korthikanti et al. 2022,
    # without recomputation, flash attention: the s^2 score term is not stored): 34 s b h
    # bytes at 16-bit, tp-sharded for the attention/MLP part (24 of 34), all with sp.
    act_layer = tokens_mb * model.hidden * (34 / tp if layout.sp else 10 + 24 / tp)
    in_flight = min(m, layout.pp)
    if layout.recompute:  # only each layer's input is kept, plus one layer rebuilt at a time
        kept = layers * in_flight * tokens_mb * model.hidden * bpe / (tp if layout.sp else 1) + act_layer
    else:
        kept = layers * act_layer * in_flight
    hbm = local_params * _STATE_BYTES_PER_PARAM + kept + (2 * layer_param_bytes if layout.fsdp > 1 else 0)
    return Estimate(layout, step, batch * model.seq / step, flops / (step * peak), breakdown,
                    int(hbm), p.core_hbm_bytes(lnc), flops)
