"""The timing model tells a well blocked FlashAttention forward from a poorly blocked one, and
never models attention_cte faster than TensorE's peak allows."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import nki
import nki.isa as nisa
import nki.language as nl
from neuronhw import get_profile
from nkilib.core.attention.attention_cte import attention_cte

BF16 = ml_dtypes.bfloat16


@nki.jit
def _poor_attention(q, k, v, scale=1.0):
    """Non-causal attention of q (1, S, d), k (1, d, S), v (1, S, d) in 128-key blocks, one
    step after another: each block's scores go through an online softmax before the next
    block's matmul is issued, so no engine overlaps another's work."""
    P = 128
    _, S, d = q.shape
    out = nl.ndarray((1, S, d), dtype=q.dtype, buffer=nl.shared_hbm)
    for g in range(S // P):
        q_sb = nl.ndarray((P, d), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_sb, src=q[0, g * P:(g + 1) * P, :])
        qT_ps = nl.ndarray((d, P), dtype=q.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=qT_ps, data=q_sb)
        qT = nl.ndarray((d, P), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=qT, src=qT_ps)
        m = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=-3.0e38)
        l_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=l_sum, value=0.0)
        acc = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        for j in range(S // P):
            k_sb = nl.ndarray((d, P), dtype=k.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=k_sb, src=k[0, :, j * P:(j + 1) * P])
            v_sb = nl.ndarray((P, d), dtype=v.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=v_sb, src=v[0, j * P:(j + 1) * P, :])
            s_ps = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=s_ps, stationary=qT, moving=k_sb)
            mx = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=mx, op=nl.max, data=s_ps, axis=1)
            m_new = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=m_new, data1=m, data2=mx, op=nl.maximum)
            bias = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=bias, op=nl.copy, data=m_new, scale=-scale)
            p = nl.ndarray((P, P), dtype=q.dtype, buffer=nl.sbuf)
            row = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=p, op=nl.exp, data=s_ps, scale=scale, bias=bias,
                            reduce_op=nl.add, reduce_res=row)
            corr = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=corr, op=nl.exp, data=m, scale=scale, bias=bias)
            nisa.tensor_copy(dst=m, src=m_new)
            nisa.scalar_tensor_tensor(dst=l_sum, data=l_sum, op0=nl.multiply, operand0=corr,
                                      op1=nl.add, operand1=row)
            pT_ps = nl.ndarray((P, P), dtype=q.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=pT_ps, data=p)
            pT = nl.ndarray((P, P), dtype=q.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pT, src=pT_ps)
            pv = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=pv, stationary=pT, moving=v_sb)
            nisa.scalar_tensor_tensor(dst=acc, data=acc, op0=nl.multiply, operand0=corr,
                                      op1=nl.add, operand1=pv)
        inv = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=l_sum)
        o = nl.ndarray((P, d), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o, data=acc, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[0, g * P:(g + 1) * P, :], src=o)
    return out


def _inputs(S, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, S, d, generator=g).to(torch.bfloat16).float() for _ in range(3))
    kT = k.transpose(1, 2).contiguous()
    ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    return [t.numpy().astype(BF16) for t in (q, kT, v)], ref.numpy()


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_poorly_blocked_attention_models_slower(target):
    S, d = 1024, 128
    (q, k, v), ref = _inputs(S, d)
    scale = 1.0 / math.sqrt(d)
    poor = nki.benchmark(_poor_attention, target=target)(q, k, v, scale=scale)
    good = nki.benchmark(attention_cte, target=target)(q, k, v, scale=scale, causal_mask=False)
    # both compute attention: the comparison is between two blockings of the same math
    for r in (poor, good):
        np.testing.assert_allclose(np.asarray(r.outputs, np.float32)[0], ref[0], atol=2e-2, rtol=2e-2)
    assert poor.latency_ns > 2.5 * good.latency_ns, (poor.latency_ns, good.latency_ns)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_attention_cte_within_tensor_engine_roofline(target, causal):
    S, d = 2048, 128
    (q, k, v), _ = _inputs(S, d)
    r = nki.benchmark(attention_cte, target=target)(q, k, v, scale=d ** -0.5, causal_mask=causal)
    # the useful matmul FLOPs (QK^T and PV; causal: the lower triangle and its diagonal
    # blocks at least) at one core's bf16 peak bound the latency from below
    flops = 4 * S * S * d * (0.5 if causal else 1.0)
    peak_ns = flops / (get_profile(target).core_tflops["bfloat16"] * 1e12) * 1e9
    assert r.latency_ns >= peak_ns, (r.latency_ns, peak_ns)
    assert r.engine_busy_ns["tensor"] <= r.latency_ns


def _masked_reference(q, k, v, scale, causal, window, cap):
    """q (B, Sq, d), k and v (Bkv, Skv, d) -> softmax(s) v and logsumexp(s) for the masked,
    capped scores s."""
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = q @ k.transpose(-1, -2) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None]
    mask = (j > i) if causal else torch.zeros_like(j > i)
    if window:
        mask = mask | (j < i - window + 1)
    s = s.masked_fill(mask, -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [  # B, Bkv, S, d, causal, window, softcap
    (4, 2, 200, 32, True, 0, None), (1, 1, 1100, 64, True, 300, None),
    (2, 2, 700, 64, False, 0, 30.0), (1, 1, 640, 128, False, 0, None)],
    ids=lambda c: "-".join(map(str, c)))
def test_attention_cte_trn3_fast_exp_matches_torch(case, dtype):
    """On NeuronCore-v4 the kernel takes the row maximum on ScalarE (Activation2) and the
    exp on VectorE (exponential): same results as PyTorch on CPU."""
    B, Bkv, S, d, causal, window, cap = case
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*sh, generator=g) for sh in ((B, S, d), (Bkv, S, d), (Bkv, S, d)))
    if dtype == "bfloat16":
        q, k, v = (t.to(torch.bfloat16).float() for t in (q, k, v))
    cast = (lambda t: t.numpy().astype(BF16)) if dtype == "bfloat16" else (lambda t: t.numpy())
    scale = d ** -0.5
    r = nki.benchmark(attention_cte, target="trn3")(
        cast(q), cast(k.transpose(1, 2).contiguous()), cast(v), scale=scale, causal_mask=causal,
        sliding_window=window, logit_softcap=cap, cache_softmax=True)
    out, neg_max, sum_recip = r.outputs
    ref, lse = _masked_reference(q, k, v, scale, causal, window, cap)
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), ref.numpy(), atol=tol, rtol=tol)
    with np.errstate(divide="ignore"):     # padding rows past the sequence hold 0
        got = -(np.asarray(neg_max) + np.log(np.asarray(sum_recip)))  # (B, 128, groups)
    got = got.transpose(0, 2, 1).reshape(B, -1)[:, :S]
    np.testing.assert_allclose(got, lse.numpy(), atol=1e-4, rtol=1e-4)
