"""Compiled graphs on the device queue: ordered on the current stream like eager work,
errors deferred to the next synchronisation, seen by the stream checker, host reads inside
a graph, NEURON_LAUNCH_BLOCKING. Results are compared with the same code on CPU."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_neuronx
from torch_neuronx.runtime.queue import queue_stats

N = "neuron"


def _block(x, w):
    h = torch.nn.functional.layer_norm(x, x.shape[-1:])
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    x1, x2 = h[..., ::2], h[..., 1::2]
    r = torch.stack((x1 - x2, x1 + x2), dim=-1).flatten(-2)
    return torch.softmax(r, dim=-1) + x


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 64, 256, generator=g), torch.randn(256, generator=g)


def test_kernels_are_launched_on_the_queue_and_match_cpu():
    x, w = _inputs()
    fn = torch.compile(_block, backend="neuron")
    xn, wn = x.to(N), w.to(N)
    fn(xn, wn)
    torch.neuron.synchronize()
    before = queue_stats()["launched"]
    got = fn(xn, wn)
    assert queue_stats()["launched"] > before      # the fused kernel went through the queue
    torch.testing.assert_close(got.cpu(), torch.compile(_block)(x, w), rtol=0, atol=0)


def test_graph_is_ordered_on_a_side_stream():
    x, w = _inputs()
    fn = torch.compile(_block, backend="neuron")
    xn, wn = x.to(N), w.to(N)
    fn(xn, wn)
    s = torch.neuron.Stream()
    s.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(s):
        a = xn * 3                 # eager work before the graph, on the same stream
        out = fn(a, wn)
        out.add_(1)                # and after it
        ev = torch.neuron.Event()
        ev.record()
    torch.neuron.current_stream().wait_event(ev)
    torch.testing.assert_close(out.cpu(), _block(x * 3, w) + 1, rtol=1e-5, atol=1e-5)


def test_stream_checker_sees_the_compiled_kernels():
    x, w = _inputs()
    fn = torch.compile(_block, backend="neuron")
    xn, wn = x.to(N), w.to(N)
    fn(xn, wn)
    with torch_neuronx.stream_check():
        s = torch.neuron.Stream()
        s.wait_stream(torch.neuron.current_stream())
        with torch.neuron.stream(s):
            out = fn(xn, wn)
        with pytest.raises(RuntimeError) as e:
            out + 1                # read on the default stream without waiting for s
    assert "read after write" in str(e.value) and "cpp_fused" in str(e.value)
    torch.neuron.synchronize()
    assert (torch.ones(2, device=N) + 1).sum().item() == 4


def test_host_read_inside_a_graph():
    def f(x):
        y = torch.softmax(x * 2, -1).sum(-1)
        k = (y > 0.5).sum().item()           # a host read of a value the graph computed
        return y * k + x.mean()

    x = torch.randn(32, 128)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(f, backend="neuron", fullgraph=True)(x.to(N))
    torch.testing.assert_close(got.cpu(), f(x), rtol=1e-5, atol=1e-5)


def test_kernel_error_surfaces_at_the_next_synchronisation():
    def f(x, idx):
        return (x * 2)[idx] + 1

    fn = torch.compile(f, backend="neuron")
    x = torch.randn(16, device=N)
    good = torch.tensor([1, 3], device=N)
    torch.testing.assert_close(fn(x, good).cpu(), f(x.cpu(), good.cpu()))
    bad = torch.tensor([1, 99], device=N)
    with pytest.raises(RuntimeError, match="index out of bounds") as e:
        fn(x, bad)
        torch.neuron.synchronize()
    # The report names the kernel and the user's line it was compiled from.
    assert "cpp_fused" in str(e.value) and "test_queued.py" in str(e.value), str(e.value)
    # The device and the compiled graph stay usable.
    torch.testing.assert_close(fn(x, good).cpu(), f(x.cpu(), good.cpu()))


def test_launch_blocking_runs_compiled_kernels_synchronously():
    code = textwrap.dedent("""
        import torch, torch_neuronx
        from torch_neuronx.runtime.queue import queue_stats
        f = torch.compile(lambda x: torch.softmax(x * 2, -1) + 1, backend="neuron")
        x = torch.randn(256, 1024, device="neuron")
        before = queue_stats()["launched"]
        y = f(x)
        assert queue_stats()["launched"] == before, "a compiled kernel was queued"
        torch.testing.assert_close(y.cpu(), torch.softmax(x.cpu() * 2, -1) + 1)
        print("ok")
    """)
    env = dict(os.environ, NEURON_LAUNCH_BLOCKING="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_compiled_optimizer_step_with_host_operands():
    # AdamW's step counts are CPU tensors: a compiled kernel reading host memory runs at
    # once on the calling thread, after the device has produced its other inputs.
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(24)]
    dev = [torch.nn.Parameter(p.detach().clone().to(N)) for p in ref]
    for a, b in zip(ref, dev):
        g = torch.randn(16, 16)
        a.grad, b.grad = g, g.to(N)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, foreach=True)
    opt_dev = torch.optim.AdamW(dev, lr=1e-2, foreach=True)
    step = torch.compile(opt_dev.step, backend="neuron")
    for _ in range(2):
        opt_ref.step()
        step()
    for a, b in zip(ref, dev):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-6)


def test_graph_on_another_device_allocates_there():
    if torch.neuron.device_count() < 2:
        pytest.skip("one neuron device")
    fn = torch.compile(lambda t: torch.softmax(t * 2, -1) + 1, backend="neuron")
    x = torch.randn(64, 64)
    assert torch.neuron.current_device() == 0
    y1 = fn(x.to("neuron:1"))
    y0 = fn(x.to("neuron:0"))
    assert y1.device == torch.device("neuron", 1) and y0.device == torch.device("neuron", 0)
    ref = torch.softmax(x * 2, -1) + 1
    torch.testing.assert_close(y1.cpu(), ref)
    torch.testing.assert_close(y0.cpu(), ref)
