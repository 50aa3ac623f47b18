"""A compiled graph costed as one Trainium program: one launch, engines overlapping, HBM
traffic only across kernel boundaries; checked against the chip's rooflines computed here
from the hardware profile."""
from __future__ import annotations

import pytest
import torch

import torch_neuronx
from torch_neuronx import _state

N = "neuron"


def _program(fn, *args):
    """The per-graph record of one steady-state run of fn compiled on neuron."""
    c = torch.compile(fn, backend="neuron")
    with torch.no_grad():
        c(*args)
        torch_neuronx.compile.reset_modelled_graph_time()
        c(*args)
    g = torch_neuronx.compile.modelled_graph_time()
    assert g.runs == 1 and g.launches == 1
    (rec,) = g.by_graph.values()
    return g, rec


def _profile():
    cfg = _state.config()
    return cfg.profile, cfg.lnc


def test_memory_bound_graph_runs_at_hbm_bandwidth():
    x = torch.randn(2048, 2048, device=N)
    g, rec = _program(lambda t: torch.sigmoid(t * 2 + 1) * t, x)
    p, lnc = _profile()
    nbytes = 2 * x.numel() * 4                      # read x once, write the result once
    assert g.hbm_bytes == nbytes
    roofline = nbytes / p.core_hbm_bandwidth(lnc)
    assert roofline <= rec.seconds <= 1.5 * roofline + 20e-6
    assert rec.bound in ("hbm", "dma")


def test_compute_bound_matmul_runs_near_tensore_peak():
    a = torch.randn(2048, 2048, device=N, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device=N, dtype=torch.bfloat16)
    g, rec = _program(lambda x, y: x @ y, a, b)
    p, lnc = _profile()
    peak = p.peak_flops("bfloat16", lnc)
    ideal = 2 * 2048 ** 3 / peak
    assert ideal <= rec.seconds <= 1.5 * ideal + 20e-6
    assert rec.bound == "tensor" and rec.busy["tensor"] > 0.8 * ideal


def test_independent_kernels_overlap_on_their_engines():
    # A compute-bound matmul (TensorE) next to memory-bound element-wise work (DMA).
    a = torch.randn(1024, 1024, device=N, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device=N, dtype=torch.bfloat16)
    x = torch.randn(512, 2048, device=N)
    _, mm = _program(lambda p, q: p @ q, a, b)
    _, ew = _program(lambda t: torch.tanh(t) * 3 + t, x)
    _, both = _program(lambda p, q, t: (p @ q, torch.tanh(t) * 3 + t), a, b, x)
    # One program: the matmul on TensorE runs next to the element-wise work on VectorE /
    # ScalarE / DMA, so the graph takes less than its parts one after the other.
    assert both.seconds < mm.seconds + ew.seconds
    assert both.seconds >= max(mm.seconds, ew.seconds) * 0.99


def test_consumer_waits_for_its_producer():
    x = torch.randn(512, 512, device=N, dtype=torch.bfloat16)
    w = torch.randn(512, 512, device=N, dtype=torch.bfloat16)
    _, chain = _program(lambda t, u: torch.tanh(t @ u) @ u, x, w)
    _, one = _program(lambda t, u: t @ u, x, w)
    # Two dependent matmuls cannot overlap each other: at least twice one of them.
    assert chain.seconds >= 1.9 * (one.seconds - _profile()[0].launch_overhead_ns * 1e-9)


def test_graph_time_adds_into_device_time_once():
    x = torch.randn(512, 512, device=N)
    w = torch.randn(512, 512, device=N)
    c = torch.compile(lambda t, u: torch.relu(t @ u) + 1, backend="neuron")
    with torch.no_grad():
        c(x, w)
        torch.neuron.synchronize()
        torch_neuronx.reset_modelled_time()
        torch_neuronx.compile.reset_modelled_graph_time()
        c(x, w)
        torch.neuron.synchronize()
    g = torch_neuronx.compile.modelled_graph_time()
    t = torch_neuronx.modelled_time()
    # The matmul is charged by the eager runtime (it runs as an eager op), the rest of the
    # program by the graph: together, the program's time.
    assert t.seconds == pytest.approx(g.seconds, rel=0.35)
    assert t.by_op["compiled_graph"] == pytest.approx(g.kernel_seconds)


def test_work_on_a_scalar_inside_a_loop_is_charged_once():
    # Inductor inlines the scale's arithmetic (a reciprocal on ScalarE) into the per-element
    # loop; computed from a 0-d tensor, it runs once per kernel, as the compiler hoists it.
    x = torch.randn(1024, 1024, device=N)
    s = torch.tensor(3.0, device=N)
    g1, hoisted = _program(lambda t, u: t * torch.reciprocal(u * 2 + 1), x, s)
    g2, per_element = _program(lambda t, u: u * torch.reciprocal(t * 2 + 1), x, s)
    p, lnc = _profile()
    elements = x.numel() / (p.vector_lanes * p.scalar_clock * lnc)
    assert per_element.busy["scalar"] >= 0.9 * elements
    # (a few instructions' fixed cost remain)
    assert hoisted.busy["scalar"] < 0.25 * per_element.busy["scalar"]
    # the per-element multiply is still charged for every element: as t * u alone
    _, plain = _program(lambda t, u: t * u, x, s)
    assert hoisted.busy["vector"] >= 0.95 * plain.busy["vector"]
    assert hoisted.seconds <= 1.1 * plain.seconds
