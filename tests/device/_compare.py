"""Bit-for-bit comparison of device results with CPU's, shared by the Adaptive Eager tests."""
from __future__ import annotations

import torch

import torch_neuronx

N = "neuron"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers: NaN payloads, signs and -0.0 compare too."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = torch.equal(bits(got.detach().cpu().contiguous()), bits(want.detach().contiguous()))
    assert same, f"{what}: results differ"


def run_twice(fn, *cpu_inputs):
    """CPU result, the device result of a second call (the first teaches signatures) on the
    CPU, and the Adaptive Eager counters of that second call."""
    want = fn(*cpu_inputs)
    dev = [t.to(N) for t in cpu_inputs]
    fn(*dev)
    torch.neuron.synchronize()
    torch_neuronx.adaptive_eager_stats(reset=True)
    got = fn(*dev)
    torch.neuron.synchronize()
    stats = torch_neuronx.adaptive_eager_stats()
    got = [g.cpu() for g in got] if isinstance(got, list) else got.cpu()
    return want, got, stats
