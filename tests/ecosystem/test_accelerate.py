"""Hugging Face Accelerate on neuron, unchanged: `accelerate launch --num_processes 2` runs
DDP on two neuron devices through the "neuron" c10d backend and equals the same script on
CPU with gloo, bit for bit; save_state/load_state resume; bf16 mixed precision; `accelerate env`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "accelerate_ddp.py")
BIN = Path(sys.executable).parent


def _launch(cmd: list, tmp_path: Path, **env) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    r = subprocess.run(cmd + [SCRIPT, "--state_dir", str(tmp_path / "state")], env=full,
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_accelerate_launch_ddp_on_neuron_equals_gloo(tmp_path):
    ours = _launch([str(BIN / "accelerate"), "launch", "--num_processes", "2"], tmp_path / "n")
    assert ours["device"] == "neuron:0" and ours["num_processes"] == 2
    assert ours["distributed_type"] == "DistributedType.MULTI_NEURON"
    # the same unchanged script on CPU, DDP over gloo
    peer = _launch([str(BIN / "torchrun"), "--nproc_per_node", "2"], tmp_path / "c",
                   TORCH_DEVICE_BACKEND_AUTOLOAD="0", ACCELERATE_USE_CPU="true")
    assert peer["distributed_type"] == "DistributedType.MULTI_CPU"
    assert ours["losses"] == peer["losses"]          # every rank's loss, gathered
    half = len(ours["losses"]) // 2
    assert ours["resumed"] == ours["losses"][half:]  # load_state brought the state back


def _single_process(monkeypatch, **env):
    import accelerate_ddp
    from accelerate.state import AcceleratorState

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    AcceleratorState._reset_state(True)
    try:
        return accelerate_ddp.main(["--steps", "4", "--state_dir", "state"])
    finally:
        AcceleratorState._reset_state(True)


def test_accelerator_bf16_single_process(monkeypatch, in_tmp):
    ours = _single_process(monkeypatch, ACCELERATE_MIXED_PRECISION="bf16")
    assert ours["device"] == "neuron" and ours["mixed_precision"] == "bf16"
    assert ours["resumed"] == ours["losses"][2:]
    ref = _single_process(monkeypatch, ACCELERATE_MIXED_PRECISION="bf16", ACCELERATE_USE_CPU="true")
    assert ref["device"] == "cpu"
    assert torch.tensor(ours["losses"]).allclose(torch.tensor(ref["losses"]), rtol=2e-2)


def test_accelerate_env_reports_neuron():
    r = subprocess.run([str(BIN / "accelerate"), "env"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "PyTorch accelerator: NEURON" in r.stdout and "NEURON type: neuron" in r.stdout
