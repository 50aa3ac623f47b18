"""Asynchronous queues: results equal CPU's and blocking mode's, host reads wait, errors in
queued work surface at the next synchronization with the op and its launch line, events
time the device, and memory freed behind queued work is not reused under it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_neuronx

from _modes import blocking  # noqa: E402

N = "neuron"


def test_launch_returns_before_the_work_runs():
    x = torch.randn(2048, 2048, device=N)
    torch.neuron.synchronize()
    before = torch_neuronx.queue_stats()["launched"]
    ys = [x @ x for _ in range(2)]  # the first call of a signature runs synchronously
    ys += [x @ x for _ in range(3)]
    stats = torch_neuronx.queue_stats()
    assert stats["launched"] - before >= 3
    assert stats["executed"] < stats["launched"]  # ~0.1 s of matmuls cannot have run yet
    torch.neuron.synchronize()
    assert torch_neuronx.queue_stats()["executed"] == torch_neuronx.queue_stats()["launched"]
    want = x.cpu() @ x.cpu()
    for y in ys:
        torch.testing.assert_close(y.cpu(), want, rtol=0, atol=0)


def _select(table, idx):
    return torch.index_select(table, 0, idx)


def test_error_in_queued_work_is_raised_at_next_sync_with_op_and_line():
    table = torch.randn(10, 4, device=N)
    _select(table, torch.tensor([0, 1, 2], device=N))  # teaches the runtime the signatures
    table * 3
    bad = torch.tensor([0, 5, 100], device=N)
    out = _select(table, bad)  # queued: the index is only checked when the kernel runs
    after = table * 3  # queued behind the failure: skipped
    with pytest.raises(IndexError) as e:
        torch.neuron.synchronize()
    msg = str(e.value)
    assert "aten::index_select" in msg and "index out of range" in msg
    assert "test_async.py:" in msg  # the line that launched the failing op
    assert out.shape == (3, 4) and after.shape == (10, 4)
    # The error is reported once, and the device keeps working.
    torch.neuron.synchronize()
    y = table * 2
    torch.testing.assert_close(y.cpu(), table.cpu() * 2, rtol=0, atol=0)


def test_integer_advanced_indexing_is_queued_and_masks_wait():
    """``x[i, :, j]`` with integer index tensors has its result's shape from the indices'
    shapes alone: it is queued like any op (a paged-KV gather per layer had the host wait for
    the device). A boolean mask's count is data, so that form waits, as on CUDA."""
    kv = torch.randn(50, 2, 16, 8)
    b, o = torch.randint(0, 50, (4, 6)), torch.randint(0, 16, (4, 6))
    m = kv[:, 0, 0, 0] > 0
    forms = [lambda t, b, o, m: t[b, :, o], lambda t, b, o, m: t[b],
             lambda t, b, o, m: t[:, :, o], lambda t, b, o, m: t[b.int(), 1]]
    dev = [x.to(N) for x in (kv, b, o, m)]
    for f in forms:
        f(*dev)     # the first call of a signature runs synchronously
    torch.neuron.synchronize()
    torch_neuronx.queue_stats(reset=True)
    got = [f(*dev) for f in forms]
    assert torch_neuronx.queue_stats(reset=True)["synchronous_ops"] == {}
    for f, g in zip(forms, got):
        torch.testing.assert_close(g.cpu(), f(kv, b, o, m), rtol=0, atol=0)
    masked = dev[0][dev[3]]
    assert torch_neuronx.queue_stats(reset=True)["synchronous_ops"] == {"aten::index": 1}
    torch.testing.assert_close(masked.cpu(), kv[m], rtol=0, atol=0)
    # Out of range: reported at the next synchronization, naming the op; the device goes on.
    bad = b.clone()
    bad[1, 2] = 70
    dev[0][bad.to(N)]       # the signature of t[b] above: queued
    with pytest.raises(IndexError, match="aten::index"):
        torch.neuron.synchronize()
    torch.testing.assert_close(dev[0][dev[1]].cpu(), kv[b], rtol=0, atol=0)


def test_host_read_raises_the_pending_error():
    table = torch.randn(10, 4, device=N)
    _select(table, torch.tensor([1, 2], device=N))
    _select(table, torch.tensor([1, 99], device=N))
    with pytest.raises(IndexError, match="index_select"):
        table.sum().item()
    assert table.sum().item() == pytest.approx(table.cpu().sum().item())


def test_launch_blocking_raises_at_the_op():
    table = torch.randn(10, 4, device=N)
    _select(table, torch.tensor([0, 1], device=N))
    with blocking(True):
        with pytest.raises(IndexError, match="index out of range"):
            _select(table, torch.tensor([0, 100], device=N))
        assert torch_neuronx.is_launch_blocking()
    assert not torch_neuronx.is_launch_blocking()


def test_launch_blocking_from_the_environment(tmp_path):
    import subprocess
    import sys
    code = ("import torch, torch_neuronx\n"
            "t = torch.randn(10, 4, device='neuron')\n"
            "torch.index_select(t, 0, torch.tensor([0], device='neuron'))\n"
            "try:\n"
            "    torch.index_select(t, 0, torch.tensor([50], device='neuron'))\n"
            "except IndexError:\n"
            "    print('raised at the op', torch_neuronx.is_launch_blocking())\n")
    env = dict(__import__("os").environ, NEURON_LAUNCH_BLOCKING="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "raised at the op True" in out.stdout, out.stderr


def test_metadata_changes_after_launch_do_not_reach_queued_work():
    x = torch.arange(12.0, device=N).reshape(3, 4)
    x.mul(2)  # learn the signature
    y = x.mul(2)
    x.t_()  # in-place metadata change while the mul may still be queued
    z = x.mul(2)
    torch.testing.assert_close(y.cpu(), torch.arange(12.0).reshape(3, 4) * 2, rtol=0, atol=0)
    torch.testing.assert_close(z.cpu(), (torch.arange(12.0).reshape(3, 4) * 2).t(), rtol=0, atol=0)


def test_memory_freed_behind_queued_work_is_not_reused_under_it():
    torch.manual_seed(0)
    a_cpu = torch.randn(1 << 20)
    results = []
    for _ in range(3):
        a = a_cpu.to(N)
        slow = torch.randn(1024, 1024, device=N)
        for _ in range(3):
            slow = slow @ slow  # keeps the queue busy
        b = a.exp()
        del a  # freed while exp may still be queued
        c = torch.full((1 << 20,), 7.0, device=N)  # same size class: a reuse candidate
        results.append((b, c))
    for b, c in results:
        torch.testing.assert_close(b.cpu(), a_cpu.exp(), rtol=0, atol=0)
        assert bool((c.cpu() == 7.0).all())


def test_memory_stats_count_frees_at_once():
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    x = torch.randn(1 << 18, device=N)
    y = x * 2
    y = x * 2  # second, queued launch
    del x, y
    assert torch.neuron.memory_allocated() == base


def _timed_matmuls(n, reps):
    x = torch.randn(n, n, device=N)
    x @ x  # the first call of a signature runs synchronously
    start = torch.neuron.Event(enable_timing=True)
    end = torch.neuron.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        x = x @ x / n
    end.record()
    return start, end


def test_events_time_the_device_and_report_completion():
    start, end = _timed_matmuls(1024, 4)
    end.synchronize()
    assert end.query() and start.query()
    assert end.elapsed_time(start) < 0 < start.elapsed_time(end)
    assert torch.neuron.current_stream().query()


def test_elapsed_time_of_unfinished_event_is_an_error():
    start, end = _timed_matmuls(1500, 3)  # ~20 GFLOP: still running when we ask
    assert not end.query()
    with pytest.raises(RuntimeError, match="completed"):
        start.elapsed_time(end)
    torch.neuron.synchronize()
    assert start.elapsed_time(end) > 0


def _stream_program(device):
    torch.manual_seed(0)
    x = torch.randn(256, 256, device=device)
    if device == "cpu":
        y = x @ x
        return [y, y.relu() + 1, (x * 3).sum(0)]
    main = torch.neuron.current_stream()
    side = torch.neuron.Stream(priority=-1)
    side.wait_stream(main)
    with torch.neuron.stream(side):
        y = x @ x
        done = torch.neuron.Event()
        done.record()
    main.wait_event(done)
    z = y.relu() + 1
    y.record_stream(main)
    w = (x * 3).sum(0)
    return [y, z, w]


def test_stream_programs_match_blocking_mode_and_cpu():
    want = _stream_program("cpu")
    with blocking(True):
        blocked = [t.cpu() for t in _stream_program(N)]
    for _ in range(2):
        got = [t.cpu() for t in _stream_program(N)]
        for g, b, w in zip(got, blocked, want):
            torch.testing.assert_close(g, b, rtol=0, atol=0)
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_current_stream_apis():
    s = torch.neuron.Stream(priority=-1)
    with torch.neuron.stream(s):
        assert torch.accelerator.current_stream() == s
        assert torch.neuron.current_stream() == s
    assert torch.neuron.current_stream() == torch.neuron.default_stream()
    s.synchronize()
    assert s.query()


def test_backward_and_optimizer_run_queued_and_match_cpu():
    def run(device):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)).to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
        x = torch.randn(8, 16).to(device)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return [loss.item() for loss in losses], [p.detach().cpu() for p in m.parameters()]
    cpu_losses, cpu_params = run("cpu")
    torch.neuron.synchronize()
    before = torch_neuronx.queue_stats()["launched"]
    losses, params = run(N)
    assert torch_neuronx.queue_stats()["launched"] - before > 50
    assert losses == cpu_losses
    for p, q in zip(params, cpu_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# --- property test: random op programs, four ways ---------------------------------------

_UNARY = ["neg", "abs", "exp", "tanh", "sigmoid", "relu", "sin", "sqrt_abs", "square", "gelu",
          "silu", "rsqrt_abs", "clamp"]
_BINARY = ["add", "sub", "mul", "div", "maximum", "where_gt", "add_alpha"]
_REDUCE = ["sum_last", "mean_first", "amax_last", "softmax", "layer_norm", "cumsum"]


def _apply(step, vals):
    kind, name, i, j = step
    a = vals[i % len(vals)]
    b = vals[j % len(vals)]
    if kind == "u":
        return {"neg": torch.neg, "abs": torch.abs, "exp": lambda t: torch.exp(t.clamp(max=8)),
                "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu,
                "sin": torch.sin, "sqrt_abs": lambda t: t.abs().sqrt(), "square": torch.square,
                "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
                "rsqrt_abs": lambda t: (t.abs() + 1).rsqrt(),
                "clamp": lambda t: t.clamp(-0.5, 0.5)}[name](a)
    if kind == "b":
        return {"add": torch.add, "sub": torch.sub, "mul": torch.mul,
                "div": lambda x, y: x / (y.abs() + 1), "maximum": torch.maximum,
                "where_gt": lambda x, y: torch.where(x > y, x, y),
                "add_alpha": lambda x, y: torch.add(x, y, alpha=0.5)}[name](a, b)
    if kind == "i":  # in place on a fresh copy, so earlier values stay intact
        c = a.clone()
        return {"add": c.add_, "mul": c.mul_, "sub": c.sub_}[name](b)
    f = {"sum_last": lambda t: t.sum(-1, keepdim=True).expand_as(t),
         "mean_first": lambda t: t.mean(0, keepdim=True).expand_as(t),
         "amax_last": lambda t: t.amax(-1, keepdim=True).expand_as(t),
         "softmax": lambda t: t.softmax(-1),
         "layer_norm": lambda t: torch.nn.functional.layer_norm(t, t.shape[-1:]),
         "cumsum": lambda t: t.cumsum(-1)}[name]
    return f(a)


_steps = st.one_of(
    st.tuples(st.just("u"), st.sampled_from(_UNARY), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("b"), st.sampled_from(_BINARY), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("i"), st.sampled_from(["add", "mul", "sub"]), st.integers(0, 50),
              st.integers(0, 50)),
    st.tuples(st.just("r"), st.sampled_from(_REDUCE), st.integers(0, 50), st.integers(0, 50)))


def _program(steps, shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    vals = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2)]
    for step in steps:
        vals.append(_apply(step, vals))
    return vals


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps=st.lists(_steps, min_size=1, max_size=12),
       shape=st.sampled_from([(7,), (3, 5), (4, 1, 33), (64, 130), (2, 3, 4, 5), (3, 23457)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_random_programs_are_bit_identical_cpu_blocking_async_fused(steps, shape, dtype, seed):
    want = _program(steps, shape, dtype, seed, "cpu")
    with blocking(True):
        blocked = [t.cpu() for t in _program(steps, shape, dtype, seed, N)]
    # Twice asynchronously: the first run teaches new signatures, the second queues them.
    for _ in range(2):
        got = _program(steps, shape, dtype, seed, N)
        for k, (g, b, w) in enumerate(zip(got, blocked, want)):
            g = g.cpu()
            torch.testing.assert_close(b, w, rtol=0, atol=0, equal_nan=True, msg=f"blocking {k}")
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=f"async {k}")


def _modelled_matmuls(side_waits: bool) -> float:
    x = torch.randn(512, 512, device=N)
    x @ x
    torch.neuron.synchronize()
    torch_neuronx.reset_modelled_time()
    main = torch.neuron.current_stream()
    side = torch.neuron.Stream()
    main_out = x @ x
    if side_waits:
        side.wait_stream(main)  # the side stream's matmul now follows the main one
    with torch.neuron.stream(side):
        side_out = x @ x
    torch.neuron.synchronize()
    del main_out, side_out
    return torch_neuronx.modelled_time().seconds


def test_streams_overlap_on_the_modelled_timeline():
    overlapped = _modelled_matmuls(side_waits=False)
    ordered = _modelled_matmuls(side_waits=True)
    assert ordered == pytest.approx(2 * overlapped, rel=1e-6)


def test_queued_work_keeps_inference_mode():
    """Work queued under torch.inference_mode runs in it on the executor (vLLM's steps copy
    into inference tensors in place), and results equal CPU's."""
    x = torch.arange(6.0).reshape(2, 3)
    with torch.inference_mode():
        y = torch.empty(2, 3, device="neuron")
        torch.neuron.synchronize()
        for _ in range(3):          # queued behind each other, not run inline
            y.copy_(x)
            y.mul_(2).add_(1)
        z = y.cpu()
    assert torch.equal(z, x * 2 + 1)
    assert z.is_inference()


@pytest.mark.parametrize("make", [lambda: torch.nn.BatchNorm2d(3), lambda: torch.nn.BatchNorm1d(3),
                                  lambda: torch.nn.InstanceNorm2d(3, track_running_stats=True)],
                         ids=["BatchNorm2d", "BatchNorm1d", "InstanceNorm2d"])
def test_running_statistics_are_updated_once_per_call(make):
    # native_batch_norm writes its running statistics without marking them in its schema: the
    # launch path's first-call check of the out= overload ran on them too and applied the
    # momentum update twice
    dev, cpu = make().to(N), make()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 3, 5, 5, generator=g)
        x = x[:, :, 0, 0].contiguous() if isinstance(cpu, torch.nn.BatchNorm1d) else x
        assert torch.equal(dev(x.to(N)).cpu(), cpu(x))
        assert torch.equal(dev.running_mean.cpu(), cpu.running_mean)
        assert torch.equal(dev.running_var.cpu(), cpu.running_var)
