import hashlib
import json
import os

import pyarrow.parquet as pq
import pytest
import torch

import torch_neuronx  # noqa: F401
from torch_neuronx import cost_model
from torch_neuronx.profiling import (PROFILE_SCHEMA_VERSION, SCHEMA, NeuronConfig, NeuronProfiler,
                                     ProfileMode, export_parquet)

ACT = [torch.profiler.ProfilerActivity.CPU]


def _work():
    a = torch.randn(64, 64, device="neuron")
    b = a @ a
    return (b.relu() + 1).sum().item()


def _profile(tmp_path, **cfg):
    config = NeuronConfig(modes=[ProfileMode.DEVICE], profile_output_dir=str(tmp_path), **cfg)
    handler = NeuronProfiler(config)
    cost_model.reset_modelled_time()
    try:
        with torch.profiler.profile(activities=ACT, with_stack=True, experimental_config=config,
                                    on_trace_ready=handler.export_trace):
            _work()
    finally:
        handler.close()
    return os.path.join(str(tmp_path), "trace_0")


def test_modelled_events_sum_to_cost_model(tmp_path):
    path = _profile(tmp_path)
    total = cost_model.modelled_time()
    ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet")).to_pandas()
    hw = ev[ev.source == "hardware"]
    assert set(hw.name) >= {"mm", "relu", "add", "sum"}
    by_op = hw.groupby("name").modelled_ns.sum()
    for op, sec in total.by_op.items():
        assert by_op[op] == pytest.approx(sec * 1e9, abs=len(hw))
    # Without the PrivateUse1 activity nothing ran under the Kineto plugin: no host times.
    assert (hw.duration_ns == -1).all() and (hw.correlation_id == -1).all()
    # Intervals of one queue are back to back: each starts where the previous ended.
    for _, q in hw.groupby(["device", "queue"]):
        ends = (q.modelled_start_ns + q.modelled_ns).to_numpy()
        assert (q.modelled_start_ns.to_numpy()[1:] == ends[:-1]).all()
    with open(os.path.join(str(tmp_path), "trace_0.json")) as f:
        events = json.load(f)["traceEvents"]
    lanes = [e for e in events if e.get("cat") == "modelled_kernel"]
    assert sorted(e["dur"] for e in lanes) == pytest.approx(sorted(hw.modelled_ns / 1e3))
    assert all(e["args"]["queue"] == e["tid"] for e in lanes)
    assert not [e for e in events if e.get("cat") == "kernel"]


def test_source_line_points_at_user_file(tmp_path):
    path = _profile(tmp_path)
    ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet")).to_pandas()
    mm = ev[(ev.source == "framework") & (ev.name == "aten::mm")]
    assert len(mm) >= 1
    assert os.path.basename(mm.source_file.iloc[0]) == os.path.basename(__file__)
    src = open(__file__).read().splitlines()
    # torch's stack frames carry the function's first line, so the row names the user's function.
    assert src[mm.source_line.iloc[0] - 1] == "def _work():"


def test_capture_enabled_for_nc_filters_devices(tmp_path):
    path = _profile(tmp_path, capture_enabled_for_nc="1-3")
    ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet")).to_pandas()
    assert (ev.source == "hardware").sum() == 0
    with pytest.raises(ValueError, match="capture_enabled_for_nc"):
        NeuronConfig(capture_enabled_for_nc="3-1")
    with pytest.raises(TypeError, match="ProfileMode"):
        NeuronConfig(modes=["DEVICE"])
    # the device stays usable after the bad configs
    assert torch.ones(2, device="neuron").sum().item() == 2.0


def test_parquet_schema_is_stable(tmp_path):
    path = str(tmp_path / "p")
    export_parquet(path, device_events=[(0, 0, "add", "op", 1e-6, 1)])
    digest = hashlib.sha256(repr([(t, [(c, str(ty)) for c, ty, _ in f]) for t, f in SCHEMA.items()])
                            .encode()).hexdigest()[:16]
    # Changing a column changes the digest: bump PROFILE_SCHEMA_VERSION with it.
    assert (PROFILE_SCHEMA_VERSION, digest) == ("1.7.0", "dc1cb90d5b231def")
    meta = dict(pq.read_table(os.path.join(path, "Metadata.parquet")).to_pandas().values)
    assert meta["profile_schema_version"] == "1.7.0"
    fields = pq.read_table(os.path.join(path, "SchemaFields.parquet")).to_pandas()
    ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet"))
    assert list(fields[fields.table == "SystemProfileEvents"].column) == ev.schema.names


def test_env_var_route_profiles_unchanged_script(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "train.py"
    script.write_text("import torch\nimport torch_neuronx\n"
                      "a = torch.randn(16, 16, device='neuron')\nprint((a @ a).sum().item())\n")
    env = dict(os.environ, NEURON_RT_INSPECT_ENABLE="1",
               NEURON_RT_INSPECT_OUTPUT_DIR=str(tmp_path / "out"))
    subprocess.run([sys.executable, str(script)], env=env, check=True, capture_output=True, timeout=120)
    ev = pq.read_table(str(tmp_path / "out" / "trace_0" / "SystemProfileEvents.parquet")).to_pandas()
    hw = ev[ev.source == "hardware"]
    assert "mm" in set(hw.name)
    # device events traced by the Kineto plugin (timed, correlated), not cost-model intervals
    meta = dict(pq.read_table(str(tmp_path / "out" / "trace_0" / "Metadata.parquet")).to_pandas().values)
    assert meta["hardware_source"] == "kineto"
    mm = hw[hw.name == "mm"].iloc[0]
    assert mm.duration_ns >= 0 and mm.modelled_ns > 0
    launcher = ev[(ev.source == "framework") & (ev.correlation_id == mm.correlation_id)]
    assert launcher.name.tolist() == ["aten::mm"]


def test_compiled_graph_kernels_get_lanes(tmp_path):
    def f(x):
        return (x * 2).relu().sum(0)
    cf = torch.compile(f, backend="neuron")
    x = torch.randn(64, 64, device="neuron")
    cf(x)  # compile outside the trace
    config = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(config)
    cost_model.reset_modelled_time()
    try:
        with torch.profiler.profile(activities=ACT, experimental_config=config,
                                    on_trace_ready=handler.export_trace):
            out = cf(x)
            torch.neuron.synchronize()
    finally:
        handler.close()
    torch.testing.assert_close(out.cpu(), f(x.cpu()))
    total = cost_model.modelled_time()
    ev = pq.read_table(os.path.join(str(tmp_path), "trace_0", "SystemProfileEvents.parquet")).to_pandas()
    fused = ev[ev.engine == "fused"]
    assert len(fused) >= 1
    assert fused.modelled_ns.sum() == pytest.approx(total.by_engine["fused"] * 1e9, abs=len(fused))
