"""rms_norm and layer_norm on neuron: CPU's results and gradients, the forward charged as
NKI-lib's norm kernel (simulated here directly, not through the route's cache)."""
import logging
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nki
from nkilib.core.subkernels.layernorm_tkg import layernorm_tkg
from nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg
from torch_neuronx import _state, cost_model
from torch_neuronx.kernels import nkilib_routes as routes
from _charges import charges as _charges  # noqa: E402  (this folder)

_NP = {torch.float32: np.float32, torch.bfloat16: ml_dtypes.bfloat16}


def _expected_seconds(kernel, rows, H, dtype, **kw):
    """One launch of the kernel on the logical core's physical cores, simulated here."""
    cfg = _state.config()
    x = np.random.default_rng(1).standard_normal((rows, H), dtype=np.float32).astype(_NP[dtype])
    g = np.ones((1, H), _NP[dtype])
    k = kernel[cfg.lnc] if cfg.lnc > 1 else kernel
    r = nki.benchmark(k, target=cfg.profile.name)(x, g, eps=1e-6, **kw)
    return cfg.profile.launch_overhead_ns * 1e-9 + r.latency_ns * 1e-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_cpu_forward_and_backward(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 37, 96).to(dtype)
    w = torch.randn(96).to(dtype)
    gy = torch.randn(3, 37, 96).to(dtype)
    res = {}
    for dev in ("cpu", "neuron"):
        xd = x.detach().to(dev).requires_grad_()
        wd = w.detach().to(dev).requires_grad_()
        y = F.rms_norm(xd, (96,), wd, 1e-6)
        y.backward(gy.to(dev))
        res[dev] = [t.detach().cpu() for t in (y, xd.grad, wd.grad)]
    for a, b in zip(res["neuron"], res["cpu"]):
        assert torch.equal(a, b)


def test_nn_rmsnorm_and_layernorm_modules_equal_cpu():
    torch.manual_seed(0)
    x = torch.randn(4, 10, 64)
    for mod in (torch.nn.RMSNorm([10, 64]), torch.nn.LayerNorm(64), torch.nn.RMSNorm(64, eps=None)):
        with torch.no_grad():
            mod.weight.normal_()
        ref = mod(x.requires_grad_())
        ref.sum().backward()
        ref_grads = (x.grad.clone(), mod.weight.grad.clone())
        x.grad = None
        mod.weight.grad = None
        dev = mod.to("neuron")
        xd = x.detach().to("neuron").requires_grad_()
        y = dev(xd)
        y.sum().backward()
        assert torch.equal(y.detach().cpu(), ref.detach())
        assert torch.equal(xd.grad.cpu(), ref_grads[0])
        assert torch.equal(dev.weight.grad.cpu(), ref_grads[1])
        mod.to("cpu")
        mod.weight.grad = None
        x = x.detach()


def test_rms_norm_forward_is_charged_as_the_kernel():
    x = torch.randn(256, 512, dtype=torch.bfloat16, device="neuron")
    w = torch.randn(512, dtype=torch.bfloat16, device="neuron")
    y = torch.randn(256, 512, dtype=torch.bfloat16, device="neuron")

    def step():
        h = x + y                                     # queued before the norm: keeps its charge
        return F.rms_norm(h, (512,), w, 1e-6)
    _, seen = _charges(step)
    names = [c.name for c in seen]
    assert names.count("rms_norm") == 1
    assert not {"pow", "rsqrt", "mean", "fused_pointwise"} & set(names), names
    assert "add" in names or "fused_pointwise" in names
    charged = next(c.seconds for c in seen if c.name == "rms_norm")
    assert charged == pytest.approx(_expected_seconds(rmsnorm_tkg, 256, 512, torch.bfloat16),
                                    rel=1e-9)


def test_rms_norm_over_two_dims_and_backward_roofline():
    x = torch.randn(8, 16, 32, device="neuron", requires_grad=True)
    w = torch.randn(16, 32, device="neuron", requires_grad=True)

    def step():
        F.rms_norm(x, (16, 32), w).sum().backward()
    _, seen = _charges(step)
    charged = [c.seconds for c in seen if c.name == "rms_norm"]
    assert charged == [pytest.approx(_expected_seconds(rmsnorm_tkg, 8, 512, torch.float32),
                                     rel=1e-9)]
    # the backward's ops keep their own costs
    assert {"mul", "sum"} <= {c.name for c in seen} or "fused_pointwise" in {c.name for c in seen}


def test_layer_norm_forward_is_charged_as_the_kernel():
    x = torch.randn(2, 64, 256, device="neuron")
    w = torch.randn(256, device="neuron")
    b = torch.randn(256, device="neuron")
    for bias, kw in ((b, {"beta": np.zeros((1, 256), np.float32)}), (None, {})):
        out, seen = _charges(lambda: F.layer_norm(x, (256,), w, bias))
        charged = [c for c in seen if c.name == "native_layer_norm"]
        assert len(charged) == 1 and charged[0].engine == "vector"
        assert charged[0].seconds == pytest.approx(
            _expected_seconds(layernorm_tkg, 128, 256, torch.float32, **kw), rel=1e-9)
        assert torch.equal(out.cpu(), F.layer_norm(x.cpu(), (256,), w.cpu(),
                                                   None if bias is None else b.cpu()))


def test_rms_norm_charge_can_be_repriced():
    """The charge keeps what it was priced from, as a what-if re-prices it (plan.replay)."""
    cfg = _state.config()
    x = torch.randn(64, 128, device="neuron")
    _, seen = _charges(lambda: F.rms_norm(x, (128,)))
    c = next(c for c in seen if c.name == "rms_norm")
    assert c.shapes == ((64, 128), (128,)) and c.dtype == torch.float32
    again = cost_model.op_seconds(cfg.profile, cfg.lnc, c.name, list(c.shapes), c.dtype,
                                  c.bytes_in, c.bytes_out)[0]
    assert again == c.seconds


def test_inference_mode_is_routed_too():
    x = torch.randn(130, 64, device="neuron")
    with torch.inference_mode():
        out, seen = _charges(lambda: F.rms_norm(x, (64,)))
    assert [c.name for c in seen] == ["rms_norm"]
    assert torch.equal(out.cpu(), F.rms_norm(x.cpu(), (64,)))


@pytest.mark.filterwarnings("ignore:neuron.*Double")
def test_uncovered_calls_keep_their_ops_charges(caplog):
    x = torch.randn(16, 32, dtype=torch.float64, device="neuron")
    with caplog.at_level(logging.DEBUG, logger="torch_neuronx.nkilib"):
        out, seen = _charges(lambda: F.rms_norm(x, (32,)))
    assert "rms_norm: not routed to NKI-lib (dtype torch.float64)" in caplog.text
    names = {c.name for c in seen}
    assert "rms_norm" not in names and ({"pow", "rsqrt"} <= names or "fused_pointwise" in names)
    assert torch.equal(out.cpu(), F.rms_norm(x.cpu(), (32,)))
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="torch_neuronx.nkilib"):
        _, seen = _charges(lambda: F.layer_norm(x.float(), (32,)))
    assert "native_layer_norm: not routed to NKI-lib (no weight or bias" in caplog.text
    roof = [c for c in seen if c.name == "native_layer_norm"]
    assert len(roof) == 1 and roof[0].seconds == cost_model.op_seconds(
        _state.config().profile, _state.config().lnc, "native_layer_norm", [(16, 32)],
        torch.float32, roof[0].bytes_in, roof[0].bytes_out)[0]


def test_long_inputs_are_extrapolated_per_row():
    cfg = _state.config()
    t = cfg.profile.name
    H = 4096
    rows = routes._SIM_NORM_ELEMS // H
    full = routes.norm_kernel_ns(t, "rms_norm", rows, H, "bfloat16", False, cfg.lnc)
    half = routes.norm_kernel_ns(t, "rms_norm", rows // 2, H, "bfloat16", False, cfg.lnc)
    got = routes._norm_ns(t, "rms_norm", 3 * rows, H, "bfloat16", False, cfg.lnc)
    assert got == pytest.approx(full + 2 * rows * (full - half) / (rows // 2), rel=1e-9)
    assert 2 * full < got < 3 * full


EXECUTE = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch_neuronx import cost_model
    from torch_neuronx.kernels import nkilib_routes as routes
    assert routes.EXECUTE
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(2, 70, 192).to(dtype)
        w, b = torch.randn(192).to(dtype), torch.randn(192).to(dtype)
        cost_model.reset_modelled_time()
        xd = x.to("neuron").requires_grad_()
        y = F.rms_norm(xd, (192,), w.to("neuron"), 1e-6)
        ln = F.layer_norm(x.to("neuron"), (192,), w.to("neuron"), b.to("neuron"))
        ops = cost_model.modelled_time().by_op
        assert "nki:rmsnorm_tkg" in ops and "nki:layernorm_tkg" in ops, dict(ops)
        torch.testing.assert_close(y.detach().cpu().float(), F.rms_norm(x, (192,), w, 1e-6).float(),
                                   rtol=tol, atol=tol)
        torch.testing.assert_close(ln.cpu().float(), F.layer_norm(x, (192,), w, b).float(),
                                   rtol=tol, atol=tol)
        # the backward differentiates CPU's composite
        y.backward(torch.ones_like(y))
        xc = x.clone().requires_grad_()
        F.rms_norm(xc, (192,), w, 1e-6).backward(torch.ones_like(xc))
        assert torch.equal(xd.grad.cpu(), xc.grad)
    print("ok")
""")


def test_execute_mode_runs_the_kernels():
    env = dict(os.environ, TORCH_NEURONX_NKI_EXECUTE="1")
    r = subprocess.run([sys.executable, "-c", EXECUTE], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_a_residual_add_runs_fused_with_the_charged_norm_and_keeps_its_own_charge():
    import torch_neuronx
    x, y = (torch.randn(256, 1024, device="neuron") for _ in range(2))
    w = torch.randn(1024, device="neuron")

    def step():
        return F.rms_norm(x + y, (1024,), w, 1e-6)
    step()                                           # the first call of a signature waits
    _, alone = _charges(lambda: x + y)
    torch_neuronx.adaptive_eager_stats(reset=True)
    out, seen = _charges(step)
    stats = torch_neuronx.adaptive_eager_stats(reset=True)
    # One kernel on the host (the add and the norm's five ops) ...
    assert (stats["ops"], stats["kernels"], stats["fused_kernels"]) == (7, 1, 1), stats
    # ... two charges, as on the chip: the add on its own, the norm as NKI-lib's kernel.
    assert sorted(c.name for c in seen) == ["add", "rms_norm"]
    add = next(c for c in seen if c.name == "add")
    assert add.seconds == next(c.seconds for c in alone if c.name == "add")
    ref = F.rms_norm(x.cpu() + y.cpu(), (1024,), w.cpu(), 1e-6)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)


def test_two_recorded_ops_before_the_norm_keep_their_window():
    x, y = (torch.randn(256, 1024, device="neuron") for _ in range(2))

    def step():
        return F.rms_norm((x + y) * 2, (1024,), None, 1e-6)
    step()
    _, seen = _charges(step)
    names = sorted(c.name for c in seen)
    assert names in (["add", "mul", "rms_norm"], ["fused_pointwise", "rms_norm"]), names
