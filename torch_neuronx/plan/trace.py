"""One step traced on one device: what the device's cost model charged for it, and the
collectives it issued.

``with plan.trace() as t: step()`` records the modelled time, FLOPs, HBM bytes and launches
of the work the step ran (``torch_neuronx.modelled_time``) and every collective the
``"neuron"`` backend charged (op, bytes, group size). ``t.replay(group_size)`` is the what-if
of the same step with each collective's group resized: the device work as traced, the
collectives re-priced by the backend's collective model. A data-parallel step traced on one
rank thus predicts the step on N ranks (tests/plan checks it against a real 2-rank run).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class StepTrace:
    seconds: float = 0.0
    flops: float = 0.0
    hbm_bytes: int = 0
    launches: int = 0
    link_bytes: int = 0
    collectives: list = field(default_factory=list)   # (op, nbytes, group_size, nodes, seconds)

    def replay(self, group_size: int, nodes: int = 1, profile=None, lnc: int | None = None) -> float:
        """Modelled seconds of the traced step with its collectives over ``group_size`` ranks
        on ``nodes`` nodes (the traced chip and LNC unless given)."""
        from .. import _state
        from ..distributed.collectives_model import collective_seconds
        cfg = _state.config()
        profile = profile or cfg.profile
        lnc = lnc or cfg.lnc
        traced = sum(c[4] for c in self.collectives)
        resized = sum(collective_seconds(op, nbytes, group_size, nodes, profile, lnc)
                      for op, nbytes, _, _, _ in self.collectives)
        return self.seconds - traced + resized


@contextlib.contextmanager
def trace(device=None):
    from ..cost_model import modelled_time
    from ..distributed import collectives_model
    from ..neuron import _index
    idx = _index(device)
    torch.neuron.synchronize(device)
    modelled_time(device, reset=True)
    out = StepTrace()

    def on_collective(dev, op, nbytes, size, nodes, seconds):
        if dev == idx:
            out.collectives.append((op, nbytes, size, nodes, seconds))

    collectives_model.listeners.append(on_collective)
    try:
        yield out
        torch.neuron.synchronize(device)
    finally:
        collectives_model.listeners.remove(on_collective)
    t = modelled_time(device, reset=True)
    out.seconds, out.flops, out.hbm_bytes, out.launches, out.link_bytes = (
        t.seconds, t.flops, t.hbm_bytes, t.launches, t.link_bytes)
