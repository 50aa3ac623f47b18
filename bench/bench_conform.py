"""Tiny-op and dropout paths of neuron against CPU in the same process (paired medians).

Dropout runs through a Python kernel so that it draws from the neuron generator; this shows
what that costs and that the tiny-op path is unchanged. Run: .venv/bin/python bench/bench_conform.py
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import torch_neuronx  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_device import paired  # noqa: E402


def _tiny(dev):
    x = torch.ones(1, device=dev)

    def run():
        for _ in range(1000):
            x.add(1)
        torch.neuron.synchronize()
    return run


def _dropout(dev):
    x = torch.ones(64, 64, device=dev)

    def run():
        for _ in range(100):
            F.dropout(x, 0.1)
        torch.neuron.synchronize()
    return run


if __name__ == "__main__":
    for name, make in (("tiny add (1 element) x1000", _tiny), ("F.dropout 64x64 x100", _dropout)):
        ratio, _, _ = paired(lambda: make("cpu"), lambda: make("neuron"), 15, 3)
        print(f"{name}: neuron/cpu median ratio {ratio:.2f}")
