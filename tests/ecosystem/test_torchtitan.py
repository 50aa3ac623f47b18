"""TorchTitan on neuron (run by `make test-torchtitan`, which installs TorchTitan and triton;
the default set skips it): its own device detection (the device it picks, its MFU peak-FLOPs
table, its memory monitor) against what the device reports, and its debug Llama trained by
`torchrun -m torchtitan.train`, unchanged, under FSDP2, replicated data parallelism and
FSDP2 + TP.

The reference for the losses is the same recipe without sharding, on neuron: PyTorch 2.13's
FlexAttention (the only attention TorchTitan's Llama takes) has no CPU backward, so the recipe
cannot train on CPU/gloo at all. The sharded run initialises its weights through DTensor's
RNG tracker, which moves the neuron generator's (seed, offset) state so each shard draws its
own part of one stream; the replicated run draws each tensor whole. Equal losses show both.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")


def test_torchtitan_picks_neuron_and_the_modelled_peak():
    from torchtitan.components.metrics import DeviceMemoryMonitor
    from torchtitan.tools import utils

    assert utils.device_type == "neuron" and utils.device_module is torch.neuron
    peak = utils.get_peak_flops(torch.neuron.get_device_name())
    assert peak == pytest.approx(torch.neuron.get_device_properties().peak_tflops["bfloat16"] * 1e12)
    monitor = DeviceMemoryMonitor("neuron:0")
    assert monitor.device_name == "neuron"
    assert monitor.device_capacity == torch.neuron.get_device_properties(0).total_memory
    x = torch.empty(1 << 20, device="neuron")
    stats = monitor.get_peak_stats()
    assert stats.max_reserved_gib >= x.nbytes / 2**30 and stats.num_ooms == 0


_REPO = Path(__file__).resolve().parents[2]
# (Not "examples/torchtitan": with examples/ on sys.path that name would shadow the package.)
_EXAMPLE = _REPO / "examples" / "titan_debug"
_STEP = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([0-9.]+)")


def _free_port() -> int:
    # (torchrun's "--master_port 0" hangs the 4-rank rendezvous; a port found free here works.)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path, nproc, *extra, steps=3, timeout=600):
    sys.path.insert(0, str(_EXAMPLE))
    try:
        from make_assets import make_assets
    finally:
        sys.path.pop(0)
    tok, data = make_assets(tmp_path / "assets")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_EXAMPLE), str(_REPO)]),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_free_port()), "-m", "torchtitan.train", "--module", "llama3",
           "--config", "llama3_debugmodel", "--hf_assets_path", str(tok),
           "--dataloader.dataset_path", str(data), "--training.steps", str(steps),
           "--training.seq_len", "128", "--training.local_batch_size", "2",
           "--parallelism.spmd-backend", "partial_dtensor", "--validator.no-enable",
           "--checkpoint.no-enable", "--metrics.no-enable-tensorboard", "--debug.seed", "42",
           "--dump_folder", str(tmp_path / "out"), *extra]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=timeout)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert "neuron" in log and "Training completed" in log, log[-3000:]
    losses = {}
    for step, loss in _STEP.findall(re.sub(r"\x1b\[[0-9;]*m", "", log)):
        losses.setdefault(int(step), float(loss))
    assert sorted(losses) == list(range(1, steps + 1)), log[-3000:]
    return [losses[i] for i in range(1, steps + 1)]


def test_torchtitan_trains_the_debug_llama_with_fsdp2_as_replicated(tmp_path):
    fsdp = _train(tmp_path / "fsdp", 2)
    ddp = _train(tmp_path / "ddp", 2, "--parallelism.data-parallel-replicate-degree", "2",
                 "--parallelism.data-parallel-shard-degree", "1")
    # Same data, same initial weights (sharded draws = whole draws), reductions in another
    # order: equal to float32 rounding.
    assert fsdp == pytest.approx(ddp, rel=1e-4), (fsdp, ddp)
    assert fsdp[-1] < fsdp[0]


def test_torchtitan_trains_with_fsdp2_and_tensor_parallel_on_four_ranks(tmp_path):
    if torch.neuron.device_count() < 4:
        pytest.skip("needs 4 neuron devices")
    losses = _train(tmp_path, 4, "--parallelism.tensor-parallel-degree", "2")
    # Tensor-parallel weights sharded along columns draw a contiguous part of the stream
    # (DTensor's tracker ignores contiguity, as on CUDA), so the start differs a little from
    # the runs above; it must still train.
    assert all(x == x for x in losses) and losses[-1] < losses[0]
    assert losses[0] == pytest.approx(8.2, abs=0.1)
