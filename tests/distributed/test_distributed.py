"""The "neuron" c10d backend and PyTorch's parallelisms on it, each compared with a
single-process CPU run (done inside the rank programs of _workers.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is required")


def test_backend_registered_for_neuron_and_cpu():
    assert "neuron" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["neuron"] == "neuron"
    assert dist.Backend.backend_capability["neuron"] == ["neuron", "cpu"]
    # cpu keeps gloo as its default: registering neuron must not steal it
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"


@pytest.mark.parametrize("nproc", [2, 4])
def test_collectives(nproc):
    out = _launch.run("collectives", nproc, timeout=240)
    assert all("ok" in o for _, o in out)


def test_every_argument_form_nccl_accepts():
    # Accelerate and CUDA code rely on NCCL's rules (element counts, uneven list
    # collectives, complex and bool reductions), which are wider than gloo's.
    out = _launch.run("nccl_forms", 2, timeout=180)
    assert all("nccl forms ok on neuron" in o and "nccl forms ok on cpu" in o for _, o in out)


# The peer agreement runs over shared memory on one host ("1", the default) and as a gloo
# round trip when ranks span hosts ("gloo" forces that here).
CHECK_TRANSPORTS = pytest.mark.parametrize("check", ["1", "gloo"])


def _agreement_files() -> set:
    return {f for f in os.listdir("/dev/shm") if f.startswith("torch_neuronx_agree_")}


@CHECK_TRANSPORTS
def test_mismatch_and_wrong_device_errors(check):
    out = _launch.run("mismatch", 2, timeout=120, env={"TORCH_NEURONX_DIST_CHECK": check})
    for _, o in out:
        for what in ("shape", "dtype", "op", "all_gather", "splits"):
            assert f"{what} ->" in o, o


@CHECK_TRANSPORTS
def test_dead_rank_errors_on_survivor(check):
    t0 = time.monotonic()
    out = _launch.run("dead_rank", 2, timeout=90, expect_fail=True,
                      env={"DIST_TIMEOUT": "10", "TORCH_NEURONX_DIST_CHECK": check})
    assert out[0][0] == 0, out[0][1][-3000:]
    assert "survivor error" in out[0][1]
    assert out[1][0] == 3
    assert time.monotonic() - t0 < 80


@CHECK_TRANSPORTS
def test_rank_that_never_arrives_times_out(check):
    out = _launch.run("never_arrives", 2, timeout=90, expect_fail=True,
                      env={"DIST_TIMEOUT": "4", "TORCH_NEURONX_DIST_CHECK": check})
    assert out[0][0] == 0, out[0][1][-3000:]
    assert "timeout error" in out[0][1]


def test_shared_memory_agreement_subgroups_async_and_dead_peer():
    before = _agreement_files()
    out = _launch.run("shm_groups", 4, timeout=180)
    for r, (_, o) in enumerate(out):
        assert "async ok" in o, o[-3000:]
        if r in (1, 2, 3):
            assert "subgroup mismatch ->" in o, o[-3000:]
        if r in (1, 2):
            assert "subgroup dead peer ->" in o, o[-3000:]
    # ranks exited without destroy_process_group: still nothing left behind
    assert _agreement_files() <= before


def test_shared_memory_agreement_ring():
    out = _launch.run("shm_ring", 3, timeout=120)
    assert all("ring ok" in o for _, o in out)


def test_more_ranks_than_cores_is_a_clear_error():
    out = _launch.run("too_many", 3, timeout=90, env={"NEURON_RT_NUM_CORES": "2"}, expect_fail=True)
    for rc, o in out:
        assert rc == 7, o[-3000:]
        assert "3 ranks were launched" in o and "only 2 neuron device(s) are visible" in o


def test_ddp():
    _launch.run("ddp", 2, timeout=240)


def test_fsdp2_dcp_zero_simple_fsdp(tmp_path):
    out = _launch.run("fsdp", 2, timeout=300, args=(str(tmp_path / "ckpt"),))
    for marker in ("FSDP2 ok", "DCP ok", "FSDP2 bf16 ok", "ZeRO ok", "SimpleFSDP eager ok"):
        assert marker in out[0][1], out[0][1][-3000:]


def _compiles_on_neuron() -> str | None:
    """Why torch.compile of the test GPT fails on the device without any distribution, or None."""
    import _models as M
    import torch._dynamo
    try:
        torch._dynamo.reset()
        m = M.GPT().to("neuron")
        torch.compile(m, backend="aot_eager")(M.batch(0, 2, 8)[0].to("neuron")).sum().backward()
        return None
    except Exception as e:  # the device's compile support, not distribution, is at fault
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        torch._dynamo.reset()


def test_simple_fsdp_under_compile():
    why = _compiles_on_neuron()
    if why is not None:
        pytest.skip(f"torch.compile of the single-process GPT fails on neuron: {why}")
    out = _launch.run("simple_fsdp_compile", 2, timeout=300)
    assert "SimpleFSDP compile ok" in out[0][1]


def test_tensor_sequence_pipeline_parallel_dtensor():
    out = _launch.run("tp", 2, timeout=300)
    for marker in ("TP  ok", "TP SP ok", "DTensor ok", "pipeline GPipe ok", "pipeline 1F1B ok",
                   "pipeline Interleaved1F1B ok"):
        assert marker in out[0][1], out[0][1][-3000:]


def test_fsdp_tp_2d_mesh_and_dcp_resharding(tmp_path):
    out = _launch.run("fsdp_tp_2d", 4, timeout=300, args=(str(tmp_path / "ckpt"),))
    assert "DCP 2-D reshard ok" in out[0][1]


def test_torchrun_binds_local_rank_and_picks_neuron(tmp_path):
    """Through the real launcher: no backend argument, neuron is chosen for the accelerator
    and LOCAL_RANK selects the device."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "assert dist.group.WORLD.name() == 'neuron', dist.group.WORLD\n"
        "import os\n"
        "assert torch.neuron.current_device() == int(os.environ['LOCAL_RANK'])\n"
        "t = torch.ones(2, device='neuron') * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "assert t.tolist() == [3.0, 3.0], t\n"
        "out = os.path.join(os.path.dirname(__file__), f'rank{dist.get_rank()}.txt')\n"
        "open(out, 'w').write(f'rank {dist.get_rank()} device {t.device}')\n"
        "dist.destroy_process_group()\n")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(_launch.REPO))
    res = subprocess.run([torchrun, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{_launch.free_port()}", str(script)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # Each rank reports in its own file: the two processes' stdout interleaves.
    assert (tmp_path / "rank0.txt").read_text() == "rank 0 device neuron:0"
    assert (tmp_path / "rank1.txt").read_text() == "rank 1 device neuron:1"


def test_collectives_model_formulas():
    from torch_neuronx.distributed.collectives_model import bus_bandwidth, collective_seconds
    from neuronhw.trn2 import TRN2
    lnc = 2
    s = 64 << 20
    t2 = collective_seconds("all_reduce", s, 2, 1, TRN2, lnc)
    t4 = collective_seconds("all_reduce", s, 4, 1, TRN2, lnc)
    per_rank = TRN2.neuronlink_bandwidth / (TRN2.physical_cores // lnc)
    lat = TRN2.neuronlink_latency_ns * 1e-9
    assert t2 == pytest.approx(min(s / per_rank + 2 * lat, s / per_rank + 2 * lat))
    assert t4 == pytest.approx(min(1.5 * s / per_rank + 6 * lat, s / per_rank + 4 * lat))
    # small messages are latency bound: the tree wins
    assert collective_seconds("all_reduce", 8, 8, 1, TRN2, lnc) == pytest.approx(8 / per_rank + 6 * lat)
    # crossing instances adds the slower EFA phase
    assert collective_seconds("all_reduce", s, 8, 2, TRN2, lnc) > collective_seconds("all_reduce", s, 8, 1, TRN2, lnc)
    assert collective_seconds("all_gather", s, 1, 1, TRN2, lnc) == 0.0
    assert collective_seconds("send", s, 2, 1, TRN2, lnc) == pytest.approx(s / per_rank + lat)
    assert bus_bandwidth("all_reduce", s, 1.0, 4) == pytest.approx(s * 1.5)
    with pytest.raises(ValueError, match="unknown collective"):
        collective_seconds("all_scream", s, 2, 1, TRN2, lnc)


def test_example_fsdp_tp_gpt_trains_on_4_ranks():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(_launch.REPO))
    res = subprocess.run([torchrun, "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{_launch.free_port()}",
                          str(_launch.REPO / "examples" / "fsdp_tp_gpt.py"), "--steps", "11"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    losses = [float(l.split()[-1]) for l in res.stdout.splitlines() if l.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.5, res.stdout
    assert "of which collectives" in res.stdout


def test_dtensor_random_ops_give_each_shard_its_part_of_one_stream():
    # DTensor's OffsetBasedRNGTracker moves the generator's 16-byte (seed, offset) state, as
    # on CUDA; on neuron the offset is the word of CPU's Mersenne Twister stream, so a sharded
    # random init equals the unsharded one on a single device, bit for bit.
    out = _launch.run("dtensor_random", 2, timeout=180)
    assert all("dtensor random ok" in o for _, o in out), out


def test_init_with_device_id_and_no_backend_name():
    # `init_process_group(device_id=...)` asks the group for its per-device backend object;
    # the "neuron" group answers as its own backend (it had raised "No backend type
    # associated with device type neuron")
    out = _launch.run("device_id", 2, timeout=180)
    assert all("device_id ok" in o for _, o in out), out
