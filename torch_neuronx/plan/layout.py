"""A parallel layout: how a step's work is split over a cluster's devices.

Ranks are laid out with tensor parallelism innermost (adjacent devices, inside a node when it
fits), then FSDP, then data parallelism, then pipeline stages outermost, as Megatron and
TorchTitan order their meshes. Expert parallelism shards the experts over the data-parallel
ranks (dp x fsdp), as Megatron's MoE does.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    dp: int = 1            # replicas (gradients all-reduced)
    fsdp: int = 1          # ZeRO-3 / FSDP2 shards (parameters gathered per layer)
    tp: int = 1            # tensor parallel (Megatron column/row split)
    pp: int = 1            # pipeline stages
    ep: int = 1            # expert parallel (MoE), over the dp x fsdp ranks
    microbatches: int = 1  # per step, per replica (the pipeline's micro-batches)
    sp: bool = False       # sequence parallel with tp: norms and dropout sharded over tokens
    recompute: bool = False  # full activation checkpointing: keep layer inputs, rerun forward

    @property
    def devices(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp

    def __str__(self):
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "fsdp", "tp", "pp", "ep") if getattr(self, k) > 1]
        if self.pp > 1 or self.microbatches > 1:
            parts.append(f"mb={self.microbatches}")
        if self.sp:
            parts.append("sp")
        if self.recompute:
            parts.append("recompute")
        return ",".join(parts) or "single"

    def check(self, model, cluster, batch: int) -> None:
        """Raise ValueError naming the first degree that does not fit."""
        for name in ("dp", "fsdp", "tp", "pp", "ep", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout {self}: {name} must be >= 1")
        if self.devices != cluster.devices:
            raise ValueError(f"layout {self} uses {self.devices} devices; {cluster.name} x "
                             f"{cluster.chips} chips at LNC={cluster.lnc} has {cluster.devices}")
        if model.heads % self.tp or (model.kv_heads or model.heads) % self.tp:
            raise ValueError(f"layout {self}: tp={self.tp} does not divide the {model.heads} "
                             f"attention heads and {model.kv_heads or model.heads} key/value heads")
        if model.layers % self.pp:
            raise ValueError(f"layout {self}: pp={self.pp} does not divide {model.layers} layers")
        if batch % (self.dp * self.fsdp * self.microbatches):
            raise ValueError(f"layout {self}: the batch of {batch} sequences does not split into "
                             f"dp x fsdp = {self.dp * self.fsdp} replicas of {self.microbatches} micro-batches")
        if self.ep > 1 and (model.experts % self.ep or (self.dp * self.fsdp) % self.ep):
            raise ValueError(f"layout {self}: ep={self.ep} must divide the {model.experts} experts "
                             f"and the dp x fsdp = {self.dp * self.fsdp} ranks it shards them over")
        if self.sp and self.tp == 1:
            raise ValueError(f"layout {self}: sequence parallelism needs tp > 1")


def nodes_spanned(group: int, stride: int, devices_per_node: int) -> int:
    """Nodes a group of ``group`` ranks ``stride`` devices apart touches."""
    span = group * stride
    return 1 if span <= devices_per_node else -(-span // devices_per_node) if stride < devices_per_node else group
