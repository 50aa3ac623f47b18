"""A compiled graph's work under 2 MiB runs with one thread fewer than its launcher's count
(the Python thread keeps a core to issue the step's work), larger work with all of them. The
count depends only on the launcher's count and the work's size: a graph gives the same bits
on every call, queued or in blocking mode, and eager work after it keeps CPU's bits."""
import pytest
import torch

import torch_neuronx

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 intra-op threads")


def _reduce(x):
    # Inductor splits a whole-tensor sum across the team: its bits depend on the team's size.
    return (x * 1.5 + 0.25).sum(), (x * x).sum()


def _data(n):
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).to("neuron")


def _run(fn, x, threads=None):
    torch_neuronx.set_device_threads(threads)
    try:
        return [t.cpu() for t in fn(x)]
    finally:
        torch_neuronx.set_device_threads(None)


def _bits_equal(a, b):
    return all(torch.equal(u.view(torch.int32), v.view(torch.int32)) for u, v in zip(a, b))


@pytest.fixture(scope="module")
def compiled():
    torch._dynamo.reset()
    return torch.compile(_reduce, backend="neuron", dynamic=False)


def test_small_graph_runs_one_thread_fewer(compiled):
    n = torch.get_num_threads()
    x = _data(100_003)  # 400 KB
    fewer, full = _run(compiled, x, n - 1), _run(compiled, x, n)
    # The data must tell the two counts apart, or the check below proves nothing.
    assert not _bits_equal(fewer, full)
    for _ in range(3):
        assert _bits_equal(_run(compiled, x), fewer)


def test_large_graph_keeps_every_thread(compiled):
    n = torch.get_num_threads()
    x = _data(550_003)  # 2.2 MB (larger sizes reduce in a split Inductor fixes)
    fewer, full = _run(compiled, x, n - 1), _run(compiled, x, n)
    assert not _bits_equal(fewer, full)
    assert _bits_equal(_run(compiled, x), full)


def test_blocking_mode_gives_the_queued_bits(compiled):
    x = _data(100_003)
    queued = _run(compiled, x)
    torch_neuronx.set_launch_blocking(True)
    try:
        blocking = _run(compiled, x)
    finally:
        torch_neuronx.set_launch_blocking(False)
    assert _bits_equal(queued, blocking)


def test_eager_after_a_graph_keeps_cpu_bits(compiled):
    x = _data(100_003)
    _run(compiled, x)
    cpu = x.cpu()
    assert _bits_equal([x.sum().cpu(), (x * x).sum().cpu()], [cpu.sum(), (cpu * cpu).sum()])
