"""One step traced on one device: what the device's cost model charged for it.

``with plan.trace() as t: step()`` records the modelled time, FLOPs, HBM bytes and launches
of the work the step ran (``torch_neuronx.modelled_time``), so a planned workload can be
checked against the ops a real step executed (tests/plan compares their FLOPs).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class StepTrace:
    seconds: float = 0.0
    flops: float = 0.0
    hbm_bytes: int = 0
    launches: int = 0
    link_bytes: int = 0


@contextlib.contextmanager
def trace(device=None):
    from ..cost_model import modelled_time
    torch.neuron.synchronize(device)
    modelled_time(device, reset=True)
    out = StepTrace()
    yield out
    torch.neuron.synchronize(device)
    t = modelled_time(device, reset=True)
    out.seconds, out.flops, out.hbm_bytes, out.launches, out.link_bytes = (
        t.seconds, t.flops, t.hbm_bytes, t.launches, t.link_bytes)
