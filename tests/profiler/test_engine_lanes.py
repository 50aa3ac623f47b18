import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import torch_neuronx
from nki.examples.matmul import matmul_basic
from nki.simulator import runner
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler, _lanes
from torch_neuronx.profiling.explore import report

_ENGINE_OF = {"TensorE": "tensor", "VectorE": "vector", "ScalarE": "scalar", "GpSimd": "gpsimd"}


def _lane_of(label: str) -> str:
    """The simulator's lane of a profiler lane label ("DMA queue 3" -> "dma3")."""
    if label in _ENGINE_OF:
        return _ENGINE_OF[label]
    assert label.startswith("DMA queue "), label
    return "dma" + label[len("DMA queue "):]


def _operands(device):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(128, 128, generator=g).to(device),
            torch.randn(128, 512, generator=g).to(device))


def _profile(tmp_path, fn, activities):
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    try:
        with torch.profiler.profile(activities=activities, experimental_config=cfg,
                                    on_trace_ready=handler.export_trace):
            fn()
            torch.neuron.synchronize()
    finally:
        handler.close()
    with open(os.path.join(str(tmp_path), "trace_0.json")) as f:
        return json.load(f)["traceEvents"]


def _reference():
    """The simulator's own timeline of the kernel on NumPy inputs (no torch, no profiler)."""
    a, b = (t.numpy() for t in _operands("cpu"))
    _, sim = runner.run(matmul_basic.func, (a, b), {}, timing=True)
    return sim.timelines[0]


@pytest.mark.parametrize("activities", [
    [torch.profiler.ProfilerActivity.CPU],
    [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.PrivateUse1]],
    ids=["cpu", "privateuse1"])
def test_nki_kernel_lanes_nest_in_its_interval_and_match_simulator(tmp_path, activities):
    a, b = _operands("neuron")
    events = _profile(tmp_path, lambda: matmul_basic(a, b), activities)
    kernels = [e for e in events if e.get("cat") == "modelled_kernel"
               and e["name"] == "nki:matmul_basic"]
    assert len(kernels) == 1
    k = kernels[0]
    inst = [e for e in events if e.get("cat") == "modelled_instruction"]
    assert inst and all(e["args"]["kernel"] == "nki:matmul_basic" for e in inst)
    eps = 1e-3  # microsecond float rounding
    for e in inst:
        assert e["pid"] == k["pid"]
        assert k["ts"] - eps <= e["ts"] and e["ts"] + e["dur"] <= k["ts"] + k["dur"] + eps
    names = {e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == k["pid"]}
    lanes = {e["args"]["engine"] for e in inst}
    assert lanes <= names
    assert "TensorE" in lanes and any(n.startswith("DMA queue ") for n in lanes)
    tl = _reference()
    for lane, eng in _ENGINE_OF.items():
        got = sum(e["dur"] for e in inst if e["args"]["engine"] == lane) * 1e3
        assert got == pytest.approx(tl.busy[eng], rel=1e-6, abs=1e-3)
    # A DMA spread over queues holds each of them for its interval: the queues' busy time is
    # the timeline's DMA busy time over all its queues, and no queue runs two DMAs at once.
    dma = [e for e in inst if e["args"]["engine"].startswith("DMA queue ")]
    assert sum(e["dur"] for e in dma) * 1e3 == pytest.approx(tl.busy["dma"] * len(tl.queues), rel=1e-6)
    for q in {e["args"]["engine"] for e in dma}:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in dma if e["args"]["engine"] == q)
        assert all(a[1] <= b[0] + eps for a, b in zip(spans, spans[1:]))
    assert len({e["args"]["engine"] for e in dma}) > 1
    # Same instructions (ISA names) on the same lanes at the same offsets from the kernel start.
    want = sorted((q, name, round(s, 1), round(d, 1)) for name, lane, s, d, args in tl.events
                  for q in ([f"dma{i}" for i in args["queues"]] if args else [lane]))
    got = sorted((_lane_of(e["args"]["engine"]), e["name"],
                  round((e["ts"] - k["ts"]) * 1e3, 1), round(e["dur"] * 1e3, 1)) for e in inst)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    np.testing.assert_allclose([g[2:] for g in got], [w[2:] for w in want], atol=0.5)
    _check_parquet(os.path.join(str(tmp_path), "trace_0"), tl, k)


def _check_parquet(path, tl, k):
    ins = pq.read_table(os.path.join(path, "DeviceInstructions.parquet")).to_pandas()
    ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet")).to_pandas()
    hw = ev[(ev.source == "hardware") & (ev.name == "nki:matmul_basic")]
    assert len(hw) == 1 and len(ins) == sum(len(a["queues"]) if a else 1 for *_, a in tl.events)
    assert set(ins.correlation_id) == {int(hw.correlation_id.iloc[0])}
    assert set(ins.kernel) == {"nki:matmul_basic"}
    start, dur = int(hw.modelled_start_ns.iloc[0]), int(hw.modelled_ns.iloc[0])
    assert (ins.start_ns >= start - 1).all() and (ins.start_ns + ins.duration_ns <= start + dur + 1).all()
    assert ins[ins.engine == "TensorE"].duration_ns.sum() == pytest.approx(tl.busy["tensor"], abs=len(ins))
    util = report(path)["engine_utilisation"]["nki:matmul_basic"]
    assert util["TensorE"] == pytest.approx(tl.busy["tensor"] / dur, rel=1e-2)
    assert util["VectorE"] == pytest.approx(tl.busy["vector"] / dur, rel=1e-2)


def test_no_instruction_rows_without_profiler():
    assert _lanes._collectors == []
    a, b = _operands("neuron")
    out = matmul_basic(a, b)
    torch.neuron.synchronize()
    assert _lanes._collectors == []
    ref = a.cpu().T @ b.cpu()
    np.testing.assert_allclose(out.cpu().numpy(), ref.numpy(), rtol=1e-4, atol=1e-4)


def test_instruction_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(_lanes, "MAX_INSTRUCTIONS_PER_KERNEL", 5)
    a, b = _operands("neuron")
    events = _profile(tmp_path, lambda: matmul_basic(a, b), [torch.profiler.ProfilerActivity.CPU])
    # The first 5 instructions in issue order, a DMA on each of its queues.
    first = _reference().events[:5]
    want = sorted((name, q) for name, lane, _, _, args in first
                  for q in ([f"dma{i}" for i in args["queues"]] if args else [lane]))
    got = sorted((e["name"], _lane_of(e["args"]["engine"])) for e in events
                 if e.get("cat") == "modelled_instruction")
    assert got == want and len(want) > 5


def _elementwise(x, w):  # elementwise + reduction only: no extern call inside the graph
    return (torch.relu(x * w).exp() * 2).sum(dim=1)


def _mm(x, w):
    return torch.relu(x @ w) * 2


def _addmm(x, w):
    return torch.relu(torch.addmm(w[0], x, w)) * 2


def _sdpa(x, w):
    q = x.view(2, 4, 16, 128)
    return torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q).exp()


@pytest.mark.parametrize("f", [_elementwise, _mm, _addmm, _sdpa], ids=lambda f: f.__name__[1:])
def test_compiled_graph_lanes_nest_and_match_program_busy(tmp_path, f):
    from torch_neuronx.compile import cost

    g = torch.compile(f, backend="neuron")
    x, w = _operands("neuron")
    w = w[:, :128].contiguous() * 0.1
    g(x, w)  # compile outside the profile
    torch.neuron.synchronize()
    dev = x.device.index or 0
    cost.modelled_graph_time(dev, reset=True)
    events = _profile(tmp_path, lambda: g(x, w), [torch.profiler.ProfilerActivity.CPU])
    gt = cost.modelled_graph_time(dev, reset=True)  # (later runs add to a new record)
    busy = gt.by_engine
    ref = f(x.cpu(), w.cpu())
    torch.testing.assert_close(g(x, w).cpu(), ref, rtol=1e-4, atol=1e-4)
    graphs = [e for e in events if e.get("cat") == "modelled_kernel" and e["name"] == "compiled_graph"]
    assert len(graphs) == 1 and gt.runs == 1
    k = graphs[0]
    programs = [e for e in events if e.get("cat") == "modelled_program"]
    if gt.extern_seconds:
        # The graph's event holds the program's time beyond its extern calls (which are eager
        # kernels of their own); the program interval, from the same start, holds it all.
        (prog,) = programs
        assert prog["ts"] == pytest.approx(k["ts"]) and prog["pid"] == k["pid"]
        assert prog["dur"] == pytest.approx(gt.seconds * 1e6, rel=1e-6)
        rest = max(0.0, gt.seconds - gt.extern_seconds)  # 0 for SDPA: its eager charge is more
        assert k["dur"] == pytest.approx(rest * 1e6, abs=1e-3)
        assert busy["tensor"] > 0
        k = prog
    else:
        assert not programs
    inst = [e for e in events if e.get("cat") == "modelled_instruction"]
    assert inst and all(e["args"]["kernel"] == "compiled_graph" for e in inst)
    for e in inst:
        assert k["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= k["ts"] + k["dur"] + 1e-3
    for lane, eng in _ENGINE_OF.items():
        got = sum(e["dur"] for e in inst if e["args"]["engine"] == lane) * 1e-6
        assert got == pytest.approx(busy[eng], rel=1e-6, abs=1e-12)
    assert sum(busy[e] for e in _ENGINE_OF.values()) > 0
    ins = pq.read_table(os.path.join(str(tmp_path), "trace_0", "DeviceInstructions.parquet")).to_pandas()
    assert set(ins.program_ns) == {round(gt.seconds * 1e9)}
    util = report(os.path.join(str(tmp_path), "trace_0"))["engine_utilisation"]["compiled_graph"]
    # (DeviceInstructions durations are whole ns: up to 0.5 ns off per row)
    assert util.get("TensorE", 0.0) == pytest.approx(busy["tensor"] / gt.seconds,
                                                     abs=0.5 * len(ins) / (gt.seconds * 1e9))


def _isa_lines(func) -> dict:
    """{ISA instruction: {lines of the kernel's source that issue it}}, read from the source."""
    import inspect
    lines, first = inspect.getsourcelines(func)
    out: dict = {}
    for i, text in enumerate(lines):
        for isa in ("dma_copy", "nc_matmul", "tensor_copy"):
            if f"nisa.{isa}(" in text:
                out.setdefault(isa, set()).add(first + i)
    return out


def test_nki_instructions_carry_their_kernel_source_line(tmp_path):
    from nki.simulator import context
    a, b = _operands("neuron")
    events = _profile(tmp_path, lambda: matmul_basic(a, b), [torch.profiler.ProfilerActivity.CPU])
    assert context.record_source is False          # off again once the profiler closed
    inst = [e for e in events if e.get("cat") == "modelled_instruction"]
    want = _isa_lines(matmul_basic.func)
    file = os.path.realpath(matmul_basic.func.__code__.co_filename)
    assert inst
    for e in inst:
        f, line = e["args"]["source"].rsplit(":", 1)
        assert os.path.realpath(f) == file and int(line) in want[e["name"]]
    ins = pq.read_table(os.path.join(str(tmp_path), "trace_0", "DeviceInstructions.parquet")).to_pandas()
    assert len(ins) == len(inst)
    assert {os.path.realpath(f) for f in ins.source_file} == {file}
    for isa, g in ins.groupby("name"):
        assert set(g.source_line) <= want[isa]
    assert set(ins[ins.name == "dma_copy"].source_line) == want["dma_copy"]  # loads and store
    # The query of docs/profiler.md: modelled engine time per kernel source line.
    per_line = ins.groupby(["source_file", "source_line"]).duration_ns.sum()
    assert per_line.sum() == ins.duration_ns.sum() and len(per_line) == len(set().union(*want.values()))
    # explore's ranking of kernel lines: the costliest line is the one issuing the most
    # engine time per the simulator's own timeline, recounted here by ISA name.
    tl = _reference()
    by_isa: dict = {}
    for name, lane, _, dur, args in tl.events:
        by_isa[name] = by_isa.get(name, 0.0) + dur * (len(args["queues"]) if args else 1)
    lines = report(os.path.join(str(tmp_path), "trace_0"))["top_kernel_lines"]
    assert lines[0]["kernel"] == "nki:matmul_basic"
    assert sum(x["engine_ns"] for x in lines) == pytest.approx(sum(by_isa.values()), abs=len(ins))
    at = {x["line"]: x["engine_ns"] for x in lines}
    for isa in ("nc_matmul", "tensor_copy"):  # each issued from one line of the kernel
        (line,) = want[isa]
        assert at[line] == pytest.approx(by_isa[isa], abs=len(ins))
    assert [x["engine_ns"] for x in lines] == sorted(at.values(), reverse=True)


def test_no_source_lines_recorded_without_profiler():
    a, b = (t.numpy() for t in _operands("cpu"))
    _, sim = runner.run(matmul_basic.func, (a, b), {}, timing=True)
    events = sim.timelines[0].events
    assert events and not any(args and "source_file" in args for *_, args in events)
