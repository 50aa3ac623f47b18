"""The "neuron" backend end to end: models, training, options, errors, caching.

Every result is compared with the same computation in plain eager PyTorch on CPU.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_neuronx
from torch_neuronx.compile import NeuronCompileError

sys.path.insert(0, os.path.dirname(__file__))
from models import CNN, GPT  # noqa: E402

DEV = "neuron"


def _close(a, b, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), atol=atol, rtol=rtol)


def test_backend_is_registered():
    assert "neuron" in torch._dynamo.list_backends()
    from torch._dynamo.device_interface import get_interface_for_device
    assert get_interface_for_device("neuron").device_count() >= 1


def test_gpt_training_matches_cpu():
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, 64, (2, 16))
    tgt = torch.randint(0, 64, (2, 16))
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    dev_model = copy.deepcopy(model).to(DEV)
    opt = torch.optim.SGD(dev_model.parameters(), lr=0.1)
    torch.compiler.set_default_backend("neuron")
    try:
        dev_model.compile()
        torch_neuronx.compile.reset_modelled_graph_time()
        for _ in range(2):
            loss_ref = ref(idx, tgt)
            loss_ref.backward()
            loss = dev_model(idx.to(DEV), tgt.to(DEV))
            loss.backward()
            _close(loss, loss_ref)
            for p, pr in zip(dev_model.parameters(), ref.parameters()):
                _close(p.grad, pr.grad, atol=2e-4, rtol=2e-4)
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
    finally:
        torch.compiler.set_default_backend(None)
    g = torch_neuronx.compile.modelled_graph_time()
    assert g.runs == 4 and g.by_phase["forward"] > 0 and g.by_phase["backward"] > 0
    assert g.seconds > 0 and "compiled time" in str(g)


def test_cnn_inference_and_training_matches_cpu():
    torch.manual_seed(0)
    model = CNN()
    x = torch.randn(4, 3, 16, 16)
    y = torch.randint(0, 10, (4,))
    ref = copy.deepcopy(model)
    loss_ref = F.cross_entropy(ref(x), y)
    loss_ref.backward()
    dev_model = copy.deepcopy(model).to(DEV)
    cm = torch.compile(dev_model, backend="neuron")
    loss = F.cross_entropy(cm(x.to(DEV)), y.to(DEV))
    loss.backward()
    _close(loss, loss_ref)
    for p, pr in zip(dev_model.parameters(), ref.parameters()):
        _close(p.grad, pr.grad, atol=2e-4, rtol=2e-4)


def test_inductor_default_backend_on_neuron():
    def f(x, w):
        return F.layer_norm(F.gelu(x @ w), (w.shape[1],)).softmax(-1)
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    out = torch.compile(f)(x.to(DEV), w.to(DEV))      # backend="inductor"
    assert out.device.type == DEV
    _close(out, f(x, w))


def test_fused_kernels_add_to_modelled_time():
    def f(x):
        return torch.sigmoid(x * 2 + 1).sum(-1)
    x = torch.randn(64, 256)
    cf = torch.compile(f, backend="neuron")
    cf(x.to(DEV))
    torch_neuronx.reset_modelled_time()
    torch_neuronx.compile.reset_modelled_graph_time()
    out = cf(x.to(DEV))
    _close(out, f(x))
    g = torch_neuronx.compile.modelled_graph_time()
    assert g.runs == 1 and g.launches == 1            # one program
    # One HBM round trip: read x once, write the 64 sums.
    assert g.hbm_bytes == 64 * 256 * 4 + 64 * 4
    t = torch_neuronx.modelled_time()
    assert t.by_op["compiled_graph"] == pytest.approx(g.kernel_seconds)
    (label, rec), = g.by_graph.items()
    assert "test_backend.py" in label and rec.runs == 1 and rec.bound
    assert rec.busy["vector"] > 0 and rec.busy["scalar"] > 0 and rec.busy["dma"] > 0


def test_fullgraph_and_graph_break_fallback():
    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()   # the graph breaks here: two graphs, eager between
        return y.cos() + 1
    x = torch.randn(16)
    out = torch.compile(f, backend="neuron")(x.to(DEV))
    _close(out, f(x))
    torch._dynamo.reset()       # compiled frames are cached per code object
    with pytest.raises(Exception, match="graph_break|graph break"):
        torch.compile(f, backend="neuron", fullgraph=True)(x.to(DEV))

    def g(x):
        return (x.sin() * 2).relu()
    _close(torch.compile(g, backend="neuron", fullgraph=True)(x.to(DEV)), g(x))


def test_dynamic_shapes():
    def f(x):
        return (x * x.mean(-1, keepdim=True)).tanh()
    cf = torch.compile(f, backend="neuron", dynamic=True)
    for n in (3, 5, 9):
        x = torch.randn(n, 7)
        _close(cf(x.to(DEV)), f(x))
    torch._dynamo.reset()
    counts = []

    def count_backend(gm, ex):
        counts.append(1)
        return torch_neuronx.compile.neuron_backend(gm, ex)
    cf = torch.compile(f, backend=count_backend)     # automatic dynamic
    for n in (3, 5, 9, 12):
        x = torch.randn(n, 7)
        _close(cf(x.to(DEV)), f(x))
    assert len(counts) == 2                           # static, then one dynamic graph


def test_mode_warns_and_compiles_default():
    def f(x):
        return x.exp() - 1
    x = torch.randn(8)
    with pytest.warns(UserWarning, match="mode='default'"):
        out = torch.compile(f, backend="neuron", mode="max-autotune")(x.to(DEV))
    _close(out, f(x))


def test_custom_op_in_graph():
    @torch.library.custom_op("neuron_test::scaled_add", mutates_args=())
    def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
        return x + alpha * y

    @scaled_add.register_fake
    def _(x, y, alpha):
        return torch.empty_like(x)

    def f(x, y):
        return torch.ops.neuron_test.scaled_add(x.sin(), y, 0.5).relu()
    x, y = torch.randn(32), torch.randn(32)
    out = torch.compile(f, backend="neuron", fullgraph=True)(x.to(DEV), y.to(DEV))
    _close(out, f(x, y))


def test_autocast_inside_compiled_region():
    def f(x, w):
        with torch.autocast(device_type=DEV, dtype=torch.bfloat16):
            y = x @ w
        return y.float().relu()
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    out = torch.compile(f, backend="neuron", fullgraph=True)(x.to(DEV), w.to(DEV))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        ref = (x @ w)
    assert ref.dtype == torch.bfloat16
    _close(out, ref.float().relu(), atol=1e-2, rtol=1e-2)


def _break_lowering(monkeypatch, op):
    from torch._inductor import lowering

    def refuse(*args, **kwargs):
        raise NotImplementedError("no lowering on this device")
    monkeypatch.setitem(lowering.lowerings, op, refuse)


def test_uncompilable_op_names_op_and_line(monkeypatch):
    _break_lowering(monkeypatch, torch.ops.aten.atan2.default)

    def f(x, y):
        return torch.atan2(x, y) + 1   # the failing line

    x, y = torch.randn(8), torch.randn(8)
    monkeypatch.delenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", raising=False)
    with pytest.raises(Exception) as info:
        torch.compile(f, backend="neuron")(x.to(DEV), y.to(DEV))
    msg = str(info.value)
    assert "aten.atan2" in msg and "test_backend.py" in msg and "torch.atan2(x, y)" in msg
    assert isinstance(info.value.__cause__ or info.value, Exception)

    torch._dynamo.reset()
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "0")
    with pytest.warns(UserWarning, match="running this graph eagerly"):
        out = torch.compile(f, backend="neuron")(x.to(DEV), y.to(DEV))
    _close(out, f(x, y))


def test_sparse_input_is_a_clear_error():
    def f(x):
        return x * 2
    x = torch.randn(4, 4).to_sparse()
    with pytest.raises(Exception, match="sparse"):
        torch.compile(f, backend="neuron", fullgraph=True)(x.to(DEV))


def test_recompilation_storm_reports_guard(monkeypatch):
    from torch_neuronx.compile import passes
    monkeypatch.setattr(passes, "RECOMPILE_WARN_AFTER", 2)

    def f(x, k: int):
        return x * k
    cf = torch.compile(f, backend="neuron", dynamic=False)
    x = torch.randn(4).to(DEV)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(4):
            cf(x, k)
    msgs = [str(w.message) for w in caught if "recompiling" in str(w.message)]
    assert msgs and "guard that failed" in msgs[0] and "k" in msgs[0]


def test_compile_aten_graph_standalone():
    from torch_neuronx.compile import compile_aten_graph
    aten = torch.ops.aten
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    s = g.call_function(aten.add.Tensor, (a, b))
    m = g.call_function(aten.mul.Tensor, (s, s))
    r = g.call_function(aten.sum.dim_IntList, (m, [1]))
    g.output((m, r))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    fn = compile_aten_graph(gm, [x.to(DEV), y.to(DEV)])
    outs = fn(x.to(DEV), y.to(DEV))
    assert all(o.device.type == DEV for o in outs)
    _close(outs[0], (x + y) ** 2)
    _close(outs[1], ((x + y) ** 2).sum(1))


def test_cache_reuse_across_processes(tmp_path):
    script = textwrap.dedent("""
        import json, sys, torch
        from torch._dynamo.utils import counters
        def f(x, w):
            return torch.nn.functional.silu(x @ w).sum(-1) * 3
        x = torch.ones(8, 16, device="neuron"); w = torch.ones(16, 8, device="neuron") / 16
        out = torch.compile(f, backend="neuron")(x, w)
        print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                          "miss": counters["inductor"]["fxgraph_cache_miss"],
                          "val": out.cpu().tolist()}))
    """)
    env = dict(os.environ, TORCH_NEURONX_COMPILE_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        import json
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert runs[0]["miss"] >= 1 and runs[0]["hit"] == 0
    assert runs[1]["miss"] == 0 and runs[1]["hit"] >= 1     # second process compiles nothing
    ref = (F.silu(torch.ones(8, 16) @ (torch.ones(16, 8) / 16)).sum(-1) * 3).tolist()
    assert runs[1]["val"] == pytest.approx(ref)
    assert (tmp_path / "cache").is_dir()


def test_embedding_backward_bitwise_inductor_cpu_when_deterministic():
    # Inductor's scatter-add (atomic adds in a parallel loop) may order a row's additions
    # differently run to run; deterministic mode takes ATen's index_put_, and the graphs are
    # then Inductor-CPU's bit for bit (docs/compile.md).
    torch.manual_seed(0)
    emb = torch.nn.Embedding(500, 64)
    ids = torch.randint(0, 500, (8, 64))     # repeated tokens: rows added to more than once

    def grads(dev, backend):
        e = copy.deepcopy(emb).to(dev)
        h = torch.nn.Linear(64, 500, bias=False).to(dev)
        h.weight = e.weight         # tied, as GPT-2's wte and lm_head

        def f(x):
            return torch.nn.functional.cross_entropy(h(torch.tanh(e(x))).flatten(0, 1),
                                                     x.flatten())
        loss = torch.compile(f, backend=backend)(ids.to(dev))
        loss.backward()
        return loss.detach().cpu(), e.weight.grad.cpu()

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref_loss, ref_grad = grads("cpu", "inductor")
        torch._dynamo.reset()
        loss, grad = grads(DEV, "neuron")
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad)


def test_scatter_add_of_a_graph_compiled_on_the_device_is_cpus():
    # A CPU scalar in the graph (DeBERTa-v2's sqrt(tensor(...)) scale) compiles it on the neuron
    # device directly; its gather backward is a scatter-add, which for C++ code Inductor hands
    # to ATen's scatter_reduce_ on CPU. Inductor's own atomic-add loop indexed the transposed
    # tile wrongly here: gradients off by 0.06, then heap corruption.
    torch.manual_seed(0)
    x = torch.randn(8, 12, 16, requires_grad=True)
    s = torch.randn(8, 12, 12, requires_grad=True)
    idx = torch.randint(0, 16, (1, 12, 12))

    def f(s, x, idx):
        scale = torch.sqrt(torch.tensor(24.0)).to(s.dtype)
        p2c = torch.gather(x, -1, idx.squeeze(0).expand(8, 12, 12)).transpose(-1, -2)
        return (torch.softmax((s + p2c / scale).view(2, 4, 12, 12), -1) ** 2).sum()

    f(s, x, idx).backward()
    dx = x.detach().to(DEV).requires_grad_()
    ds = s.detach().to(DEV).requires_grad_()
    torch.compile(f, backend="neuron")(ds, dx, idx.to(DEV)).backward()
    torch.testing.assert_close(dx.grad.cpu(), x.grad)
    torch.testing.assert_close(ds.grad.cpu(), s.grad)
