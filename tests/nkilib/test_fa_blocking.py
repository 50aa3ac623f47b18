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
