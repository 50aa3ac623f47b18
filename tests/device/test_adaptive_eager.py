"""Adaptive Eager Execution: queued pointwise chains run as one fused kernel whose results are
bit-identical to unfused eager (and to CPU) in every dtype, at every size, across fusion
boundaries; it steps aside in deterministic mode and when switched off."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

import torch_neuronx

from _compare import bits as _bits, run_twice as _run_twice  # noqa: E402
from _modes import aee  # noqa: E402

N = "neuron"


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def _chain(x, y):
    a = torch.sigmoid(x) * y - 0.25
    b = torch.exp(a.clamp(max=4)) + torch.erf(x)
    c = b.mul_(0.5).add_(y, alpha=0.75)
    return [a, c, torch.where(c > 0, c, -c).sqrt(), _gelu_tanh(c)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [7, 1000, 40000, 1 << 20])
def test_fused_chains_are_bit_identical_to_cpu(dtype, numel):
    torch.manual_seed(numel)
    x = torch.randn(numel).to(dtype)
    y = torch.randn(numel).to(dtype)
    want, got, stats = _run_twice(_chain, x, y)
    for k, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(_bits(g), _bits(w)), f"output {k}"
    if numel >= 32768:  # smaller tensors are cache-resident: they are not worth fusing
        assert stats["fused_kernels"] >= 1 and stats["kernels"] < stats["ops"]
    else:
        assert stats["fused_kernels"] == 0


def test_multidimensional_and_in_place_on_inputs():
    x = torch.randn(3, 257, 129)
    y = torch.randn(3, 257, 129)

    def f(x, y):
        x = x.clone()
        x.mul_(y).add_(1.5).tanh_()
        return [x, torch.maximum(x, y) / (y.abs() + 1)]
    want, got, stats = _run_twice(f, x, y)
    for g, w in zip(got, want):
        assert torch.equal(_bits(g), _bits(w))
    assert stats["fused_ops"] >= 4


def test_intermediates_the_program_keeps_are_written():
    x = torch.randn(50000)
    keep = []

    def f(x):
        keep.clear()
        a = x * 3
        b = a + 1
        keep.append(a)  # a stays referenced: it must reach memory
        return [b.relu(), keep[0]]
    want, got, _ = _run_twice(f, x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_unfused_and_fused_agree_for_a_random_training_step():
    def step(device):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(128, 64)).to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        x = torch.randn(512, 64).to(device)  # 512x128 activations: big enough to fuse
        for _ in range(3):
            opt.zero_grad()
            h = m(x)
            loss = (h * torch.sigmoid(h) - 0.1).square().mean()
            loss.backward()
            opt.step()
        return [p.detach().cpu() for p in m.parameters()]
    want = step("cpu")
    with aee(False):
        plain = step(N)
    torch_neuronx.adaptive_eager_stats(reset=True)
    fused = step(N)
    assert torch_neuronx.adaptive_eager_stats()["fused_kernels"] >= 3
    for w, p, f in zip(want, plain, fused):
        assert torch.equal(p, w) and torch.equal(f, w)


def test_fusion_boundaries_keep_program_order():
    x = torch.randn(40000, device=N)
    (x * 2 + 1).relu()
    s = torch.neuron.Stream()
    for _ in range(2):
        a = x * 2 + 1
        assert a.sum().item() == pytest.approx((x.cpu() * 2 + 1).sum().item())  # host read
        b = a.relu() * 3
        ev = torch.neuron.Event()
        ev.record()  # an event closes the window
        c = b - 1
        with torch.neuron.stream(s):  # a stream change closes it too
            d = c * c
        torch.neuron.current_stream().wait_stream(s)
        e = torch.cumsum(d, 0) + d  # a non-pointwise op in between
    want_c = (x.cpu() * 2 + 1).relu() * 3 - 1
    want_e = torch.cumsum(want_c * want_c, 0) + want_c * want_c
    assert torch.equal(c.cpu(), want_c) and torch.equal(e.cpu(), want_e)


def test_overlapping_views_are_not_fused_across():
    buf = torch.arange(40001.0)
    def f(buf):
        buf = buf.clone()
        a, b = buf[:-1], buf[1:]
        c = a * 2
        b.add_(c)  # b overlaps a: element i of b is element i + 1 of a
        return [c + 1, buf]
    want, got, _ = _run_twice(f, buf)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_deterministic_mode_and_switch_turn_fusion_off():
    x = torch.randn(50000, device=N)
    _gelu_tanh(x)
    for ctx in (lambda: aee(False), _deterministic, _debug_mode):
        with ctx():
            torch.neuron.synchronize()
            torch_neuronx.adaptive_eager_stats(reset=True)
            out = _gelu_tanh(x)
            torch.neuron.synchronize()
            stats = torch_neuronx.adaptive_eager_stats()
            assert stats["fused_kernels"] == 0 and stats["kernels"] == stats["ops"] > 0
            assert torch.equal(out.cpu(), _gelu_tanh(x.cpu()))
    torch_neuronx.adaptive_eager_stats(reset=True)
    _gelu_tanh(x)
    torch.neuron.synchronize()
    assert torch_neuronx.adaptive_eager_stats()["fused_kernels"] == 1


@contextlib.contextmanager
def _deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextlib.contextmanager
def _debug_mode():
    torch.set_deterministic_debug_mode("warn")
    try:
        yield
    finally:
        torch.set_deterministic_debug_mode("default")


def test_environment_switch():
    code = ("import torch, torch_neuronx\n"
            "x = torch.randn(100000, device='neuron')\n"
            "for _ in range(2): y = (x * 2 + 1).relu()\n"
            "torch.neuron.synchronize()\n"
            "s = torch_neuronx.adaptive_eager_stats()\n"
            "print(torch_neuronx.is_adaptive_eager_enabled(), s['fused_kernels'])\n")
    env = dict(os.environ, TORCH_NEURONX_ADAPTIVE_EAGER="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "0"], out.stderr


def test_fused_kernel_costs_one_launch_and_one_hbm_round_trip():
    x = torch.randn(1 << 20, device=N)
    _gelu_tanh(x)
    torch.neuron.synchronize()

    def modelled(on):
        with aee(on):
            torch_neuronx.reset_modelled_time()
            y = _gelu_tanh(x)  # kept: written once; the dropped intermediates never are
            torch.neuron.synchronize()
            del y
            return torch_neuronx.modelled_time()
    fused, plain = modelled(True), modelled(False)
    assert fused.launches == 1 and plain.launches == 9
    assert fused.hbm_bytes == 2 * x.nbytes  # x read once, the result written once
    assert fused.seconds < plain.seconds / 3
