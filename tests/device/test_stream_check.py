"""The stream checker against the classic multi-stream bugs, and its silence on correct code."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_neuronx

N = "neuron"


def _side_stream_after_default():
    s = torch.neuron.Stream()
    s.wait_stream(torch.neuron.current_stream())
    return s


def test_read_of_side_stream_result_without_wait_is_reported():
    with torch_neuronx.stream_check():
        x = torch.ones(1000, device=N)
        s = _side_stream_after_default()
        with torch.neuron.stream(s):
            y = x * 2
        with pytest.raises(RuntimeError) as e:
            y + 1
    msg = str(e.value)
    assert "read after write" in msg and "aten::add" in msg and "aten::mul" in msg
    assert msg.count("test_stream_check.py:") == 2  # both source lines
    assert (torch.ones(2, device=N) + 1).sum().item() == 4  # still usable


def test_wait_stream_orders_the_read():
    with torch_neuronx.stream_check():
        x = torch.ones(1000, device=N)
        s = _side_stream_after_default()
        with torch.neuron.stream(s):
            y = x * 2
        torch.neuron.current_stream().wait_stream(s)
        assert (y + 1).sum().item() == 3000


def test_event_orders_the_read():
    with torch_neuronx.stream_check():
        x = torch.ones(10, device=N)
        s = _side_stream_after_default()
        with torch.neuron.stream(s):
            y = x * 2
            ev = torch.neuron.Event()
            ev.record()
        torch.neuron.current_stream().wait_event(ev)
        y + 1


def test_synchronize_orders_everything():
    with torch_neuronx.stream_check():
        x = torch.ones(10, device=N)
        s = _side_stream_after_default()
        with torch.neuron.stream(s):
            y = x * 2
        torch.neuron.synchronize()
        y + 1


def test_write_while_other_stream_reads_is_reported():
    with torch_neuronx.stream_check():
        x = torch.ones(10, device=N)
        s = _side_stream_after_default()
        with torch.neuron.stream(s):
            x.sum()
        with pytest.raises(RuntimeError, match="write after read"):
            x.add_(1)


def test_free_and_reuse_without_record_stream_is_reported():
    with torch_neuronx.stream_check():
        x = torch.ones(1 << 16, device=N)
        s = _side_stream_after_default()
        with torch.neuron.stream(s):
            x.sum()
        del x
        with pytest.raises(RuntimeError, match="record_stream"):
            torch.empty(1 << 16, device=N).fill_(3)


def test_record_stream_makes_reuse_safe():
    with torch_neuronx.stream_check():
        x = torch.ones(1 << 16, device=N)
        s = _side_stream_after_default()
        with torch.neuron.stream(s):
            x.sum()
        x.record_stream(s)
        del x
        torch.empty(1 << 16, device=N).fill_(3)


def test_off_by_default_and_by_environment():
    assert not torch_neuronx.runtime.stream_check.enabled()
    code = ("import torch, torch_neuronx\n"
            "print(torch_neuronx.runtime.stream_check.enabled())\n"
            "x = torch.ones(4, device='neuron'); s = torch.neuron.Stream()\n"
            "s.wait_stream(torch.neuron.current_stream())\n"
            "with torch.neuron.stream(s): y = x * 2\n"
            "try:\n    y + 1\nexcept RuntimeError as e: print('reported')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TORCH_NEURONX_STREAM_CHECK="1"))
    assert r.stdout.split() == ["True", "reported"], r.stderr


def test_single_stream_training_is_clean():
    with torch_neuronx.stream_check():
        m = torch.nn.Linear(8, 8).to(N)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(4, 8, device=N)).sum().backward()
            opt.step()
