"""NKI-lib attention kernels in the simulator against PyTorch on CPU."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import nki
from nkilib.core.attention.attention_bwd import attention_bwd
from nkilib.core.attention.attention_cte import attention_cte

BF16 = ml_dtypes.bfloat16


def _reference(q, k, v, scale, causal, window=0, cap=None):
    """q (B, Sq, d), k (Bkv, Skv, d), v (Bkv, Skv, d) float tensors -> out, lse."""
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = q @ k.transpose(-1, -2) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(q.shape[1])[:, None]
    j = torch.arange(k.shape[1])[None]
    mask = torch.zeros(q.shape[1], k.shape[1], dtype=torch.bool)
    if causal:
        mask |= j > i
    if window:
        mask |= j < i - window + 1
    s = s.masked_fill(mask, -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _inputs(B, Bkv, Sq, Skv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g) for s in ((B, Sq, d), (Bkv, Skv, d), (Bkv, Skv, d)))
    if dtype == "bfloat16":   # the reference sees exactly the kernel's bf16 inputs
        q, k, v = (t.to(torch.bfloat16).float() for t in (q, k, v))
    return q, k, v


def _np(t, dtype):
    a = t.numpy()
    return a.astype(BF16) if dtype == "bfloat16" else a


CASES = [  # B, Bkv, Sq, Skv, d, causal, window, softcap
    (2, 2, 256, 256, 64, True, 0, None),
    (4, 2, 200, 200, 32, True, 0, None),        # GQA 2, sequence not a multiple of 128
    (4, 1, 130, 130, 128, False, 0, None),      # MQA, d = 128
    (1, 1, 640, 640, 64, True, 100, None),      # sliding window across sections
    (1, 1, 700, 700, 64, False, 300, None),     # window without causal
    (2, 2, 128, 700, 64, False, 0, 30.0),       # cross-length, logit soft-cap
    (1, 1, 1100, 1100, 16, True, 0, None),      # several 512-key sections, partial last
    (1, 1, 1100, 1100, 128, True, 0, 30.0),     # PSUM-heavy: fp32 P tiles, soft-cap stage
    (2, 2, 1100, 1100, 64, True, 300, None),    # causal and window cut the same sections
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_cte_matches_torch(case, dtype):
    B, Bkv, Sq, Skv, d, causal, window, cap = case
    q, k, v = _inputs(B, Bkv, Sq, Skv, d, dtype)
    scale = 1.0 / math.sqrt(d)
    out, neg_max, sum_recip = attention_cte(
        _np(q, dtype), _np(k.transpose(1, 2).contiguous(), dtype), _np(v, dtype), scale=scale,
        causal_mask=causal, sliding_window=window, logit_softcap=cap, cache_softmax=True)
    ref, lse = _reference(q, k, v, scale, causal, window, cap)
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), ref.numpy(), atol=tol, rtol=tol)
    G = neg_max.shape[2]
    with np.errstate(divide="ignore"):
        got = -(neg_max + np.log(sum_recip))
    got = got.transpose(0, 2, 1).reshape(B, G * 128)[:, :Sq]
    np.testing.assert_allclose(got, lse.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp", [(True, False, False), (False, True, True), (True, True, False)])
def test_attention_cte_layouts(tp):
    tp_q, tp_k, tp_out = tp
    q, k, v = _inputs(2, 1, 256, 384, 64, "float32")
    qa = q.numpy() if tp_q else q.transpose(1, 2).contiguous().numpy()
    ka = k.numpy() if tp_k else k.transpose(1, 2).contiguous().numpy()
    out = attention_cte(qa, ka, v.numpy(), scale=0.125, causal_mask=False, tp_q=tp_q, tp_k=tp_k,
                        tp_out=tp_out)
    ref, _ = _reference(q, k, v, 0.125, False)
    ref = ref.transpose(1, 2) if tp_out else ref
    np.testing.assert_allclose(out, ref.numpy(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_attention_cte_lnc_grid_and_targets(target, monkeypatch):
    """AWS's harness entry: nki.cpu_simulate(kernel)[lnc](**inputs), per core generation."""
    monkeypatch.setenv("NKI_NC_VERSION", {"trn2": "gen3", "trn3": "gen4"}[target])
    q, k, v = _inputs(3, 3, 300, 300, 64, "bfloat16")
    out = nki.cpu_simulate(attention_cte)[2](
        q=_np(q, "bfloat16"), k=_np(k.transpose(1, 2).contiguous(), "bfloat16"),
        v=_np(v, "bfloat16"), scale=0.125, causal_mask=True)
    ref, _ = _reference(q, k, v, 0.125, True)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref.numpy(), atol=2e-2, rtol=2e-2)


def test_attention_cte_rejects_what_it_does_not_cover():
    q = np.zeros((1, 128, 64), np.float32)
    k = np.zeros((1, 64, 128), np.float32)
    with pytest.raises(nki.errors.UnsupportedError, match="attention sinks"):
        attention_cte(q, k, q, sink=np.zeros((1, 1), np.float32))
    with pytest.raises(nki.errors.ShapeMismatchError, match="multiple of the key/value batch"):
        attention_cte(np.zeros((3, 128, 64), np.float32), np.zeros((2, 64, 128), np.float32),
                      np.zeros((2, 128, 64), np.float32))


BWD_CASES = [  # B, H, Hkv, Sq, Skv, d, causal, window
    (1, 2, 2, 256, 256, 64, True, 0),
    (1, 4, 2, 128, 200, 32, False, 0),    # GQA, key length not a multiple of 128
    (2, 2, 1, 384, 384, 64, True, 100),   # MQA, sliding window
    (1, 1, 1, 128, 128, 128, False, 0),
    # units of 512 keys (256 in fp32): causal cuts inside them, a partial last block,
    # a window that drops whole 128-key sub-blocks, GQA accumulating over heads
    (1, 2, 1, 640, 1100, 64, True, 0),
    (1, 1, 1, 1024, 1024, 128, True, 300),
    (1, 4, 2, 768, 600, 32, False, 0),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_bwd_matches_autograd(case, dtype):
    _check_bwd(*case, dtype=dtype, seed=1)


def _check_bwd(B, H, Hkv, Sq, Skv, d, causal, window, dtype, seed):
    """attention_bwd's gradients against autograd through the reference on CPU."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, Sq, d), (B, Hkv, Skv, d), (B, Hkv, Skv, d))
    q, k, v = (torch.randn(*s, generator=g) for s in shapes)
    if dtype == "bfloat16":
        q, k, v = (t.to(torch.bfloat16).float() for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = 1.0 / math.sqrt(d)
    flat = lambda t, n: t.reshape(B * n, *t.shape[2:])   # noqa: E731
    out, lse = _reference(flat(q, H), flat(k, Hkv), flat(v, Hkv), scale, causal, window)
    out = out.reshape(B, H, Sq, d)
    dy = torch.randn(out.shape, generator=g)
    if dtype == "bfloat16":
        dy = dy.to(torch.bfloat16).float()
    out.backward(dy)

    def T(t):
        return _np(t.detach().transpose(-1, -2).contiguous(), dtype)
    lse_l = lse.detach().reshape(B, H, Sq // 128, 128).transpose(-1, -2).contiguous().numpy()
    dq, dk, dv = attention_bwd(T(q), T(k), T(v), T(out), T(dy), lse_l, use_causal_mask=causal,
                               sliding_window=window)
    tol = 2e-5 if dtype == "float32" else 6e-2
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        want = want.transpose(-1, -2).numpy()
        np.testing.assert_allclose(np.asarray(got, np.float32), want,
                                   atol=tol * max(1, np.abs(want).max()), rtol=tol)


def test_attention_bwd_needs_whole_query_blocks():
    z = np.zeros((1, 1, 64, 200), np.float32)
    with pytest.raises(nki.errors.ShapeMismatchError, match="multiple of 128"):
        attention_bwd(z, z, z, z, z, np.zeros((1, 1, 128, 1), np.float32))


def _latency(kernel, *args, target="trn2", **kw):
    return nki.benchmark(kernel, target=target)(*args, **kw).latency_ns


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_attention_timing_orders(target):
    """Causal does about half the work of full attention, a short window less again."""
    S, d = 4096, 128
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, S, d)).astype(BF16)
    k = rng.standard_normal((1, d, S)).astype(BF16)
    v = rng.standard_normal((1, S, d)).astype(BF16)
    full = _latency(attention_cte, q, k, v, target=target, scale=d ** -0.5, causal_mask=False)
    causal = _latency(attention_cte, q, k, v, target=target, scale=d ** -0.5, causal_mask=True)
    window = _latency(attention_cte, q, k, v, target=target, scale=d ** -0.5, causal_mask=True,
                      sliding_window=256)
    assert causal < 0.85 * full
    assert window < 0.7 * causal
    # TensorE-bound work: full attention reaches a real fraction of the engine's peak.
    from neuronhw import get_profile
    peak = get_profile(target).core_tflops["bfloat16"] * 1e12
    assert 4 * S * S * d / (full * 1e-9) > 0.15 * peak


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_attention_bwd_timing_orders(target):
    """The backward skips what the masks remove, and its 512-key units keep TensorE busy
    enough to reach a real fraction of its peak (128 x 128 units reached 13%)."""
    S, d = 2048, 128
    rng = np.random.default_rng(0)
    q, k, v, o, dy = (rng.standard_normal((1, 1, d, S)).astype(BF16) for _ in range(5))
    lse = (rng.standard_normal((1, 1, 128, S // 128)) + 5).astype(np.float32)
    full = _latency(attention_bwd, q, k, v, o, dy, lse, target=target)
    causal = _latency(attention_bwd, q, k, v, o, dy, lse, target=target, use_causal_mask=True)
    window = _latency(attention_bwd, q, k, v, o, dy, lse, target=target, use_causal_mask=True,
                      sliding_window=256)
    assert causal < 0.85 * full
    assert window < 0.8 * causal     # (the loads and stores are a third of it)
    from neuronhw import get_profile
    peak = get_profile(target).core_tflops["bfloat16"] * 1e12
    assert 8 * S * S * d / (full * 1e-9) > 0.25 * peak


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_bwd_long_queries_run_in_segments(monkeypatch, dtype):
    """Query sequences too long for SBUF beside their kv head run as segments of query
    blocks (dk and dv summed over them): forced here at a small SBUF budget, three
    segments of 256 queries, causal and windowed, GQA."""
    import nkilib.core.attention.attention_bwd as mod
    B, H, Hkv, Sq, Skv, d = 1, 2, 1, 640, 1100, 64
    isz = 4 if dtype == "float32" else 2
    kv_bytes = Skv * (2 * isz + 8) + -(-Skv // 128) * d * isz
    monkeypatch.setattr(mod, "_SBUF_BYTES", kv_bytes + mod._DQ_CHUNK * 4 + 256 * (5 * isz + 4))
    _check_bwd(B, H, Hkv, Sq, Skv, d, True, 300, dtype=dtype, seed=3)


def test_attention_bwd_refuses_keys_beyond_sbuf(monkeypatch):
    import nkilib.core.attention.attention_bwd as mod
    monkeypatch.setattr(mod, "_SBUF_BYTES", 8 * 1024)
    z = np.zeros((1, 1, 64, 128), np.float32)
    with pytest.raises(nki.errors.SbufCapacityError, match="1024 keys need"):
        attention_bwd(z, np.zeros((1, 1, 64, 1024), np.float32),
                      np.zeros((1, 1, 64, 1024), np.float32), z, z,
                      np.zeros((1, 1, 128, 1), np.float32))
