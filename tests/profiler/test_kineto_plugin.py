"""The Kineto PrivateUse1 plugin (csrc/profiler): device kernels in torch.profiler, linked to
the op (and Python line) that launched them, device time in key_averages, device memory
events, and modelled Trainium time that adds up to the cost model's."""
import json
import os

import pyarrow.parquet as pq
import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

import torch_neuronx
from torch_neuronx import cost_model
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler, kernel_metadata

ACT = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
HERE = os.path.basename(__file__)


def _profile(fn, **kw):
    cost_model.reset_modelled_time()
    with torch.profiler.profile(activities=ACT, with_stack=True,
                                experimental_config=NeuronConfig(), **kw) as prof:
        fn()
        torch.neuron.synchronize()
    return prof


def _kernels(prof):
    ks = [e for e in prof.events() if e.device_type == DeviceType.PrivateUse1]
    meta = kernel_metadata(prof)
    for k in ks:
        k.meta = meta[k.id]
    return ks


def _meta(e):
    return e.meta


def _launcher(prof, k):
    ops = {e.id: e for e in prof.events() if e.device_type == DeviceType.CPU}
    # torch drops an op that is the only child of a same-named op (its parent, id just below)
    c = k.linked_correlation_id
    while c not in ops and c > k.linked_correlation_id - 8:
        c -= 1
    return ops[c]


def _user_file(e):
    frames = [f for f in e.stack if ".py(" in f and "/torch/" not in f
              and not f.startswith("torch/") and "torch_neuronx" not in f]
    return os.path.basename(frames[0].split("(")[0]) if frames else None


def _matmul():
    a = torch.randn(256, 256, device="neuron")
    return (a @ a).relu()


def test_eager_kernels_linked_to_op_and_source_line():
    prof = _profile(_matmul)
    ks = _kernels(prof)
    mm = [k for k in ks if k.name == "mm"]
    assert len(mm) == 1 and mm[0].time_range.elapsed_us() > 0
    op = _launcher(prof, mm[0])
    assert op.name == "aten::mm"
    assert _user_file(op) == HERE
    relu = [k for k in ks if k.name == "relu"]
    assert len(relu) == 1 and _launcher(prof, relu[0]).name == "aten::relu"
    meta = _meta(mm[0])
    assert meta["engine"] == "tensor" and meta["modelled_ns"] > 0
    assert meta["stream"] == 0 and meta["correlation"] > 0


def test_key_averages_device_time_is_the_sum_of_kernels():
    prof = _profile(_matmul)
    kernel_us = sum(k.time_range.elapsed_us() for k in _kernels(prof) if k.name == "mm")
    rows = {r.key: r for r in prof.key_averages()}
    assert rows["aten::mm"].device_time_total == pytest.approx(kernel_us)
    assert rows["aten::mm"].device_time_total > 0
    # the matmul op above mm sees its child's device time too
    assert rows["aten::matmul"].device_time_total == pytest.approx(kernel_us)
    assert rows["mm"].self_device_time_total == pytest.approx(kernel_us)
    assert "neuronLaunchKernel" in rows
    assert "Self NEURON" in prof.key_averages().table(sort_by="device_time_total")


def test_modelled_time_of_kernels_sums_to_cost_model():
    def work():
        a = torch.randn(128, 64, device="neuron")
        b = a.to("cpu")  # a copy to the host: a synchronous kernel
        c = torch.ones(64, device="neuron")  # host-to-device fill
        return (a * 2 + c).sum().item(), b
    prof = _profile(work)
    total = cost_model.modelled_time()
    ks = _kernels(prof)
    modelled = sum(_meta(k)["modelled_ns"] for k in ks)
    assert modelled == pytest.approx(sum(total.by_op.values()) * 1e9, abs=len(ks))
    by_name = {}
    for k in ks:
        by_name[k.name] = by_name.get(k.name, 0) + _meta(k)["modelled_ns"]
    for op, sec in total.by_op.items():
        assert by_name[op] == pytest.approx(sec * 1e9, abs=len(ks)), op


def test_fused_kernel_appears_once_learned():
    def chain():
        x = torch.randn(1 << 16, device="neuron")
        return (x * 2).exp().sqrt().sum().item()
    chain()  # Adaptive Eager learns the chain on its first run
    prof = _profile(chain)
    fused = [k for k in _kernels(prof) if k.name.startswith("fused_")]
    assert fused, sorted({k.name for k in _kernels(prof)})
    assert all(k.linked_correlation_id > 0 for k in fused)
    assert all(_launcher(prof, k).name.startswith("aten::") for k in fused)


def test_compiled_graph_kernels_and_modelled_time():
    def f(x):
        return (x * 2).relu().sum(0)
    cf = torch.compile(f, backend="neuron")
    x = torch.randn(64, 64, device="neuron")
    cf(x)  # compile outside the trace
    prof = _profile(lambda: cf(x))
    total = cost_model.modelled_time()
    ks = _kernels(prof)
    graph = [k for k in ks if k.name == "compiled_graph"]
    assert len(graph) == 1
    assert _meta(graph[0])["modelled_ns"] == pytest.approx(total.by_op["compiled_graph"] * 1e9, abs=1)
    assert [k for k in ks if _meta(k)["launch"] == "graph"], sorted({k.name for k in ks})


def test_nki_kernel_event_linked_to_its_custom_op():
    import nki
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def add_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        x = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=a)
        y = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=y, src=b)
        z = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=z, data1=x, data2=y, op=nl.add)
        nisa.dma_copy(dst=out, src=z)
        return out

    op = torch_neuronx.nki_op("kineto_test::add", add_kernel, mutates_args=())
    a = torch.randn(128, 256, device="neuron")
    op(a, a)  # compile/trace outside the profile
    prof = _profile(lambda: op(a, a))
    nki_k = [k for k in _kernels(prof) if _meta(k)["engine"] == "nki"]
    assert len(nki_k) == 1 and nki_k[0].name.startswith("nki:")
    assert _meta(nki_k[0])["modelled_ns"] > 0
    launcher = _launcher(prof, nki_k[0])
    assert launcher.name == "kineto_test::add"
    assert _user_file(launcher) == HERE


def test_device_memory_events():
    def alloc():
        x = torch.empty(1 << 20, device="neuron")  # 4 MiB
        del x
    prof = _profile(alloc, profile_memory=True)
    rows = [e for e in prof.events() if e.name == "aten::empty"]
    assert rows and rows[0].device_memory_usage == 4 << 20
    assert rows[0].cpu_memory_usage == 0
    mem = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
           and e.device_type() == DeviceType.PrivateUse1]
    assert sorted(e.nbytes() for e in mem) == [-(4 << 20), 4 << 20]


def test_chrome_trace_kernels_have_stream_and_correlation(tmp_path):
    prof = _profile(_matmul)
    path = str(tmp_path / "t.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("name") == "neuronLaunchKernel" and e.get("ph") == "X"}
    assert {"mm", "relu"} <= {k["name"] for k in kernels}
    for k in kernels:
        assert k["args"]["stream"] == k["tid"]
        assert k["args"]["correlation"] in runtime
        assert k["args"]["External id"] == runtime[k["args"]["correlation"]]["args"]["External id"]
    ops = {e["args"]["External id"]: e["name"] for e in events
           if e.get("cat") == "cpu_op"}
    assert ops[[k for k in kernels if k["name"] == "mm"][0]["args"]["External id"]] == "aten::mm"


def test_cpu_only_profile_records_no_device_events():
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        _matmul().sum().item()
    assert not _kernels(prof)
    assert not [e for e in prof.events() if e.name == "neuronLaunchKernel"]


def _costly():
    a = torch.randn(512, 512, device="neuron")
    for _ in range(3):
        a = a @ a
    return a


def _cheap():
    return torch.ones(8, device="neuron") + 1


def test_parquet_answers_costliest_source_line_in_one_query(tmp_path):
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    try:
        with torch.profiler.profile(activities=ACT, with_stack=True, experimental_config=cfg,
                                    on_trace_ready=handler.export_trace):
            _cheap()
            _costly()
            torch.neuron.synchronize()
    finally:
        handler.close()
    import pandas as pd
    ev = pd.read_parquet(os.path.join(str(tmp_path), "trace_0", "SystemProfileEvents.parquet"))
    # The documented recipe (docs/profiler.md), verbatim:
    top = (ev[ev.source == "hardware"].groupby(["source_file", "source_line"])
           .modelled_ns.sum().sort_values(ascending=False))
    (file, line), ns = next(iter(top.items()))
    assert os.path.basename(file) == HERE
    src = open(__file__).read().splitlines()
    assert "_costly" in src[line - 1] or "a @ a" in src[line - 1], src[line - 1]
    hw = ev[ev.source == "hardware"]
    assert (hw.correlation_id > 0).all()
    assert (hw.duration_ns >= 0).all()
    meta = dict(pd.read_parquet(os.path.join(str(tmp_path), "trace_0", "Metadata.parquet")).values)
    assert meta["hardware_source"] == "kineto"


def test_collective_appears_as_device_event(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("neuron", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        t = torch.ones(1024, device="neuron")
        dist.all_reduce(t)
        prof = _profile(lambda: dist.all_reduce(t))
    finally:
        dist.destroy_process_group()
    coll = [k for k in _kernels(prof) if _meta(k)["engine"] == "collective"]
    assert [k.name for k in coll] == ["c10d::all_reduce"]
    assert _meta(coll[0])["launch"] == "python"
    torch.testing.assert_close(t.cpu(), torch.ones(1024))


def test_schedule_gives_each_cycle_its_own_kernels():
    traces = []
    a = torch.randn(64, 64, device="neuron")
    sched = torch.profiler.schedule(wait=1, warmup=0, active=1, repeat=2)
    with torch.profiler.profile(activities=ACT, schedule=sched,
                                on_trace_ready=lambda p: traces.append(
                                    sorted(k.name for k in _kernels(p)))) as prof:
        for i in range(4):
            (a @ a if i % 2 else a + 1).sum().item()
            prof.step()
    # steps 1 and 3 are active: each trace holds its own step's matmul, nothing of the others
    assert len(traces) == 2
    for names in traces:
        assert names.count("mm") == 1 and "add" not in names
