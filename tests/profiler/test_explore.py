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


def test_report_names_fused_kernel_once_the_chain_is_learned(tmp_path):
    for _ in range(2):  # the first run teaches Adaptive Eager the chain
        path = _capture(tmp_path, _big_chain)
    names = {k["name"] for k in report(path)["top_kernels"]}
    assert "fused_pointwise" in names and "exp" not in names


def _capture_traced(tmp_path, fn):
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    try:
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
