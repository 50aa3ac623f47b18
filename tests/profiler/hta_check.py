"""Holistic Trace Analysis loads our trace (run by `make test-hta`; HTA pulls Jupyter, so it
is not in the default venv): the Kineto plugin's kernels, correlated to their launches, are
what HTA's device analyses read."""
import glob
import os

import torch
from hta.trace_analysis import TraceAnalysis

import torch_neuronx  # noqa: F401
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler


def test_hta_loads_trace_and_reads_kernels(tmp_path):
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    a = torch.randn(256, 256, device="neuron")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.PrivateUse1],
                                    experimental_config=cfg, on_trace_ready=handler.export_trace):
            for _ in range(3):
                (a @ a).relu().sum().item()
    finally:
        handler.close()
    assert glob.glob(os.path.join(str(tmp_path), "trace_0.json"))
    analyzer = TraceAnalysis(trace_dir=str(tmp_path))
    df = analyzer.t.get_trace(0)
    names = set(analyzer.t.symbol_table.sym_index)
    assert {"aten::mm", "mm", "relu", "neuronLaunchKernel"} <= names
    kernels = df[df.stream >= 0]
    assert len(kernels) >= 9
    # every kernel is correlated to its launch on the host
    launches = df[df.name == analyzer.t.symbol_table.sym_index["neuronLaunchKernel"]]
    assert set(kernels.correlation) <= set(launches.correlation)
    breakdown = analyzer.get_temporal_breakdown(visualize=False)
    assert breakdown["kernel_time(us)"].iloc[0] > 0
