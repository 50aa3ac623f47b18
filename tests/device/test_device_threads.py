"""The device's own thread count (torch_neuronx.set_device_threads): results equal CPU's at
that count, whichever thread runs the work, and the host's own counts are left alone."""
import ctypes
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torch_neuronx

needs_two = pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 intra-op threads")


@pytest.fixture
def one_thread():
    torch_neuronx.set_device_threads(1)
    yield
    torch_neuronx.set_device_threads(None)


def _cpu_at(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _program(x, y, w):
    # A reduction split across threads, an elementwise chain (fused or not), a matmul and a
    # convolution: each ran its own way with one thread and with two.
    s = x.sum()
    e = (x.exp() * y + 1).sin()
    m = w @ w
    c = F.conv2d(x[:2 * 3 * 64 * 64].reshape(2, 3, 64, 64), w[:8, :27].reshape(8, 3, 3, 3))
    return s, e, m, c


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g)
    y = torch.randn(100_000, generator=g)
    w = torch.randn(300, 300, generator=g)
    return x, y, w


def _on_neuron(x, y, w):
    dev = [t.to("neuron") for t in (x, y, w)]
    out = [_program(*dev) for _ in range(2)]    # the first call of a signature runs synchronously
    return [[t.cpu() for t in o] for o in out]


@needs_two
def test_one_device_thread_equals_cpu_at_one_thread(one_thread):
    x, y, w = _inputs()
    cpu1 = _cpu_at(1, lambda: _program(x, y, w))
    cpu2 = _program(x, y, w)
    assert not torch.equal(cpu1[0], cpu2[0])      # the sum does depend on the count
    for run in _on_neuron(x, y, w):
        for got, want in zip(run, cpu1):
            assert torch.equal(got, want)


@needs_two
def test_one_device_thread_unfused_equals_fused(one_thread):
    x, y, w = _inputs()
    fused = _on_neuron(x, y, w)
    torch_neuronx.set_adaptive_eager(False)
    try:
        unfused = _on_neuron(x, y, w)
    finally:
        torch_neuronx.set_adaptive_eager(True)
    for a, b in zip(fused, unfused):
        for p, q in zip(a, b):
            assert torch.equal(p, q)


@needs_two
def test_blocking_mode_uses_the_device_count(one_thread):
    x, y, w = _inputs()
    cpu1 = _cpu_at(1, lambda: _program(x, y, w))
    torch_neuronx.set_launch_blocking(True)
    try:
        run = _on_neuron(x, y, w)[1]
    finally:
        torch_neuronx.set_launch_blocking(False)
    for got, want in zip(run, cpu1):
        assert torch.equal(got, want)


def test_default_follows_the_launcher():
    assert torch_neuronx.get_device_threads() is None
    x, y, w = _inputs()
    cpu = _program(x, y, w)
    for run in _on_neuron(x, y, w):
        for got, want in zip(run, cpu):
            assert torch.equal(got, want)


def test_host_counts_are_left_alone(one_thread):
    mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    before = torch.get_num_threads(), mkl.MKL_Get_Max_Threads()
    x, y, w = _inputs()
    _on_neuron(x, y, w)
    torch.neuron.synchronize()
    assert (torch.get_num_threads(), mkl.MKL_Get_Max_Threads()) == before
    assert torch_neuronx.get_device_threads() == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match="set_device_threads"):
        torch_neuronx.set_device_threads(bad)
    assert torch_neuronx.get_device_threads() is None
    assert torch.equal(torch.ones(3, device="neuron").cpu(), torch.ones(3))


def test_from_the_environment():
    code = "import torch, torch_neuronx; print(torch_neuronx.get_device_threads())"
    env = dict(os.environ, TORCH_NEURONX_DEVICE_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "1"
    env["TORCH_NEURONX_DEVICE_THREADS"] = "zero"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "TORCH_NEURONX_DEVICE_THREADS" in out.stderr
