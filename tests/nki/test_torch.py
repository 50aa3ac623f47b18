"""NKI kernels on torch tensors (CPU and the neuron device) and as custom ops (nki_op):
eager, autograd, torch.compile. References are CPU PyTorch."""
import itertools

import pytest
import torch

import nki
import nki.isa as nisa
import nki.language as nl
import torch_neuronx
from nki.examples.matmul import matmul_basic
from torch_neuronx import nki_op

_names = itertools.count()


def _name(base):
    # Custom-op names are process-global; each test registers fresh ones.
    return f"nki_test::{base}_{next(_names)}"


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


@nki.jit
def mul_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.multiply(nl.load(a), nl.load(b)))
    return out


@nki.jit
def scale_inplace_kernel(x: torch.Tensor, s: float) -> None:
    t = nl.load(x)
    nl.store(x, nl.multiply(t, s))


@nki.jit
def softmax_kernel(x: torch.Tensor) -> torch.Tensor:
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.softmax(nl.load(x), axis=-1))
    return out


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jit_kernel_on_neuron_tensors(dtype):
    a, b = _rand(128, 512, dtype=dtype), _rand(128, 512, dtype=dtype, seed=1)
    r = add_kernel(a.to("neuron"), b.to("neuron"))
    assert r.device.type == "neuron" and r.dtype == dtype and r.shape == a.shape
    torch.testing.assert_close(r.cpu(), a + b, rtol=0, atol=0)


def test_jit_kernel_on_cpu_tensors_returns_cpu():
    a, b = _rand(64, 256), _rand(64, 256, seed=1)
    r = add_kernel(a, b)
    assert r.device.type == "cpu"
    torch.testing.assert_close(r, a + b, rtol=0, atol=0)


def test_neuron_output_is_device_memory_the_kernel_wrote():
    # A float32 output is allocated on the device up front; the result is that tensor.
    a = _rand(128, 64).to("neuron")
    before = torch.neuron.memory_allocated()
    r = add_kernel(a, a)
    assert torch.neuron.memory_allocated() - before == r.numel() * 4
    torch.testing.assert_close(r.cpu(), a.cpu() * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_into_neuron_input(dtype):
    x = _rand(128, 32, dtype=dtype)
    xd = x.to("neuron")
    v = xd._version
    assert scale_inplace_kernel(xd, 3.0) is None
    torch.testing.assert_close(xd.cpu(), (x.float() * 3.0).to(dtype), rtol=0, atol=0)
    assert xd._version > v, "an in-place kernel write bumps the tensor version like an in-place op"


def test_kernel_reads_non_contiguous_neuron_view():
    base = _rand(256, 64)
    view = base.to("neuron")[::2]               # 128 rows, stride 2
    r = add_kernel(view, view)
    torch.testing.assert_close(r.cpu(), base[::2] * 2)


def test_mixed_devices_raise_like_cuda():
    with pytest.raises(RuntimeError, match="same device"):
        add_kernel(_rand(8, 8).to("neuron"), _rand(8, 8))


def test_modelled_time_includes_kernel_latency():
    a = _rand(128, 512).to("neuron")
    torch_neuronx.reset_modelled_time("neuron")
    add_kernel(a, a)
    t = torch_neuronx.modelled_time("neuron")
    lat = nki.benchmark(add_kernel)(a.cpu(), a.cpu()).latency_ns * 1e-9
    assert t.by_op["nki:add_kernel"] == pytest.approx(lat)
    assert t.seconds >= lat > 0


def test_nki_op_eager_on_neuron_and_cpu():
    op = nki_op(_name("add"), add_kernel, mutates_args=())
    a, b = _rand(128, 256), _rand(128, 256, seed=1)
    torch.testing.assert_close(op(a, b), a + b)
    r = op(a.to("neuron"), b.to("neuron"))
    assert r.device.type == "neuron"
    torch.testing.assert_close(r.cpu(), a + b)


def test_nki_op_with_explicit_schema_matmul():
    op = nki_op(_name("matmul"), matmul_basic, mutates_args=(), schema="(Tensor lhsT, Tensor rhs) -> Tensor")
    lhsT, rhs = _rand(256, 128), _rand(256, 512, seed=1)
    r = op(lhsT.to("neuron"), rhs.to("neuron"))
    torch.testing.assert_close(r.cpu(), lhsT.T @ rhs, rtol=1e-4, atol=1e-3)


def test_nki_op_needs_annotations_or_schema():
    with pytest.raises(ValueError, match="type annotations"):
        nki_op(_name("bad"), matmul_basic, mutates_args=())


def test_nki_op_mutates_args():
    op = nki_op(_name("scale_"), scale_inplace_kernel, mutates_args=("x",))
    x = _rand(128, 64)
    xd = x.to("neuron")
    assert op(xd, 0.5) is None
    torch.testing.assert_close(xd.cpu(), x * 0.5)

    def f(t):
        y = t + 1
        op(y, 2.0)
        return y * 1
    torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(x.clone()), (x + 1) * 2)


def test_nki_op_python_function_calling_kernels():
    # The decorated function may be plain Python that calls NKI kernels on its tensors.
    @nki_op(_name("fma"), mutates_args=())
    def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return add_kernel(mul_kernel(a, b), c)

    @fma.register_fake
    def _(a, b, c):
        return torch.empty_like(a)

    a, b, c = (_rand(128, 128, seed=s) for s in range(3))
    torch.testing.assert_close(fma(a.to("neuron"), b.to("neuron"), c.to("neuron")).cpu(), a * b + c)


def _mul_op_with_autograd():
    op = nki_op(_name("mul"), mul_kernel, mutates_args=())

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return op(grad, b), op(grad, a)
    op.register_autograd(backward, setup_context=setup_context)
    return op


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_nki_op_register_autograd(device):
    op = _mul_op_with_autograd()
    a, b = _rand(128, 64), _rand(128, 64, seed=1)
    ad, bd = (t.to(device).requires_grad_() for t in (a, b))
    (op(ad, bd) * torch.arange(64.0, device=device)).sum().backward()
    ar, br = (t.detach().clone().requires_grad_() for t in (a, b))
    (ar * br * torch.arange(64.0)).sum().backward()
    torch.testing.assert_close(ad.grad.cpu(), ar.grad)
    torch.testing.assert_close(bd.grad.cpu(), br.grad)


def _graphs(fn, *args):
    """Dynamo graphs of fn (fullgraph) and the compiled result through aot_eager."""
    from torch._dynamo.backends.common import aot_autograd  # noqa: F401  (aot_eager below)
    from torch._dynamo.backends.debugging import aot_eager
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs, out


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_nki_op_is_one_node_in_compiled_graph(device):
    op = nki_op(_name("softmax"), softmax_kernel, mutates_args=())   # fake inferred by simulation
    x = _rand(128, 96).to(device)

    def f(t):
        return op(t * 2) + 1
    graphs, out = _graphs(f, x)
    calls = [n for g in graphs for n in g.graph.nodes
             if n.op == "call_function" and "nki_test" in str(n.target)]
    assert len(graphs) == 1 and len(calls) == 1
    assert out.device.type == device
    torch.testing.assert_close(out.cpu(), torch.softmax(x.cpu() * 2, -1) + 1, rtol=1e-5, atol=1e-6)


@nki.jit
def scaled_add_kernel(a, b, scale=1.0):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.multiply(nl.add(nl.load(a), nl.load(b)), scale))
    return out


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_jit_kernel_inside_compile_is_one_node(device):
    # AWS: a bare @nki.jit call inside torch.compile becomes one node of the captured graph.
    a, b = _rand(128, 64).to(device), _rand(128, 64, seed=1).to(device)
    graphs, out = _graphs(lambda x, y: scaled_add_kernel(x * 2, y, scale=0.5) + 1, a, b)
    calls = [n for g in graphs for n in g.graph.nodes if "nki_jit.call" in str(n.target)]
    assert len(graphs) == 1 and len(calls) == 1
    assert out.device.type == device
    torch.testing.assert_close(out.cpu(), (a.cpu() * 2 + b.cpu()) * 0.5 + 1)


def test_jit_kernel_writing_input_inside_compile_needs_nki_op():
    torch._dynamo.reset()
    f = torch.compile(lambda x: scale_inplace_kernel(x, 2.0), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="mutates_args"):
        f(_rand(128, 8))


def test_nki_op_compiled_training_step_matches_cpu():
    op = _mul_op_with_autograd()
    a, b = _rand(128, 32), _rand(128, 32, seed=1)

    def step(x, y):
        return (op(x, y) ** 2).sum()
    xd, yd = (t.to("neuron").requires_grad_() for t in (a, b))
    torch.compile(step, backend="aot_eager", fullgraph=True)(xd, yd).backward()
    xr, yr = (t.detach().clone().requires_grad_() for t in (a, b))
    ((xr * yr) ** 2).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xr.grad)
    torch.testing.assert_close(yd.grad.cpu(), yr.grad)


def test_nki_op_opcheck():
    op = nki_op(_name("add_checked"), add_kernel, mutates_args=())
    torch.library.opcheck(op, (_rand(32, 16), _rand(32, 16, seed=1)))


@pytest.mark.skipif("neuron" not in torch._dynamo.list_backends(),
                    reason="the torch.compile backend 'neuron' is not registered")
def test_nki_op_with_neuron_backend():
    op = nki_op(_name("add_nb"), add_kernel, mutates_args=())
    a, b = _rand(128, 64), _rand(128, 64, seed=1)
    torch._dynamo.reset()
    r = torch.compile(lambda x, y: op(x, y) * 2, backend="neuron")(a.to("neuron"), b.to("neuron"))
    torch.testing.assert_close(r.cpu(), (a + b) * 2)
    torch._dynamo.reset()
    r = torch.compile(lambda x, y: scaled_add_kernel(x, y, scale=3.0) - 1, backend="neuron")(
        a.to("neuron"), b.to("neuron"))
    torch.testing.assert_close(r.cpu(), (a + b) * 3 - 1)


def test_nki_op_python_function_derives_its_fake_under_compile():
    # AWS's guide: a Python function calling NKI kernels, registered with
    # @nki_op(..., mutates_args={}) and no fake, used inside torch.compile.
    @nki_op(_name("fma_auto"), mutates_args={})
    def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return add_kernel(mul_kernel(a, b), c)

    a, b, c = (_rand(128, 64, seed=s).to("neuron") for s in range(3))
    compiled = torch.compile(lambda a, b, c: fma(a, b, c) * 2, backend="neuron", fullgraph=True)
    got = compiled(a, b, c)
    torch.testing.assert_close(got.cpu(), (a.cpu() * b.cpu() + c.cpu()) * 2)
    from torch._subclasses.fake_tensor import FakeTensorMode
    a32 = a[:, :32].contiguous()
    with FakeTensorMode() as mode:
        fa = mode.from_tensor(a32)
        out = fma(fa, fa, fa)
    assert tuple(out.shape) == (128, 32) and out.dtype == a.dtype
