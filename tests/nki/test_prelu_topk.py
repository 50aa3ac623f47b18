"""``nl.prelu`` (Activation2's parametric ReLU, slope = relu_param) and ``nisa.topk`` (GpSimd
top-K over a 16-partition snake), against NumPy written from AWS's documentation."""
import ml_dtypes as mld
import numpy as np
import pytest

import nki
import nki.errors as E
import nki.isa as nisa
import nki.language as nl

RNG = np.random.default_rng(5)


def _sbuf(x):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    return t


def _out(t):
    o = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=o, src=t)
    return o


@pytest.mark.parametrize("vector", [False, True])
def test_prelu_slope_is_relu_param(vector):
    x = RNG.standard_normal((64, 3, 16)).astype(np.float32)
    a = (RNG.uniform(0, 0.5, (64, 1)) if vector else np.full((64, 1), 0.2)).astype(np.float32)

    @nki.jit(platform_target="trn3")
    def k(x, a):
        d = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        slope = _sbuf(a) if vector else 0.2
        nisa.activate2(dst=d, op=nl.prelu, data=_sbuf(x), imm0=2.0, imm1=0.0, op0=nl.multiply,
                       op1=nl.bypass, relu_param=slope)
        return _out(d)
    y = 2 * x
    want = np.where(y >= 0, y, a[:, :, None] * y)
    np.testing.assert_allclose(k(x, a), want, rtol=1e-6)


def test_prelu_needs_relu_param():
    x = RNG.standard_normal((8, 8)).astype(np.float32)

    @nki.jit(platform_target="trn3")
    def k(x):
        d = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=d, op=nl.prelu, data=_sbuf(x))
        return _out(d)
    with pytest.raises(E.NkiRuleError, match="relu_param"):
        k(x)
    with pytest.raises(TypeError, match="activate2"):
        nl.prelu(x)


def _topk_kernel(k_):
    @nki.jit
    def k(x, n):
        P = x.shape[0]
        v = nl.ndarray((P, k_), dtype=nl.bfloat16, buffer=nl.sbuf)
        i = nl.ndarray((P, k_), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.topk(val_dst=v, idx_dst=i, src=_sbuf(x), n=n)
        return _out(v), _out(i)
    return k


@pytest.mark.parametrize("P,n,K", [(16, 42, 8), (32, 200, 17), (128, 1024, 64), (16, 8, 8)])
def test_topk_of_each_snake(P, n, K):
    cols = -(-n // 16) + 1          # a spare column: only the first n snake elements count
    x = RNG.permutation(P * cols).astype(np.float32).reshape(P, cols) / 7   # distinct in bf16
    x = x.astype(mld.bfloat16)
    vals, idx = _topk_kernel(K)(x, n)
    for g in range(P // 16):
        snake = x[g * 16:(g + 1) * 16].astype(np.float32).T.reshape(-1)[:n]   # s -> (s % 16, s // 16)
        top = np.sort(snake)[-K:]                                             # ascending
        for p in range(g * 16, (g + 1) * 16):
            np.testing.assert_array_equal(vals[p].astype(np.float32), top)
            np.testing.assert_array_equal(snake[idx[p].astype(np.int64)], top)


def test_topk_cost_is_4n_plus_k_gpsimd_cycles():
    x = RNG.standard_normal((16, 64)).astype(mld.bfloat16)
    lat = {}
    for n in (256, 1024):
        r = nki.benchmark(_topk_kernel(8), target="trn2")(x, n)
        lat[n] = r.engine_busy_ns["gpsimd"]
    # 768 more elements cost 4 * 768 more cycles (the clock from the busy times themselves).
    assert lat[1024] > lat[256]
    per_cycle = (lat[1024] - lat[256]) / (4 * 768)
    assert per_cycle * (4 * 256 + 8) == pytest.approx(lat[256], rel=0.1), lat


@pytest.mark.parametrize("kw,err,match", [
    (dict(P=16, n=42, K=8, dtype=np.float32), E.DtypeLegalityError, "bfloat16"),
    (dict(P=8, n=42, K=8), E.ShapeMismatchError, "multiple of 16"),
    (dict(P=16, n=4, K=2), E.NkiRuleError, "8 <= n"),
    (dict(P=16, n=42, K=50), E.NkiRuleError, "K <= n"),
    (dict(P=16, n=100, K=8, cols=3), E.ShapeMismatchError, "needs 7"),
])
def test_topk_rules(kw, err, match):
    cols = kw.get("cols", -(-kw["n"] // 16) or 1)
    x = RNG.standard_normal((kw["P"], cols)).astype(kw.get("dtype", mld.bfloat16))
    with pytest.raises(err, match=match):
        _topk_kernel(kw["K"])(x, kw["n"])
