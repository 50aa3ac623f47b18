"""``nn.DataParallel`` and ``torch.nn.parallel.comm`` over neuron devices, as CUDA code uses
them: the results equal the CPU computing each replica's chunk and summing the replicas'
gradients in DataParallel's order, bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import comm

N = "neuron"
DEVICES = [0, 1, 2, 3]


def _model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4))


def _cpu_replicas(model, x, n):
    """Each chunk through a CPU copy holding the model's weights; the replicas' gradients
    summed as DataParallel's reduce adds them (the first device's, then the others)."""
    outs, grads = [], None
    for c in x.chunk(n):
        ref = _model()
        ref.load_state_dict(model.state_dict())
        out = ref(c)
        out.sum().backward()
        outs.append(out.detach())
        g = [p.grad for p in ref.parameters()]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    return torch.cat(outs), grads


@pytest.mark.parametrize("batch", [12, 14])
def test_data_parallel_training_equals_cpu_replicas(batch):
    torch.manual_seed(0)
    cpu = _model()
    dev = _model().to(N)
    dev.load_state_dict(cpu.state_dict())
    dp = nn.DataParallel(dev, device_ids=DEVICES)
    opt = torch.optim.SGD(dev.parameters(), lr=0.1, momentum=0.9)
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        x = torch.randn(batch, 8)
        first = {k: v.clone() for k, v in cpu.state_dict().items()}
        want, grads = _cpu_replicas(cpu, x, len(DEVICES))
        y = dp(x.to(N))
        assert y.device == torch.device(N, 0)
        assert torch.equal(y.detach().cpu(), want), step
        opt.zero_grad()
        y.sum().backward()
        for p, g, q in zip(dev.parameters(), grads, cpu.parameters()):
            assert torch.equal(p.grad.cpu(), g)
            q.grad = g
        opt.step()
        opt_cpu.step()
        # Replica 0 is the module itself: its chunk alone updates the running statistics.
        with torch.no_grad():
            bn = _model()
            bn.load_state_dict(first)
            bn(x.chunk(len(DEVICES))[0])
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                getattr(cpu[2], name).copy_(getattr(bn[2], name))
        assert torch.equal(dev[2].running_mean.cpu(), cpu[2].running_mean)
    for p, q in zip(dev.parameters(), cpu.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach())


def test_data_parallel_eval_cpu_input_and_output_device():
    torch.manual_seed(1)
    model = nn.Linear(6, 3).to(f"{N}:1")
    dp = nn.DataParallel(model, device_ids=[1, 2], output_device=2).eval()
    x = torch.randn(5, 6)
    with torch.no_grad():
        y = dp(x)     # a CPU batch is scattered by copy streams, as on CUDA
    assert y.device == torch.device(N, 2)
    want = torch.cat([c @ model.weight.detach().cpu().T + model.bias.detach().cpu()
                      for c in x.chunk(2)])
    assert torch.equal(y.cpu(), want)


def test_comm_functions_against_cpu():
    x = torch.randn(7, 5)
    xd = x.to(N)
    copies = comm.broadcast(xd, [0, 2, 3])
    assert copies[0] is xd
    assert [c.device.index for c in copies] == [0, 2, 3]
    assert all(torch.equal(c.cpu(), x) for c in copies)

    parts = comm.scatter(xd, [1, 3], chunk_sizes=[2, 5], dim=0)
    assert [p.device.index for p in parts] == [1, 3]
    assert torch.equal(parts[1].cpu(), x[2:])
    cols = comm.scatter(x, [0, 1, 2], dim=1)           # from the CPU, 5 columns in 3 chunks
    assert [tuple(c.shape) for c in cols] == [(7, 2), (7, 2), (7, 1)]

    assert torch.equal(comm.gather(cols, dim=1, destination="cpu"), x)
    back = comm.gather(cols, dim=1, destination=3)
    assert back.device == torch.device(N, 3) and torch.equal(back.cpu(), x)
    out = torch.empty(7, 5, device=N)
    comm.gather(cols, dim=1, out=out)
    assert torch.equal(out.cpu(), x)

    nhwc = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    g = comm.gather([nhwc.to(f"{N}:0"), nhwc.to(f"{N}:1")], dim=0, destination=0)
    assert g.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(g.cpu(), torch.cat([nhwc, nhwc]))

    a, b = torch.randn(3, 4), torch.randn(10)
    per_device = comm.broadcast_coalesced([a.to(N), b.to(N)], [0, 1, 2], buffer_size=16)
    for k, (ca, cb) in enumerate(per_device):
        assert ca.device.index == cb.device.index == k
        assert torch.equal(ca.cpu(), a) and torch.equal(cb.cpu(), b)
    ad = a.to(N)
    twice = comm.broadcast_coalesced([ad, b.to(N), ad], [0, 1])[1]   # a tensor listed twice
    assert torch.equal(twice[0].cpu(), a) and torch.equal(twice[2].cpu(), a)
    total = comm.reduce_add([a.to(f"{N}:{i}") for i in range(3)], destination=1)
    assert total.device.index == 1 and torch.equal(total.cpu(), a + a + a)

    outs = [torch.empty(3, 5, device=f"{N}:0"), torch.empty(4, 5, device=f"{N}:1")]
    comm.scatter(xd, out=outs)
    assert torch.equal(outs[0].cpu(), x[:3]) and torch.equal(outs[1].cpu(), x[3:])


def test_comm_errors_name_the_problem_and_the_device_stays_usable():
    x = torch.randn(4, 4, device=N)
    with pytest.raises(RuntimeError, match="all tensors must be on devices"):
        comm.broadcast_coalesced([x], [1, 2])
    with pytest.raises(RuntimeError, match="must add up"):
        comm.scatter(x, [0, 1], chunk_sizes=[1, 2])
    with pytest.raises(RuntimeError, match="input 1 has shape"):
        comm.gather([x, torch.randn(4, 3, device=N)], dim=0)
    with pytest.raises(RuntimeError, match="expected a neuron tensor"):
        comm.gather([x, torch.randn(4, 4)], dim=0)
    assert torch.equal((x + 1).cpu(), x.cpu() + 1)


def test_stream_context_on_another_device_restores_the_current_device():
    # CUDA's torch.cuda.stream(s) leaves the device current at entry current on exit; the
    # copy streams of DataParallel's scatter rely on it.
    torch.neuron.set_device(0)
    s = torch.neuron.Stream(device=2)
    with torch.neuron.stream(s):
        assert torch.neuron.current_device() == 2
        assert torch.neuron.current_stream() == s
    assert torch.neuron.current_device() == 0
    assert torch.neuron.current_stream(2) == torch.neuron.default_stream(2)
