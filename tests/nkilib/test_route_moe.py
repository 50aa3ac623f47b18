"""Transformers' MoE experts on neuron: CPU's results and gradients, the forward charged as one
launch of NKI-lib's MoE kernel (simulated here directly, not through the route's cache),
uncovered calls charged as their ops with a log saying why; under TORCH_NEURONX_NKI_EXECUTE=1
the kernels themselves compute the forward."""
import contextlib
import logging
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch

import nki
from nkilib.core.moe.moe_cte.moe_cte import moe_cte
from nkilib.core.moe.moe_tkg.moe_tkg import moe_tkg
from nkilib.core.utils.common_types import ExpertAffinityScaleMode
from torch_neuronx import _state
from _charges import charges as _charges  # noqa: E402  (this folder)

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402

_NP = {torch.float32: np.float32, torch.bfloat16: ml_dtypes.bfloat16}
IMPLS = ["grouped_mm", "batched_mm", "eager"]


def _config(H, impl, experts=4, top_k=2, act="silu"):
    cfg = MixtralConfig(vocab_size=64, hidden_size=H, intermediate_size=H,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=experts, num_experts_per_tok=top_k, hidden_act=act,
                        max_position_embeddings=256, pad_token_id=0)
    cfg._experts_implementation = impl
    return cfg


def _block(cfg, seed=0):
    torch.manual_seed(seed)
    blk = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(std=0.05)
    return blk


def _expected(T, H, I, E, k, dtype):
    """One launch of the kernel at balanced routing, simulated here: moe_tkg for at most 128
    tokens (the picked experts only), else moe_cte with blocks of 128 (E * ceil(T*k/E/128)
    blocks, at most three here, so nothing is extrapolated)."""
    cfg = _state.config()
    dt = _NP[dtype]
    rng = np.random.default_rng(5)
    if T <= 128:
        used = min(E, T * k)
        idx = np.array([[(t * k + j) % used for j in range(k)] for t in range(T)], np.int32)
        aff = np.zeros((T, used), np.float32)
        for t in range(T):
            aff[t, idx[t]] = 1.0 / k
        r = nki.benchmark(moe_tkg, target=cfg.profile.name)(
            rng.standard_normal((T, H)).astype(dt),
            rng.standard_normal((used, H, 2, I)).astype(dt) * 0.05,
            rng.standard_normal((used, I, H)).astype(dt) * 0.05, aff.astype(dt), idx, False,
            expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE)
    else:
        B = 128
        N = E * -(-(-(-T * k // E)) // B)
        assert N <= 3, "keep the test's shapes within three blocks"
        pos = np.array([i % T for i in range(N * B)], np.int32)
        aff = np.zeros((T + 1, N), np.float32)
        for i in range(N * B):
            aff[pos[i], i // B] = 0.5
        h = rng.standard_normal((T + 1, H)).astype(dt)
        r = nki.benchmark(moe_cte, target=cfg.profile.name)(
            h, aff.astype(dt).reshape(-1, 1),
            rng.standard_normal((N, H, 2, I)).astype(dt) * 0.05,
            rng.standard_normal((N, I, H)).astype(dt) * 0.05, pos,
            np.arange(N, dtype=np.int32).reshape(N, 1), B)
    return cfg.profile.launch_overhead_ns * 1e-9 + r.latency_ns * 1e-9


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T,experts,top_k", [(48, 4, 2), (150, 3, 1)])
def test_experts_equal_cpu_and_forward_is_one_kernel(impl, T, experts, top_k):
    # batched_mm's weight gradients are index_put_(accumulate=True): CPU's kernel adds in
    # parallel with atomics (run-to-run different sums) unless deterministic algorithms are on
    with _deterministic(impl == "batched_mm"):
        _experts_case(impl, T, experts, top_k)


@contextlib.contextmanager
def _deterministic(on):
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on or prev)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


def _experts_case(impl, T, experts, top_k):
    cfg = _config(128, impl, experts=experts, top_k=top_k)
    blk = _block(cfg)
    x = torch.randn(1, T, 128, generator=torch.Generator().manual_seed(1))
    gy = torch.randn(1, T, 128, generator=torch.Generator().manual_seed(2))
    xc = x.clone().requires_grad_()
    ref = blk(xc)
    ref.backward(gy)
    dev = _block(cfg).to("neuron")
    xd = x.to("neuron").requires_grad_()
    out, fwd = _charges(lambda: dev(xd))
    _, bwd = _charges(lambda: out.backward(gy.to("neuron")))
    assert torch.equal(out.detach().cpu(), ref.detach())
    assert torch.equal(xd.grad.cpu(), xc.grad)
    for p, q in zip(dev.parameters(), blk.parameters()):
        assert torch.equal(p.grad.cpu(), q.grad)
    moe = [c for c in fwd if c.name == "moe_experts"]
    assert len(moe) == 1
    assert moe[0].shapes == ((T, 128), (T, top_k), (experts, 256, 128))
    assert moe[0].seconds == pytest.approx(
        _expected(T, 128, 128, experts, top_k, torch.float32), rel=1e-9)
    assert moe[0].flops == 6.0 * T * top_k * 128 * 128
    # the experts' ops ran unrecorded; the router's (a Linear, softmax, topk) were charged
    names = [c.name for c in fwd]
    assert not set(names) & {"_grouped_mm", "bmm", "histc", "sort", "index_add_", "nonzero"}
    assert "topk" in names and names.count("mm") == 1
    # the backward is charged as its ops (NKI-lib has no MoE backward kernel)
    assert bwd and not any(c.name == "moe_experts" for c in bwd)


def test_causal_lm_step_equals_cpu_in_bf16():
    cfg = _config(128, "grouped_mm")
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    dev = MixtralForCausalLM(cfg).to(torch.bfloat16)
    dev.load_state_dict(model.state_dict())
    dev.to("neuron")
    ref = model(ids, labels=ids).loss
    ref.backward()
    loss, fwd = _charges(lambda: dev(ids.to("neuron"), labels=ids.to("neuron")).loss)
    loss.backward()
    assert torch.equal(loss.detach().cpu(), ref.detach())
    for (n, p), q in zip(dev.named_parameters(), model.parameters()):
        assert torch.equal(p.grad.cpu(), q.grad), n
    moe = [c for c in fwd if c.name == "moe_experts"]
    assert len(moe) == 1 and moe[0].dtype == torch.bfloat16
    assert moe[0].seconds == pytest.approx(_expected(48, 128, 128, 4, 2, torch.bfloat16),
                                           rel=1e-9)


def test_kernel_is_faster_than_its_ops():
    """The fused kernel against the experts' own ops, each charged on its own (the
    uncovered path at a size the kernel covers, via the class's unwrapped loop)."""
    cfg = _config(256, "grouped_mm")
    blk = _block(cfg).to("neuron")
    x = torch.randn(1, 512, 256).to("neuron")
    with torch.no_grad():
        _, fused = _charges(lambda: blk(x))
        raw = type(blk.experts).forward.__wrapped__
        h = x.view(-1, 256)
        _, w, idx = blk.gate(h)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        unwrapped = ALL_EXPERTS_FUNCTIONS["grouped_mm"].__wrapped__
        _, parts = _charges(lambda: unwrapped(blk.experts, h, idx, w))
        _, loop = _charges(lambda: raw(blk.experts, h, idx, w))
    kernel = sum(c.seconds for c in fused if c.name == "moe_experts")
    assert 0 < kernel < sum(c.seconds for c in parts)
    assert kernel < sum(c.seconds for c in loop)


def test_a_hidden_size_off_128_is_priced_padded():
    """H=64 (the tiny Mixtral of examples/models) is charged as the kernel at H=128, the
    weights zero-padded."""
    cfg = _config(64, "grouped_mm")
    blk = _block(cfg).to("neuron")
    _, seen = _charges(lambda: blk(torch.randn(1, 16, 64).to("neuron")))
    moe = [c for c in seen if c.name == "moe_experts"]
    assert len(moe) == 1 and moe[0].shapes == ((16, 64), (16, 2), (4, 128, 64))
    assert moe[0].seconds == pytest.approx(_expected(16, 128, 64, 4, 2, torch.float32),
                                           rel=1e-9)


def test_uncovered_calls_keep_their_ops_and_say_why(caplog):
    cfg = _config(128, "eager")          # torch._grouped_mm takes no float64, on CPU neither
    blk = _block(cfg).to(torch.float64).to("neuron")
    with caplog.at_level(logging.DEBUG, logger="torch_neuronx.nkilib"):
        _, seen = _charges(lambda: blk(torch.randn(1, 16, 128, dtype=torch.float64)
                                       .to("neuron")))
    assert not any(c.name == "moe_experts" for c in seen)
    assert [c.name for c in seen].count("mm") > 1    # the router's and the experts' Linears
    assert "dtype torch.float64" in caplog.text
    cfg = _config(128, "grouped_mm", act="relu")
    blk = _block(cfg).to("neuron")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="torch_neuronx.nkilib"):
        _, seen = _charges(lambda: blk(torch.randn(1, 16, 128).to("neuron")))
    assert not any(c.name == "moe_experts" for c in seen)
    assert "an activation the kernels lack" in caplog.text


def test_compiled_experts_are_costed_as_their_kernels():
    cfg = _config(128, "grouped_mm")
    blk = _block(cfg)
    x = torch.randn(1, 32, 128)
    ref = blk(x)
    dev = torch.compile(_block(cfg).to("neuron"), backend="neuron")
    out, seen = _charges(lambda: dev(x.to("neuron")))
    torch.testing.assert_close(out.cpu(), ref)
    assert not any(c.name == "moe_experts" for c in seen)


def test_cpu_experts_untouched():
    cfg = _config(128, "grouped_mm")
    blk = _block(cfg)
    _, seen = _charges(lambda: blk(torch.randn(1, 16, 128)))
    assert not seen


def test_many_blocks_extrapolate_to_the_simulated_kernel():
    """Beyond three blocks moe_cte is priced by its marginal time per block: within 3% of
    simulating all six blocks."""
    from nkilib.core.utils.common_types import ActFnType
    from torch_neuronx.kernels import moe
    target = _state.config().profile.name
    priced = moe._moe_ns(target, 384, 128, 128, 3, 2, "float32", ActFnType.SiLU)
    direct = moe._cte_ns(target, 384, 128, 128, 128, 6, "float32", ActFnType.SiLU)
    assert priced == pytest.approx(direct, rel=0.03)


EXECUTE = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, HERE)
    from _charges import charges as _charges
    from test_route_moe import _block, _config
    for T, H, dtype, tol in ((48, 128, torch.float32, 1e-4), (150, 128, torch.float32, 1e-4),
                             (150, 128, torch.bfloat16, 3e-2), (150, 64, torch.float32, 1e-4),
                             (40, 64, torch.float32, 1e-4)):
        cfg = _config(H, "grouped_mm", experts=3, top_k=2)
        blk = _block(cfg).to(dtype)
        x = torch.randn(1, T, H).to(dtype)
        xc = x.clone().requires_grad_()
        ref = blk(xc)
        ref.sum().backward()
        dev = _block(cfg).to(dtype).to("neuron")
        xd = x.to("neuron").requires_grad_()
        out, seen = _charges(lambda: dev(xd))
        out.sum().backward()
        names = [c.name for c in seen]
        # the kernel ran in the simulator; the layout work for it was not charged
        assert ("nki:moe_tkg" if T <= 128 else "nki:moe_cte") in names, names
        assert not set(names) & {"moe_experts", "scatter_", "cat", "permute"}, names
        torch.testing.assert_close(out.detach().cpu().float(), ref.detach().float(),
                                   rtol=tol, atol=tol)
        # the backward differentiates Transformers' function, recomputed
        assert torch.equal(xd.grad.cpu(), xc.grad)
        assert torch.equal(dev.experts.gate_up_proj.grad.cpu(), blk.experts.gate_up_proj.grad)
        assert torch.equal(dev.experts.down_proj.grad.cpu(), blk.experts.down_proj.grad)
    print("ok")
""")


def test_execute_mode_runs_the_kernels():
    env = dict(os.environ, TORCH_NEURONX_NKI_EXECUTE="1")
    code = EXECUTE.replace("HERE", repr(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
