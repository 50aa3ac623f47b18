"""Tensor parallelism on neuron: ``vllm.LLM(..., tensor_parallel_size=2)`` runs two workers on
neuron:0 and neuron:1 whose collectives go through the "neuron" c10d backend; greedy output
equals Transformers' on CPU token for token. Other parallelism and too few devices are refused."""
import os
import subprocess
import sys
import traceback

import pytest
import torch

from test_offline import MAX_TOKENS, greedy, make_llm, prompt_ids, transformers_greedy
from test_server import free_port

TP = 2


@pytest.fixture(scope="module")
def prometheus_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prometheus")


@pytest.fixture(scope="module")
def tp_llm(llama_dir, prometheus_dir):
    # The tiny Llama has 4 attention heads and 2 KV heads: each worker holds half of each.
    # An inherited LOCAL_RANK (as under a launcher) must not move a worker off neuron:<rank>.
    # The workers (spawned meanwhile) write the modelled series to Prometheus' multiprocess
    # directory, as under the server.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOCAL_RANK", "1")
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(prometheus_dir))
        llm = make_llm(llama_dir, tensor_parallel_size=TP)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _published(prometheus_dir) -> tuple:
    """(tokens, requests with a first token) in the modelled series of all processes."""
    from prometheus_client import CollectorRegistry, multiprocess
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(prometheus_dir))
    label = {"platform": _platform()}
    tokens = reg.get_sample_value("neuron:modelled_tokens_total", label) or 0.0
    ttft = reg.get_sample_value("neuron:modelled_time_to_first_token_seconds_count",
                                label) or 0.0
    return tokens, ttft


def test_tp2_greedy_batch_equals_transformers(tp_llm, llama_dir):
    prompts = prompt_ids()
    assert greedy(tp_llm, prompts) == transformers_greedy(llama_dir, prompts, MAX_TOKENS)


def test_tp2_workers_own_a_device_and_reduce_through_the_neuron_backend(tp_llm,
                                                                        prometheus_dir):
    tp_llm.collective_rpc("reset_modelled_summary")
    before = _published(prometheus_dir)
    greedy(tp_llm, prompt_ids(2, seed=3), 4)
    # Both workers model the same steps; only the first publishes, so each token and each
    # request is counted once.
    tokens, ttft = _published(prometheus_dir)
    assert (tokens - before[0], ttft - before[1]) == (2 * 4, 2)
    summaries = tp_llm.collective_rpc("modelled_summary")
    assert [s["device"] for s in summaries] == [f"neuron:{i}" for i in range(TP)]
    for s in summaries:
        assert s["tensor_parallel_size"] == TP
        # Only the neuron c10d backend charges "c10d::" time to a device: the row-parallel
        # layers' all-reduces ran through it, on this worker's device.
        assert s["collectives"].get("c10d::all_reduce", 0) > 0, s
        assert 0 < s["collective_seconds"] < s["modelled_seconds"]
        assert s["tokens"] == 2 * 4
        # one replica spans TP of the chip's logical cores
        assert s["tokens_per_s_per_chip"] == pytest.approx(
            s["tokens"] / s["modelled_seconds"] * (_cores_per_chip() // TP))


def _cores_per_chip() -> int:
    import torch_neuronx
    cfg = torch_neuronx._state.config()
    return cfg.profile.logical_cores(cfg.lnc)


def _platform() -> str:
    import torch_neuronx
    return torch_neuronx._state.config().profile.name


def _group_rank(rank: int, world: int, port: int, queue) -> None:
    """One rank of vLLM's tensor-parallel group on the "neuron" backend: every collective
    vLLM's GroupCoordinator offers, each result compared with the same op done on CPU."""
    try:
        import torch_neuronx  # noqa: F401
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        torch.neuron.set_device(rank)
        dev = torch.device("neuron", rank)
        with set_current_vllm_config(VllmConfig()):
            ps.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank,
                                            "neuron")
            ps.ensure_model_parallel_initialized(world, 1)
            tp = ps.get_tp_group()
            cpu = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r))
                   for r in range(world)]
            wide = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + r))
                    for r in range(world)]
            x = cpu[rank].to(dev)
            got = {
                "backend": torch.distributed.get_backend(tp.device_group),
                "all_reduce": tp.all_reduce(x.clone()).cpu(),
                "all_reduce_bf16": tp.all_reduce(x.to(torch.bfloat16)).cpu(),
                "all_gather_last": tp.all_gather(x, -1).cpu(),
                "all_gather_first": tp.all_gather(x, 0).cpu(),
                "reduce_scatter_last": tp.reduce_scatter(wide[rank].to(dev), -1).cpu(),
                "reduce_scatter_first": tp.reduce_scatter(wide[rank].to(dev), 0).cpu(),
                "broadcast": tp.broadcast(x.clone(), 1).cpu(),
            }
            for dst in range(world):
                out = tp.gather(x, dst, -1)
                got[f"gather_to_{dst}"] = None if out is None else out.cpu()
            sent = {"a": x, "n": 3}
            got["tensor_dict"] = tp.broadcast_tensor_dict(sent if rank == 0 else None, 0)["a"].cpu()
            if rank == 0:
                tp.send(x, 1)
            else:
                got["recv"] = tp.recv(x.shape, x.dtype, 0).cpu()
            tp.barrier()
            want = {
                "backend": "neuron",
                "all_reduce": sum(cpu),
                "all_reduce_bf16": sum(c.to(torch.bfloat16) for c in cpu),
                "all_gather_last": torch.cat(cpu, -1),
                "all_gather_first": torch.cat(cpu, 0),
                "reduce_scatter_last": sum(wide).chunk(world, -1)[rank],
                "reduce_scatter_first": sum(wide).chunk(world, 0)[rank],
                "broadcast": cpu[1],
                "tensor_dict": cpu[0],
            }
            for dst in range(world):
                want[f"gather_to_{dst}"] = torch.cat(cpu, -1) if rank == dst else None
            if rank == 1:
                want["recv"] = cpu[0]
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
        # Compared here: tensors sent through the queue would be shared memory that dies
        # with this process.
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
        wrong = {}
        for k in want:
            try:
                # exact: a sum of two addends is the same in any order
                if not isinstance(want[k], str) and want[k] is not None:
                    torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
                elif got[k] != want[k]:
                    wrong[k] = f"got {got[k]!r}, want {want[k]!r}"
            except AssertionError as e:
                wrong[k] = str(e)
        queue.put((rank, sorted(want), wrong))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def test_vllm_tp_group_collectives_on_the_neuron_backend_equal_cpu():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_group_rank, args=(r, TP, port, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for rank, checked, wrong in sorted(results, key=lambda r: r[0]):
        assert checked is not None, f"rank {rank} failed:\n{wrong}"
        assert "all_reduce" in checked and "reduce_scatter_last" in checked
        assert wrong == {}, f"rank {rank}: {wrong}"


def test_pipeline_parallel_is_refused(llama_dir):
    with pytest.raises(NotImplementedError, match=r"pipeline parallel.*pipeline_parallel_size=2"):
        make_llm(llama_dir, pipeline_parallel_size=2)


def test_more_tp_workers_than_devices_names_both_numbers(llama_dir):
    # One visible core (NEURON_RT_VISIBLE_CORES) and two workers asked for (a size vLLM's own
    # check of the 4 heads accepts). A fresh process: the device count is read when
    # torch_neuronx is imported.
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "from test_offline import make_llm\n"
            "if __name__ == '__main__':\n"
            f"    make_llm({str(llama_dir)!r}, tensor_parallel_size=2)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, NEURON_RT_VISIBLE_CORES="1"))
    assert out.returncode != 0
    # a ValueError, which vLLM's pydantic config reports inside its ValidationError
    assert ("neuron: tensor_parallel_size=2 needs 2 neuron devices (one worker each) but 1 "
            "are visible") in out.stderr, out.stderr[-3000:]
