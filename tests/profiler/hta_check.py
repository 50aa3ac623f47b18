"""Holistic Trace Analysis loads our trace (run by `make test-hta`; HTA pulls Jupyter, so it
is not in the default venv)."""
import glob
import os

import torch
from hta.trace_analysis import TraceAnalysis

import torch_neuronx  # noqa: F401
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler


def test_hta_loads_trace(tmp_path):
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=cfg, on_trace_ready=handler.export_trace):
            a = torch.randn(32, 32, device="neuron")
            (a @ a).relu().sum().item()
    finally:
        handler.close()
    assert glob.glob(os.path.join(str(tmp_path), "trace_0.json"))
    analyzer = TraceAnalysis(trace_dir=str(tmp_path))
    df = analyzer.t.get_trace(0)
    names = set(analyzer.t.symbol_table.sym_index)
    assert {"mm", "relu"} <= names
    assert len(df) > 0
