"""NKI-lib cross-entropy (forward, backward), top-k and MoE router top-k in the simulator
against PyTorch on CPU, on trn2 and trn3, fp32 and bf16."""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nki
import nki.language as nl
from nkilib.core.router_topk.router_topk import RouterActFnType, router_topk
from nkilib.core.topk.rotational_topk import rotational_topk, topk
from nkilib.core.topk.rotational_topk_utils import (RotationalTopkConfig, create_rotational_topk_config,
                                                    create_topk_config)
from nkilib.experimental.loss.cross_entropy import cross_entropy_backward, cross_entropy_forward

BF16 = ml_dtypes.bfloat16
TARGETS = ["trn2", "trn3"]
DTYPES = ["float32", "bfloat16"]


def _np_dtype(dtype):
    return np.float32 if dtype == "float32" else BF16


def _run(kernel, target, *args, **kw):
    return nki.simulate(kernel, platform_target=target)(*args, **kw)


def _logits(N, V, dtype, seed=0):
    """Logits (as the kernel's dtype holds them) and targets hitting the first and last class
    and the edges of the vocabulary tiles."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((N, V)) * 3).astype(_np_dtype(dtype))
    t = rng.integers(0, V, N).astype(np.int32)
    edges = [0, V - 1, 383, 384, 4095, 4096, 8191, 8192]
    t[:len(edges)] = [e % V for e in edges][:N]
    return x, t


CE_CASES = [  # N, V, positions_per_batch, chunk_size
    (200, 1000, 128, 384),         # rows not a multiple of 128, tiles 384/384/232
    (130, 50000, 128, 32768),      # many SBUF-sized tiles, the last partial
    (7, 3001, 32, 1000),           # AWS's default batch of 32 positions, a short batch
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cross_entropy_forward_matches_torch(case, dtype, target):
    N, V, B, chunk = case
    x, t = _logits(N, V, dtype)
    loss, lse = _run(cross_entropy_forward, target, x, t, positions_per_batch=B, chunk_size=chunk,
                     dtype=nl.float32 if dtype == "float32" else nl.bfloat16)
    tx = torch.from_numpy(x.astype(np.float32))
    ref = F.cross_entropy(tx, torch.from_numpy(t).long(), reduction="none").numpy()
    ref_lse = torch.logsumexp(tx, 1).numpy()
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == "float32" else dict(rtol=1e-2, atol=4e-2)
    np.testing.assert_allclose(np.asarray(loss, np.float32), ref, **tol)
    np.testing.assert_allclose(np.asarray(lse, np.float32), ref_lse, **tol)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CE_CASES[:2], ids=lambda c: "-".join(map(str, c)))
def test_cross_entropy_backward_matches_autograd(case, reduction, dtype, target):
    N, V, B, chunk = case
    x, t = _logits(N, V, dtype, seed=1)
    out_dt = nl.float32 if dtype == "float32" else nl.bfloat16
    _, lse = _run(cross_entropy_forward, target, x, t, positions_per_batch=B, chunk_size=chunk, dtype=out_dt)
    tx = torch.from_numpy(x.astype(np.float32)).requires_grad_()
    F.cross_entropy(tx, torch.from_numpy(t).long(), reduction=reduction).backward()
    want = tx.grad.numpy()
    inplace = reduction == "sum"
    logits = x.copy()
    grad = _run(cross_entropy_backward, target, logits, t, lse, reduction=reduction, positions_per_batch=B,
                chunk_size=chunk, dtype=out_dt, inplace=inplace)
    g = 1.0 / N if reduction == "mean" else 1.0
    if dtype == "float32":
        tol = dict(rtol=1e-5, atol=1e-6 * g)
    else:   # a bf16 lse is off by up to half an ulp (1/32 near 10): softmax by ~3%
        tol = dict(rtol=5e-2, atol=1e-3 * g)
    np.testing.assert_allclose(np.asarray(grad, np.float32), want, **tol)
    if inplace:   # AWS's inplace=True writes the gradient over the logits
        np.testing.assert_array_equal(np.asarray(logits, np.float32), np.asarray(grad, np.float32))
    else:
        np.testing.assert_array_equal(logits, x)


@pytest.mark.parametrize("target", TARGETS)
def test_cross_entropy_lnc_grid(target, monkeypatch):
    """Positions split over an LNC=2 launch (odd count: the last program takes the extra row),
    through AWS's harness entry nki.cpu_simulate(kernel)[lnc](**inputs)."""
    monkeypatch.setenv("NKI_NC_VERSION", {"trn2": "gen3", "trn3": "gen4"}[target])
    x, t = _logits(131, 2000, "bfloat16", seed=2)
    loss, lse = nki.cpu_simulate(cross_entropy_forward)[2](logits_hbm=x, targets_hbm=t,
                                                           positions_per_batch=64, chunk_size=1024)
    tx = torch.from_numpy(x.astype(np.float32))
    ref = F.cross_entropy(tx, torch.from_numpy(t).long(), reduction="none")
    np.testing.assert_allclose(np.asarray(loss, np.float32), ref.numpy(), rtol=1e-2, atol=4e-2)
    grad = nki.cpu_simulate(cross_entropy_backward)[2](logits_hbm=x.copy(), targets_hbm=t, lse_state_hbm=lse,
                                                       positions_per_batch=64, chunk_size=1024)
    tx = torch.from_numpy(x.astype(np.float32)).requires_grad_()
    F.cross_entropy(tx, torch.from_numpy(t).long()).backward()
    np.testing.assert_allclose(np.asarray(grad, np.float32), tx.grad.numpy(), rtol=5e-2, atol=1e-3 / 131)


def test_cross_entropy_masked_vocabulary_tile():
    """A whole first tile of -inf logits (a masked vocabulary range) gives no NaN."""
    x, t = _logits(16, 3000, "float32", seed=3)
    x[:, :1000] = -np.inf
    t[:] = np.maximum(t, 1000)
    loss, lse = cross_entropy_forward(x, t, positions_per_batch=16, chunk_size=1000, dtype=nl.float32)
    ref = F.cross_entropy(torch.from_numpy(x), torch.from_numpy(t).long(), reduction="none").numpy()
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=2e-5)


def test_cross_entropy_rejects_bad_input():
    x = np.zeros((4, 100), np.float32)
    with pytest.raises(nki.errors.ShapeMismatchError, match="cross_entropy_forward: targets_hbm must be"):
        cross_entropy_forward(x, np.zeros(5, np.int32))
    with pytest.raises(nki.errors.ShapeMismatchError, match="positions_per_batch"):
        cross_entropy_forward(x, np.zeros(4, np.int32), positions_per_batch=256)
    with pytest.raises(nki.errors.UnsupportedError, match="cross_entropy_backward: reduction"):
        cross_entropy_backward(x, np.zeros(4, np.int32), np.zeros(4, np.float32), reduction="none")
    with pytest.raises(nki.errors.UnsupportedError, match="integer class indices"):
        cross_entropy_forward(x, np.zeros(4, np.float32))


def test_cross_entropy_forward_streams_on_trn2():
    """Tiles do not wait for each other: the modelled forward stays within 2x of VectorE's
    one unavoidable pass (the target select) over the logits."""
    N, V = 256, 32000
    x, t = _logits(N, V, "bfloat16")
    r = nki.benchmark(cross_entropy_forward, target="trn2")(x, t, positions_per_batch=128)
    vector_pass_ns = N * V / 128 / 0.96
    assert r.latency_ns < 2.0 * vector_pass_ns


# ------------------------------------------------------------------------------- top-k
def _check_topk(x, values, indices, k):
    """Values exactly torch.topk's (sorted), indices distinct and pointing at those values;
    where a value is not tied, the index is torch's too."""
    xf = x.astype(np.float32)
    ref = torch.topk(torch.from_numpy(xf), k)
    v = np.asarray(values, np.float32).reshape(-1, k)
    i = np.asarray(indices).astype(np.int64).reshape(-1, k)
    np.testing.assert_array_equal(v, ref.values.numpy().reshape(-1, k))
    rows = xf.reshape(-1, xf.shape[-1])
    np.testing.assert_array_equal(np.take_along_axis(rows, i, 1), v)
    assert all(len(set(r)) == k for r in i)
    unique = np.array([[np.count_nonzero(rows[b] == val) == 1 for val in v[b]] for b in range(len(v))])
    np.testing.assert_array_equal(i[unique], ref.indices.numpy().reshape(-1, k)[unique])


TOPK_CASES = [  # BxS, V, k
    (200, 1000, 1),      # rows past one tile, one stage
    (130, 50000, 16),    # vocabulary over the 16384-element limit: several stages, tiles of rows
    (8, 50000, 8),       # few rows: the vocabulary spread over all partitions
    (5, 3001, 2),        # padded last stage
    (64, 20000, 16),
    (3, 12, 16 - 4),     # k close to V, V barely over 8
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_rotational_topk_matches_torch(case, dtype, target):
    BxS, V, k = case
    x = np.random.default_rng(BxS + V).standard_normal((BxS, V)).astype(_np_dtype(dtype))
    tc = create_topk_config(inp_shape=x.shape, inp_dtype=x.dtype, k=k, num_programs=1)
    cfg = create_rotational_topk_config(inp_shape=x.shape, topk_config=tc)
    assert isinstance(cfg, nl.NKIObject) and hash(cfg) == hash(create_rotational_topk_config(x.shape, tc))
    values, indices = _run(rotational_topk, target, x, cfg)
    assert values.dtype == x.dtype and indices.dtype == np.uint32
    _check_topk(x, values, indices, k)


@pytest.mark.parametrize("target", TARGETS)
def test_topk_3d_lnc_grid_and_ties(target, monkeypatch):
    """AWS's launcher over [B, S, V] with LNC=2; repeated values come out once per occurrence."""
    monkeypatch.setenv("NKI_NC_VERSION", {"trn2": "gen3", "trn3": "gen4"}[target])
    rng = np.random.default_rng(5)
    x = rng.integers(-50, 50, (3, 7, 30000)).astype(np.float32)   # many ties
    values, indices = topk(x, 16, lnc=2)
    assert values.shape == (3, 7, 16) and indices.shape == (3, 7, 16)
    _check_topk(x, values, indices, 16)


def test_topk_rejects_bad_input():
    with pytest.raises(nki.errors.ShapeMismatchError, match="k must be in"):
        create_topk_config((4, 10), np.float32, 11)
    tc = create_topk_config((4, 100), np.float32, 8, num_programs=2)
    cfg = create_rotational_topk_config((4, 100), tc)
    with pytest.raises(nki.errors.ShapeMismatchError, match="launch has 1"):
        rotational_topk(np.zeros((4, 100), np.float32), cfg)
    with pytest.raises(nki.errors.ShapeMismatchError, match="does not match"):
        rotational_topk[2](np.zeros((4, 99), np.float32), cfg)
    assert isinstance(cfg, RotationalTopkConfig)


# ------------------------------------------------------------------------------- router
def _router_ref(x, w, b, act, k, layout, pre, norm):
    """AWS's router semantics in torch (float64): logits, expert index, affinities."""
    xt = x if layout == 1 else x.T
    lg = xt @ w + (b.reshape(1, -1) if b is not None else 0)
    idx = torch.argsort(-lg, dim=-1, stable=True)[:, :k]
    if pre:
        full = F.softmax(lg, -1) if act == "softmax" else torch.sigmoid(lg)
        if norm:
            sel = torch.zeros_like(full).scatter(1, idx, full.gather(1, idx))
            return lg, idx, sel / sel.sum(1, keepdim=True)
        return lg, idx, full
    top = lg.gather(1, idx)
    top = F.softmax(top, -1) if act == "softmax" else torch.sigmoid(top)
    return lg, idx, torch.zeros_like(lg).scatter(1, idx, top)


ROUTER_CASES = [  # T, H, E, k, x_hbm_layout, act, router_pre_norm, norm_topk_prob, bias
    (200, 256, 64, 2, 0, "softmax", True, False, True),
    (200, 256, 64, 2, 1, "softmax", False, False, True),
    (130, 200, 8, 8, 1, "sigmoid", True, True, False),      # H not a multiple of 128
    (64, 384, 128, 16, 0, "sigmoid", False, False, True),   # k over AWS's 8
    (300, 128, 5, 1, 1, "softmax", True, True, True),       # E under max8's 8
    (100, 256, 40, 3, 0, "softmax", True, True, False),
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_router_topk_matches_torch(case, dtype, target):
    T, H, E, k, layout, act, pre, norm, bias = case
    rng = np.random.default_rng(T + E)
    dt = _np_dtype(dtype)
    x = (rng.standard_normal((T, H) if layout == 1 else (H, T)) * 0.5).astype(dt)
    w = (rng.standard_normal((H, E)) * 0.1).astype(dt)
    b = (rng.standard_normal((1, E)) * 0.1).astype(dt) if bias else None
    lg, ei, ea = _run(router_topk, target, x, w, b, None, None, None, act, k, layout, 0,
                      router_pre_norm=pre, norm_topk_prob=norm)
    t64 = lambda a: torch.from_numpy(a.astype(np.float64))  # noqa: E731
    rl, ri, ra = _router_ref(t64(x), t64(w), t64(b) if bias else None, act, k, layout, pre, norm)
    assert lg.dtype == dt and ea.dtype == dt and ei.dtype == np.uint32
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(lg, np.float64), rl.numpy(), **tol)
    np.testing.assert_array_equal(ei.astype(np.int64), ri.numpy())
    np.testing.assert_allclose(np.asarray(ea, np.float64), ra.numpy(), **tol)


@pytest.mark.parametrize("target", TARGETS)
def test_router_topk_outputs_in_place_sharded(target):
    """AWS's calling convention: outputs passed in and written; tokens sharded over LNC=2;
    the eager top-k affinities returned as a fourth output."""
    T, H, E, k = 257, 256, 32, 4
    rng = np.random.default_rng(7)
    x = rng.standard_normal((T, H)).astype(np.float32) * 0.5
    w = rng.standard_normal((H, E)).astype(np.float32) * 0.1
    outs = [np.zeros((T, E), np.float32), np.zeros((T, E), np.float32), np.zeros((T, k), np.uint32)]
    res = nki.simulate(router_topk[2], platform_target=target)(
        x, w, None, outs[0], outs[1], outs[2], RouterActFnType.SOFTMAX, k, 1, 0,
        router_pre_norm=False, shard_on_tokens=True, return_eager_affi=True)
    rl, ri, ra = _router_ref(torch.from_numpy(x).double(), torch.from_numpy(w).double(), None, "softmax",
                             k, 1, False, False)
    np.testing.assert_allclose(outs[0], rl.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1], ra.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs[2].astype(np.int64), ri.numpy())
    assert len(res) == 4
    np.testing.assert_allclose(res[3], ra.gather(1, ri).numpy(), rtol=1e-5, atol=1e-6)


def test_router_topk_skips_stores():
    x = np.random.default_rng(8).standard_normal((128, 40)).astype(np.float32)
    w = np.random.default_rng(9).standard_normal((128, 16)).astype(np.float32)
    logits, index = np.zeros((40, 16), np.float32), np.zeros((40, 2), np.uint32)
    _, _, aff = router_topk(x, w, None, logits, None, index, "sigmoid", 2, 0, 0, router_pre_norm=False,
                            skip_store_expert_index=True, skip_store_router_logits=True)
    assert not logits.any() and not index.any()
    assert (np.count_nonzero(aff, axis=1) == 2).all()


def test_router_topk_rejects_bad_input():
    x = np.zeros((256, 64), np.float32)
    with pytest.raises(nki.errors.ShapeMismatchError, match="router_topk: E=600"):
        router_topk(x, np.zeros((256, 600), np.float32), None, None, None, None, "softmax", 2, 0, 0)
    with pytest.raises(nki.errors.ShapeMismatchError, match="k must be in"):
        router_topk(x, np.zeros((256, 8), np.float32), None, None, None, None, "softmax", 9, 0, 0)
    with pytest.raises(nki.errors.ShapeMismatchError, match="has H=64"):
        router_topk(x, np.zeros((256, 8), np.float32), None, None, None, None, "softmax", 2, 1, 0)
    with pytest.raises(nki.errors.UnsupportedError, match="act_fn"):
        router_topk(x, np.zeros((256, 8), np.float32), None, None, None, None, "relu", 2, 0, 0)
