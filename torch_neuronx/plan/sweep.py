"""Every layout of a cluster that fits a model, ranked by modelled step time."""
from __future__ import annotations

from .estimate import training_step
from .layout import Layout


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model, cluster, batch: int, max_layouts: int | None = None) -> list:
    """The layouts whose degrees divide the cluster, heads, layers and batch: tp inside a
    node, every (dp, fsdp, pp) split of the rest, 1F1B with the fewest micro-batches that keep
    the bubble under a quarter (m >= 3(pp-1)), sequence parallelism with tp; each with and without activation checkpointing."""
    out = []
    n = cluster.devices
    kv = model.kv_heads or model.heads
    for tp in _divisors(n):
        if tp > cluster.devices_per_node or model.heads % tp or kv % tp:
            continue
        for pp in _divisors(n // tp):
            if model.layers % pp:
                continue
            rest = n // (tp * pp)
            for fsdp in _divisors(rest):
                dp = rest // fsdp
                replicas = dp * fsdp
                if batch % replicas:
                    continue
                per_replica = batch // replicas
                mbs = [m for m in _divisors(per_replica) if m >= 3 * (pp - 1)] if pp > 1 else [1]
                if not mbs:
                    continue
                ep = 1
                if model.experts > 1:
                    ep = max(d for d in _divisors(replicas) if model.experts % d == 0)
                for recompute in (False, True):
                    out.append(Layout(dp=dp, fsdp=fsdp, tp=tp, pp=pp, ep=ep, microbatches=mbs[0],
                                      sp=tp > 1, recompute=recompute))
                    if max_layouts and len(out) >= max_layouts:
                        return out
    return out


def sweep(model, cluster, batch: int, dtype: str = "bfloat16", max_layouts: int | None = None) -> list:
    """Estimates of every candidate layout: those that fit first, fastest first."""
    ests = [training_step(model, cluster, lay, batch, dtype) for lay in layouts(model, cluster, batch, max_layouts)]
    return sorted(ests, key=lambda e: (not e.fits, e.step_seconds))
