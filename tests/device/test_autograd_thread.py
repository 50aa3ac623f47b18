"""Backward of neuron tensors runs on the thread that calls it (as on CPU), with CPU's gradients;
autograd's own switch brings its device thread back."""
import threading

import torch


def _grads_and_thread(device):
    torch.manual_seed(0)
    lin = torch.nn.GRUCell(8, 8).to(device)
    x = torch.randn(4, 8).to(device).requires_grad_()
    seen = []
    x.register_hook(lambda g: seen.append(threading.get_ident()))
    lin(x).square().sum().backward()
    grads = [x.grad.cpu()] + [p.grad.cpu() for p in lin.parameters()]
    return grads, seen[0]


def test_backward_runs_on_calling_thread_with_cpu_gradients():
    cpu, _ = _grads_and_thread("cpu")
    dev, thread = _grads_and_thread("neuron")
    assert thread == threading.get_ident()
    for a, b in zip(cpu, dev):
        assert torch.equal(a, b)


def test_multithreading_switch_restores_device_thread():
    cpu, _ = _grads_and_thread("cpu")
    with torch.autograd.set_multithreading_enabled(True):
        dev, thread = _grads_and_thread("neuron")
    assert thread != threading.get_ident()
    for a, b in zip(cpu, dev):
        assert torch.equal(a, b)
    assert not torch._C._is_multithreading_enabled()

