import json
import os

import pytest
import torch

import torch_neuronx
from torch_neuronx import cli, cost_model
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler
from torch_neuronx.profiling.explore import report


def _capture(tmp_path, fn):
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=cfg, on_trace_ready=handler.export_trace):
            fn()
            torch.neuron.synchronize()
    finally:
        handler.close()
    return os.path.join(str(tmp_path), "trace_0")


def _tiny_loop():
    x = torch.zeros(8, device="neuron")
    for _ in range(100):
        x = x.add(1)


def _big_chain():
    x = torch.randn(1 << 20, device="neuron")
    (x * 2).exp().sqrt()


def test_report_names_launch_bound_loop(tmp_path, capsys):
    path = _capture(tmp_path, _tiny_loop)
    r = report(path)
    assert r["top_kernels"][0]["name"] == "add"
    assert r["top_kernels"][0]["launches"] == 100
    assert r["top_kernels"][0]["bound"] == "launch"
    # 100 back-to-back launches of one tiny kernel: one fused kernel pays the fixed cost once
    assert r["fusion_opportunities"][0]["launches"] >= 100
    assert r["fusion_opportunities"][0]["saved_ns"] >= 99 * r["top_kernels"][0]["mean_ns"] * 0.9
    assert cli.main(["explore", path]) == 0
    assert "launch-bound" in capsys.readouterr().out


def test_report_hbm_chain_is_work_bound_and_matches_cost_model(tmp_path, capsys):
    # Adaptive Eager learns a chain it has seen and fuses it on later runs (its kernel is
    # then "fused_pointwise"): keep the ops apart so the report's kernels are the ops.
    was = torch_neuronx.is_adaptive_eager_enabled()
    torch_neuronx.set_adaptive_eager(False)
    try:
        cost_model.reset_modelled_time()
        path = _capture(tmp_path, _big_chain)
    finally:
        torch_neuronx.set_adaptive_eager(was)
    total = cost_model.modelled_time()
    r = report(path)
    assert r["modelled_ns"] == pytest.approx(sum(total.by_op.values()) * 1e9, abs=r["hardware_events"])
    assert {k["name"]: k["bound"] for k in r["top_kernels"]}["exp"] == "work"
    assert set(r["engines"]) <= {"vector", "scalar", "dma", "tensor"} and "scalar" in r["engines"]
    plots = str(tmp_path / "plots")
    assert cli.main(["explore", path, "--json", "--plots", plots]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["top_kernels"] == r["top_kernels"]
    for f in out["plots"]:
        assert os.path.getsize(f) > 1000


def test_explore_bad_dir_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="SystemProfileEvents"):
        report(str(tmp_path))


def test_explore_takes_the_output_dir_and_counts_nested_host_time_once(tmp_path, capsys):
    import pyarrow.parquet as pq
    _capture_traced(tmp_path, _matmul_then_chain, sessions=2)  # trace_0, trace_1
    r = report(str(tmp_path))  # the profile_output_dir: its newest trace
    assert r["trace"] == os.path.join(str(tmp_path), "trace_1")
    ev = pq.read_table(os.path.join(r["trace"], "SystemProfileEvents.parquet")).to_pandas()
    host = ev[ev.source == "framework"]
    span = int((host.start_ns + host.duration_ns).max() - host.start_ns.min())
    mine = [x for x in r["top_source_lines_host_ns"]
            if os.path.basename(x["file"]) == os.path.basename(__file__)]
    # the line's Python call, its ops and their sub-ops nest: wall time, not their sum
    assert mine and all(0 < x["host_ns"] <= span for x in mine)
    assert cli.main(["explore", str(tmp_path)]) == 0
    assert "trace_1" in capsys.readouterr().out.splitlines()[0]


def test_report_names_fused_kernel_once_the_chain_is_learned(tmp_path):
    for _ in range(2):  # the first run teaches Adaptive Eager the chain
        path = _capture(tmp_path, _big_chain)
    names = {k["name"] for k in report(path)["top_kernels"]}
    assert "fused_pointwise" in names and "exp" not in names


def _capture_traced(tmp_path, fn, sessions=1):
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    try:
        for _ in range(sessions):  # one handler: trace_0, trace_1, ...
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.PrivateUse1],
                                        with_stack=True, experimental_config=cfg,
                                        on_trace_ready=handler.export_trace):
                fn()
                torch.neuron.synchronize()
    finally:
        handler.close()
    return os.path.join(str(tmp_path), "trace_0")


def _matmul_then_chain():
    a = torch.randn(1024, 1024, device="neuron")
    b = a @ a
    torch.neuron.synchronize()
    x = torch.randn(1 << 20, device="neuron")
    return (x * 2).exp(), b


def test_traced_report_has_roofline_verdicts_lines_and_gaps(tmp_path, capsys):
    was = torch_neuronx.is_adaptive_eager_enabled()
    torch_neuronx.set_adaptive_eager(False)
    try:
        path = _capture_traced(tmp_path, _matmul_then_chain)
    finally:
        torch_neuronx.set_adaptive_eager(was)
    r = report(path)
    bound = {k["name"]: k["bound"] for k in r["top_kernels"]}
    # 1024^3 matmul: 2 GFLOP over 12 MiB is far above the ridge; x*2 reads and writes 4 MiB
    # for 1M multiplies: HBM-bound.
    assert bound["mm"] == "compute" and bound["mul"] == "memory"
    assert r["roofline"]
    top_line = r["top_source_lines_modelled_ns"][0]
    assert os.path.basename(top_line["file"]) == os.path.basename(__file__)
    assert r["device_busy_ns"] > 0 and 0 <= r["host_overlap_share"] <= 1
    # the synchronize between the matmul and the chain leaves the device idle
    assert r["idle_ns"] > 0 and r["idle_gaps"][0]["idle_ns"] > 0
    assert cli.main(["explore", path, "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "compute-bound" in out and "memory-bound" in out and "idle" in out
    assert os.path.getsize(str(tmp_path / "plots" / "roofline.png")) > 1000


def _small_chain():
    x = torch.randn(64, device="neuron")
    a = torch.randn(512, 512, device="neuron")
    torch.neuron.synchronize()
    return (x * 2).exp().sqrt().neg(), a @ a


def test_report_names_unfused_small_chain_and_its_saving(tmp_path, capsys):
    was = torch_neuronx.is_adaptive_eager_enabled()
    torch_neuronx.set_adaptive_eager(False)  # the chain Adaptive Eager did not fuse
    try:
        path = _capture_traced(tmp_path, _small_chain)
    finally:
        torch_neuronx.set_adaptive_eager(was)
    r = report(path)
    chain = r["fusion_opportunities"][0]
    # the random fills before it and the matmul after it are not part of it
    assert chain["kernels"] == ["mul", "exp", "sqrt", "neg"] and chain["launches"] == 4
    assert chain["source_lines"] == [{"file": os.path.basename(__file__), "line": _small_chain.__code__.co_firstlineno}]
    # The cost model's own price of the same four ops as one Adaptive Eager kernel (one
    # launch, VectorE work, one HBM round trip) against the four kernels the trace shows.
    cfg = torch_neuronx._state.config()
    fused, _, _ = cost_model.op_seconds(cfg.profile, cfg.lnc, "fused_pointwise", [(64, 4)],
                                        torch.float32, 64 * 4, 64 * 4)
    assert chain["saved_ns"] == pytest.approx(chain["modelled_ns"] - fused * 1e9, rel=0.01)
    assert cli.main(["explore", path]) == 0
    assert "fusion opportunities" in capsys.readouterr().out


def test_large_elementwise_chain_is_no_fusion_candidate(tmp_path):
    was = torch_neuronx.is_adaptive_eager_enabled()
    torch_neuronx.set_adaptive_eager(False)
    try:
        path = _capture_traced(tmp_path, _big_chain)
    finally:
        torch_neuronx.set_adaptive_eager(was)
    # 1M-element kernels are HBM-bound: fusing saves traffic, not launches; not reported here
    assert report(path)["fusion_opportunities"] == []


def _two_rank_reports(tmp_path, mode):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
    import _launch
    # _launch starts _workers.py; this test's ranks run their own small worker
    was, _launch.WORKERS = _launch.WORKERS, _launch.HERE.parent / "profiler" / "_comm_worker.py"
    try:
        out = _launch.run(mode, 2, timeout=200, args=(str(tmp_path),))
    finally:
        _launch.WORKERS = was
    assert all(code == 0 and "ok" in o for code, o in out), out
    return [report(str(tmp_path / f"rank{r}" / "trace_0")) for r in range(2)]


@pytest.mark.parametrize("mode", ["exposed", "overlapped"])
def test_report_splits_collective_into_exposed_and_overlapped(tmp_path, mode, capsys):
    from torch_neuronx.distributed import collective_seconds
    cfg = torch_neuronx._state.config()
    expect_ns = collective_seconds("all_reduce", 4 << 22, 2, 1, cfg.profile, cfg.lnc) * 1e9
    for r in _two_rank_reports(tmp_path, mode):
        (c,) = r["collectives"]
        assert c["name"] == "c10d::all_reduce"
        assert c["modelled_ns"] == pytest.approx(expect_ns, abs=1)
        assert c["exposed_ns"] + c["overlapped_ns"] == c["modelled_ns"] == r["communication_ns"]
        if mode == "exposed":  # nothing else runs: the whole collective is on the critical path
            assert r["communication_exposed_share"] == 1.0
        else:  # the side stream's 2048^3 matmul is longer than the all_reduce and covers it
            mm = {k["name"]: k for k in r["top_kernels"]}["mm"]
            assert mm["modelled_ns"] > c["modelled_ns"] and c["exposed_ns"] == 0
    assert cli.main(["explore", str(tmp_path / "rank0" / "trace_0")]) == 0
    text = capsys.readouterr().out
    assert ("bottleneck: exposed communication" in text) == (mode == "exposed")


def test_memory_events_match_allocator_and_plot(tmp_path, capsys):
    torch.neuron.synchronize()
    torch.neuron.reset_peak_memory_stats()
    before = torch.neuron.memory_allocated()
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True, experimental_config=cfg,
                                    on_trace_ready=handler.export_trace):
            a = torch.randn(1 << 18, device="neuron")  # 1 MiB
            b = a * 2
            del a
            c = torch.randn(1 << 19, device="neuron")  # 2 MiB
            torch.neuron.synchronize()
    finally:
        handler.close()
    path = str(tmp_path / "trace_0")
    m = report(path)["device_memory"][str(torch.neuron.current_device())]
    # the allocator's own counters, read after the fact
    assert m["final_allocated"] == torch.neuron.memory_allocated()
    assert m["peak_allocated"] == torch.neuron.max_memory_allocated()
    assert m["final_allocated"] - before == b.untyped_storage().nbytes() + c.untyped_storage().nbytes()
    assert m["final_reserved"] == torch.neuron.memory_reserved()
    assert cli.main(["explore", path, "--plots", str(tmp_path / "plots")]) == 0
    assert "MiB allocated" in capsys.readouterr().out
    assert os.path.getsize(str(tmp_path / "plots" / "memory.png")) > 1000
