"""scaled_dot_product_attention on neuron: modelled by NKI-lib's kernels, executed by them
under TORCH_NEURONX_NKI_EXECUTE=1."""
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from torch_neuronx import _state, cost_model
from torch_neuronx.kernels import nkilib_routes as routes


def _attention_time(fn, *args):
    torch.neuron.synchronize()
    cost_model.reset_modelled_time()
    out = fn(*args)
    torch.neuron.synchronize()
    t = cost_model.modelled_time()
    return out, t.by_op.get(routes.FWD, 0.0), t.by_op.get(routes.BWD, 0.0)


def test_sdpa_time_is_the_kernels():
    cfg = _state.config()
    p, lnc = cfg.profile, cfg.lnc
    q = torch.randn(2, 3, 256, 64, device="neuron")
    k = torch.randn(2, 3, 256, 64, device="neuron")
    _, full, _ = _attention_time(F.scaled_dot_product_attention, q, k, k)
    _, causal, _ = _attention_time(lambda a, b: F.scaled_dot_product_attention(a, b, b, is_causal=True), q, k)
    head_full = routes.head_latency_ns(p.name, "fwd", 256, 256, 64, "float32", False, 6, lnc)
    head_causal = routes.head_latency_ns(p.name, "fwd", 256, 256, 64, "float32", True, 6, lnc)
    launch = p.launch_overhead_ns * 1e-9
    assert full == pytest.approx(launch + head_full * 1e-9 * 6, rel=1e-9)
    assert causal == pytest.approx(launch + head_causal * 1e-9 * 6, rel=1e-9)
    assert head_causal != head_full     # the causal flag reaches the cost


def test_sdpa_backward_time_is_the_kernels():
    cfg = _state.config()
    q = torch.randn(1, 2, 256, 32, device="neuron", requires_grad=True)

    def step(x):
        F.scaled_dot_product_attention(x, x, x, is_causal=True).sum().backward()
    _, _, bwd = _attention_time(step, q)
    head = routes.head_latency_ns(cfg.profile.name, "bwd", 256, 256, 32, "float32", True, 2,
                                  cfg.lnc)
    assert bwd == pytest.approx(cfg.profile.launch_overhead_ns * 1e-9 + head * 1e-9 * 2,
                                rel=1e-9)


def test_sdpa_uncovered_calls_keep_the_roofline(caplog):
    q = torch.randn(1, 2, 128, 32, device="neuron")
    mask = torch.zeros(128, 128, device="neuron")
    cfg = _state.config()
    with caplog.at_level(logging.DEBUG, logger="torch_neuronx.nkilib"):
        _, masked, _ = _attention_time(lambda a: F.scaled_dot_product_attention(a, a, a, attn_mask=mask), q)
    assert "an explicit attention mask" in caplog.text
    roof, _, _ = cost_model.op_seconds(cfg.profile, cfg.lnc, routes.FWD, [tuple(q.shape)] * 3,
                                       torch.float32, 4 * 3 * q.numel() + 4 * mask.numel(),
                                       4 * q.numel() + 4 * 2 * 128, flags=0)
    routed = cost_model.op_seconds(cfg.profile, cfg.lnc, routes.FWD, [tuple(q.shape)] * 3,
                                   torch.float32, 0, 0, flags=0)[0]
    assert masked != pytest.approx(routed)
    assert masked > 0


def test_compiled_sdpa_is_routed_too():
    q = torch.randn(1, 2, 256, 64, device="neuron")
    f = torch.compile(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True),
                      backend="neuron")
    f(q)
    out, fwd, _ = _attention_time(f, q)
    _, eager, _ = _attention_time(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), q)
    assert fwd == pytest.approx(eager, rel=1e-9)
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q.cpu(), q.cpu(), q.cpu(),
                                                                         is_causal=True))


EXECUTE = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch_neuronx.kernels import nkilib_routes as routes
    assert routes.EXECUTE
    torch.manual_seed(0)
    for causal, shape in ((True, (2, 3, 256, 64)), (False, (1, 2, 200, 32))):
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        qn, kn, vn = (t.detach().to("neuron").requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out = F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)
        torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)
        if shape[2] % 128 == 0:
            g = torch.randn(shape)
            ref.backward(g)
            out.backward(g.to("neuron"))
            for a, b in ((qn, q), (kn, k), (vn, v)):
                torch.testing.assert_close(a.grad.cpu(), b.grad, atol=5e-5, rtol=5e-5)
    print("ok")
""")


def test_execute_mode_runs_the_kernels():
    env = dict(os.environ, TORCH_NEURONX_NKI_EXECUTE="1")
    r = subprocess.run([sys.executable, "-c", EXECUTE], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")


CHARGES = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch_neuronx import _state, cost_model
    from torch_neuronx.kernels import nkilib_routes as routes
    assert routes.EXECUTE
    cfg = _state.config()
    p, lnc = cfg.profile, cfg.lnc
    assert lnc == 2, lnc          # trn2's logical core: the grid matters

    def charged(fn):
        torch.neuron.synchronize()
        cost_model.reset_modelled_time()
        fn()
        torch.neuron.synchronize()
        return cost_model.modelled_time().by_op
    # four heads, so that kernel[2] and one core over all heads differ
    for shape, causal in (((1, 4, 384, 64), True), ((2, 2, 256, 32), False)):
        B, H, S, d = shape
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="neuron",
                               requires_grad=True) for _ in range(3))
        box = {}
        fwd = charged(lambda: box.setdefault(
            "o", F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
        bwd = charged(lambda: box["o"].sum().backward())
        for kind, got in (("fwd", fwd["nki:attention_cte"]), ("bwd", bwd["nki:attention_bwd"])):
            want = routes.head_latency_ns(p.name, kind, S, S, d, "bfloat16", causal, B * H,
                                          lnc) * B * H * 1e-9
            assert abs(got - want) <= 1e-6 * want, (shape, kind, got, want)
    x, w = torch.randn(256, 1024, device="neuron"), torch.randn(1024, device="neuron")
    got = charged(lambda: F.rms_norm(x, (1024,), w))["nki:rmsnorm_tkg"]
    want = routes.norm_kernel_seconds("rms_norm", p, lnc, [(256, 1024), (1024,)],
                                      torch.float32)
    assert abs(got - want) <= 1e-6 * want, (got, want)
    print("ok")
""")


def test_execute_mode_is_charged_what_the_route_charges():
    """A kernel executed under TORCH_NEURONX_NKI_EXECUTE=1 runs as kernel[lnc], as the route
    prices it (it ran on one core, charged up to twice the route's time)."""
    env = dict(os.environ, TORCH_NEURONX_NKI_EXECUTE="1")
    env.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
    r = subprocess.run([sys.executable, "-c", CHARGES], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def _flex_time(fn, *args):
    fn(*args)                               # compile outside the measurement
    torch.neuron.synchronize()
    cost_model.reset_modelled_time()
    fn(*args)
    torch.neuron.synchronize()
    return cost_model.modelled_time()


def test_flex_attention_time_is_the_block_sparse_kernels():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    cfg = _state.config()
    S, d = 256, 32
    q = torch.randn(1, 2, S, d, device="neuron")
    bm = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, S, S, device="neuron")
    f = torch.compile(lambda q: flex_attention(q, q, q, block_mask=bm), backend="neuron")
    t = _flex_time(f, q)
    # causal over two 128-blocks: 3 of the 4 (query block, key block) pairs are visited
    want, flops = routes.flex_seconds("fwd", 1, 2, S, S, d, torch.float32, 0.75)
    assert t.by_op["flex_attention"] == pytest.approx(want, rel=1e-9)
    assert t.flops == pytest.approx(flops, rel=1e-9)
    assert not [op for op in t.by_op if op in ("bmm", "exp", "amax")]   # no ATen ops charged


def test_flex_attention_with_a_score_mod_keeps_the_op_costs():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    q = torch.randn(1, 2, 128, 16, device="neuron")
    bm = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, 128, 128, device="neuron")
    f = torch.compile(lambda q: flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 0.5,
                                               block_mask=bm), backend="neuron")
    t = _flex_time(f, q)
    assert "flex_attention" not in t.by_op
    assert t.seconds > 0


def test_heads_of_a_call_pipeline_together():
    """A launch over many heads of a short sequence hides one head's waits behind the others'."""
    one = routes.head_latency_ns("trn2", "fwd", 64, 64, 32, "bfloat16", True, 1)
    many = routes.head_latency_ns("trn2", "fwd", 64, 64, 32, "bfloat16", True, 64)
    assert routes.sim_heads(64, 64, 64) == 16
    assert many < 0.5 * one
    one_b = routes.head_latency_ns("trn2", "bwd", 128, 128, 32, "bfloat16", True, 1)
    many_b = routes.head_latency_ns("trn2", "bwd", 128, 128, 32, "bfloat16", True, 16)
    assert many_b < 0.5 * one_b


def test_decode_shaped_sdpa_is_the_decode_kernel():
    from neuronhw import get_profile
    from nki.simulator.timing import Timeline
    cfg = _state.config()
    q = torch.randn(2, 8, 1, 64, device="neuron")
    times = {}
    for skv in (2048, 8192):
        k = torch.randn(2, 2, skv, 64, device="neuron")
        _, fwd, _ = _attention_time(lambda a, b: F.scaled_dot_product_attention(a, b, b, enable_gqa=True), q, k)
        want = routes.decode_latency_ns(cfg.profile.name, 8, 2, 1, skv, 64, "float32")
        assert fwd == pytest.approx(cfg.profile.launch_overhead_ns * 1e-9 + want * 1e-9 * 2 / cfg.lnc,
                                    rel=1e-9)
        times[skv] = want
    # bound by reading the cache: the extra keys cost about their bytes at the HBM rate
    rate = Timeline(get_profile(cfg.profile.name)).hbm_bytes_per_ns
    extra_bytes = (8192 - 2048) * 64 * 4 * 2 * 2          # K and V, 2 kv heads, fp32
    assert 0.9 < (times[8192] - times[2048]) / (extra_bytes / rate) < 2.0


def test_one_query_block_is_priced_on_two_cores():
    """One head of at most 128 queries leaves the second core of kernel[2] no work; the
    route still prices it (it crashed on the idle core's empty tiles)."""
    cfg = _state.config()
    q = torch.randn(1, 1, 64, 32, device="neuron")
    _, fwd, _ = _attention_time(lambda x: F.scaled_dot_product_attention(x, x, x), q)
    head = routes.head_latency_ns(cfg.profile.name, "fwd", 64, 64, 32, "float32", False, 1,
                                  cfg.lnc)
    assert head > 0
    assert fwd == pytest.approx(cfg.profile.launch_overhead_ns * 1e-9 + head * 1e-9, rel=1e-9)
