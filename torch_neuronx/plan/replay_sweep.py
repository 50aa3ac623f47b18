"""Layouts of N devices for a traced step, replayed and ranked (docs/plan.md, "Sweeping
layouts of a traced step"): ``StepTrace.sweep``.

Every layout is a ``replay_layout`` of the trace, so each is priced and sized by the same
replays the real runs check; a layout the replays refuse (a degree that does not divide the
heads, a combination not replayed) is kept with the reason. A data-parallel replica runs the
traced step on its own tokens: a layout of d replicas (FSDP, HSDP or FSDP2's replicas) steps
d times the traced tokens, a tensor- or pipeline-parallel group shares one traced batch.
"""
from __future__ import annotations

from dataclasses import dataclass

from .replay import _within


@dataclass
class Ranked:
    """One layout of the sweep: ``layout`` the ``replay_layout`` arguments, ``replay`` (None
    when refused, with ``reason``), the step's ``tokens_per_second`` over all devices and
    whether every rank's memory ``fits``."""
    layout: dict
    replay: object = None
    tokens_per_second: float = 0.0
    fits: bool = False
    reason: str = ""

    def __str__(self):
        name = " ".join(f"{k}={v}" for k, v in self.layout.items()
                        if k in ("replicate", "fsdp", "tp", "pp", "microbatches", "ep")
                        and v not in (1, None))
        if self.replay is None:
            return f"{name or 'one device'}: not replayed ({self.reason})"
        stages = self.replay.stages or [self.replay]
        peak = max(s.memory.peak for s in stages)
        return (f"{name}: {self.replay.seconds * 1e3:.4f} ms/step, "
                f"{self.tokens_per_second:,.0f} tokens/s, HBM {peak / 2**20:.2f} MiB per "
                f"device{'' if self.fits else ' DOES NOT FIT'}")


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatches(batch: int, pp: int) -> int | None:
    """1F1B's micro-batches: the fewest that keep the bubble at most a quarter of the step,
    m >= 3 (pp - 1) and m >= pp (the planner's rule), dividing the batch."""
    for m in range(max(pp, 3 * (pp - 1)), batch + 1):
        if batch % m == 0:
            return m
    return None


def layouts(trace, devices: int, tp_plan=None, fsdp_units=None, pp_blocks=None,
            ep_experts=None) -> list:
    """``replay_layout`` arguments of every (replicas x shards) x tp x pp = ``devices``
    the plans allow: tp with ``tp_plan``, pp with ``pp_blocks`` (the blocks in order, split
    evenly into the stages, 1F1B), data parallelism with ``fsdp_units`` (FSDP2 over the
    replicas, HSDP, or FSDP2's replicas; under pp inside the stages); with ``ep_experts``
    expert parallelism over all the devices, alone and (with the root among ``fsdp_units``)
    with FSDP2 over the same devices on the non-expert parameters."""
    out = []
    if ep_experts is not None:
        out.append({"ep": devices, "ep_experts": ep_experts})
        if fsdp_units is not None and "" in fsdp_units:
            out.append({"ep": devices, "ep_experts": ep_experts, "fsdp": devices,
                        "fsdp_units": [""]})
    for tp in _divisors(devices) if tp_plan else [1]:
        for pp in _divisors(devices // tp) if pp_blocks else [1]:
            d = devices // (tp * pp)
            if d > 1 and fsdp_units is None:
                continue
            if pp > 1 and len(pp_blocks) % pp:
                continue
            splits = [(r, d // r) for r in _divisors(d)]
            for replicate, fsdp in splits:
                kw = {}
                if replicate > 1:
                    kw["replicate"] = replicate
                if fsdp > 1 or replicate > 1:
                    # under pp each stage shards its own units (not the root, which spans
                    # the stages)
                    units = fsdp_units if pp == 1 else [u for u in fsdp_units
                                                        if _within(u, pp_blocks)]
                    kw.update(fsdp=fsdp, fsdp_units=units)
                if tp > 1:
                    kw.update(tp=tp, tp_plan=tp_plan)
                if pp > 1:
                    per = len(pp_blocks) // pp
                    kw.update(pp=pp, pp_stages=[pp_blocks[i * per:(i + 1) * per]
                                                for i in range(pp)], schedule="1f1b",
                              microbatches=_microbatches(trace.root_inputs[0][0][0], pp)
                              if trace.root_inputs else None)
                if kw:
                    out.append(kw)
    return out


def sweep(trace, devices: int, tokens: int, *, tp_plan=None, fsdp_units=None, pp_blocks=None,
          ep_experts=None, nodes: int = 1, profile=None, lnc: int | None = None) -> list:
    """Every layout of ``layouts`` replayed on ``nodes`` nodes; ranked: the replayed layouts
    that fit first, the highest tokens/s first (``tokens``: the traced step's), then those
    that do not fit, then the refused ones."""
    if not isinstance(devices, int) or devices < 2:
        raise ValueError(f"sweep: devices={devices!r} must be an int >= 2")
    if tp_plan is None and fsdp_units is None and pp_blocks is None and ep_experts is None:
        raise ValueError("sweep: give at least one of tp_plan, fsdp_units, pp_blocks, "
                         "ep_experts: the replays need the plan of each parallelism they lay "
                         "out")
    ranked = []
    for kw in layouts(trace, devices, tp_plan, fsdp_units, pp_blocks, ep_experts):
        row = Ranked(kw)
        if kw.get("pp", 1) > 1 and not trace.root_inputs:
            row.reason = ("pp splits dim 0 of the root's first tensor argument into "
                          "micro-batches, and the traced root took none (called with keyword "
                          "arguments only)")
        elif kw.get("pp", 1) > 1 and kw["microbatches"] is None:
            row.reason = (f"no micro-batch count m >= max(pp, 3 (pp - 1)) divides the batch "
                          f"of {trace.root_inputs[0][0][0]} for pp={kw['pp']}")
        else:
            try:
                r = trace.replay_layout(**kw, nodes=nodes, profile=profile, lnc=lnc)
            except ValueError as e:
                row.reason = str(e)
            else:
                # expert parallelism's ranks (FSDP's too, the same ranks) each route a
                # batch of their own
                replicas = kw.get("ep", 1) if "ep" in kw else (kw.get("replicate", 1)
                                                               * kw.get("fsdp", 1))
                row.replay, row.tokens_per_second = r, r.tokens_per_second(tokens * replicas)
                row.fits = all(s.memory.fits for s in r.stages or [r])
        ranked.append(row)
    return sorted(ranked, key=lambda x: (x.replay is None, not x.fits, -x.tokens_per_second))
