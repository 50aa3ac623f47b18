"""NKI-lib RoPE (``nkilib.core.embeddings.rope.RoPE``) and cumsum
(``nkilib.core.cumsum.cumsum.cumsum``) in the simulator against PyTorch on CPU."""
import ml_dtypes
import numpy as np
import pytest
import torch

import nki
from neuronhw import get_profile
from nkilib.core.cumsum.cumsum import cumsum
from nkilib.core.embeddings.rope import RoPE

BF16 = ml_dtypes.bfloat16


def _t(a):
    return torch.from_numpy(np.asarray(a, np.float32))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_reference(x, cos, sin, contiguous):
    """HF's apply_rotary_pos_emb on AWS's layouts: x [d, B, H, S], cos/sin [d/2, B, S]."""
    q = _t(x).permute(1, 2, 3, 0)                 # B, H, S, d
    c = _t(cos).permute(1, 2, 0)[:, None]         # B, 1, S, d/2
    s = _t(sin).permute(1, 2, 0)[:, None]
    if contiguous:     # rotate_half pairs (i, i + d/2); HF's cos is the frequencies twice
        out = q * torch.cat((c, c), -1) + _rotate_half(q) * torch.cat((s, s), -1)
    else:              # pairs (2i, 2i + 1)
        a, b = q[..., 0::2], q[..., 1::2]
        out = torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)
    return out.permute(3, 0, 1, 2).numpy()


def _rope_inputs(d, B, H, S, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((d, B, H, S)).astype(dtype)
    inv_freq = 10000.0 ** (-np.arange(d // 2) / (d // 2))
    ang = inv_freq[:, None, None] * (np.arange(S) + rng.integers(0, 50, (B, 1)))[None]
    return x, np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


# d_head, B, n_heads, S: prefill, decode (S = 1), S past one block, d_head 32 and 96
ROPE_SHAPES = [(128, 1, 8, 512), (64, 2, 3, 100), (128, 4, 16, 1), (32, 1, 2, 3000), (96, 3, 5, 40)]


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "interleaved"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_matches_hf(shape, dtype, contiguous, target):
    x, cos, sin = _rope_inputs(*shape, dtype)
    out = nki.simulate(RoPE, platform_target=target)(x, cos, sin, contiguous_layout=contiguous)
    ref = _rope_reference(x, cos, sin, contiguous)
    assert out.shape == x.shape and out.dtype == x.dtype
    if dtype == np.float32:
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    else:    # bf16 products and their sum each rounded, as HF's bf16 RoPE rounds them
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_rope_lnc_shard_and_relayout_flag(target, monkeypatch):
    """lnc_shard deals the blocks to kernel[2]'s programs; relayout_in_sbuf changes nothing."""
    monkeypatch.setenv("NKI_NC_VERSION", {"trn2": "gen3", "trn3": "gen4"}[target])
    x, cos, sin = _rope_inputs(64, 2, 4, 700, BF16)
    single = nki.simulate(RoPE, platform_target=target)(x, cos, sin, contiguous_layout=False)
    sharded = nki.cpu_simulate(RoPE)[2](x_in=x, cos=cos, sin=sin, lnc_shard=True,
                                        contiguous_layout=False, relayout_in_sbuf=True)
    np.testing.assert_array_equal(np.asarray(sharded, np.float32), np.asarray(single, np.float32))


def test_rope_rejects_bad_shapes():
    x = np.zeros((64, 1, 2, 8), np.float32)
    half = np.zeros((32, 1, 8), np.float32)
    with pytest.raises(nki.errors.ShapeMismatchError, match="RoPE: d_head must be even"):
        RoPE(np.zeros((63, 1, 2, 8), np.float32), half, half)
    with pytest.raises(nki.errors.ShapeMismatchError, match="RoPE: d_head must be even"):
        RoPE(np.zeros((256, 1, 2, 8), np.float32), np.zeros((128, 1, 8), np.float32),
             np.zeros((128, 1, 8), np.float32))
    with pytest.raises(nki.errors.ShapeMismatchError, match=r"RoPE: sin must be .*\(32, 1, 8\)"):
        RoPE(x, half, np.zeros((32, 1, 9), np.float32))
    with pytest.raises(nki.errors.ShapeMismatchError, match="RoPE: x_in must be"):
        RoPE(np.zeros((64, 8), np.float32), half, half)


def test_rope_latency_near_hbm_roofline():
    """bf16 RoPE moves x in and out once (plus cos/sin once per batch and block of positions):
    its modelled time stays within a sane factor of that traffic at the core's HBM share."""
    x, cos, sin = _rope_inputs(128, 1, 16, 2048, BF16)
    r = nki.benchmark(RoPE, target="trn2")(x, cos, sin)
    p = get_profile("trn2")
    roofline_ns = (2 * x.nbytes + 4 * cos.nbytes) / (p.hbm_bandwidth / p.physical_cores) * 1e9
    assert 0.95 < r.latency_ns / roofline_ns < 1.6, r.summary()


# [B, H] and [B, S, H]: rows not a multiple of 128, one long row, hidden sizes 64..8192, short
# rows packed several to a partition (the last partition partly filled)
CUMSUM_SHAPES = [(1, 8192), (3, 4096), (200, 1000), (4, 10, 4096), (129, 64), (300, 2048),
                 (2, 5, 96), (1000, 64), (2, 301, 256)]


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", CUMSUM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cumsum_matches_torch(shape, dtype, target):
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    out = nki.simulate(cumsum, platform_target=target)(x)
    ref = torch.cumsum(_t(x), dim=-1).numpy()
    assert out.shape == x.shape and out.dtype == x.dtype
    scale = np.abs(ref).max()
    if dtype == np.float32:    # fp32 sums in another order than torch's
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6 * scale)
    else:                      # fp32 sums rounded once to bf16
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=1e-2, atol=4e-3 * scale)


def test_cumsum_axis_and_dtype_rules():
    x = np.ones((4, 8), np.float32)
    np.testing.assert_array_equal(cumsum(x, axis=1), np.cumsum(x, axis=1))
    with pytest.raises(nki.errors.UnsupportedError, match="cumsum: only the last axis"):
        cumsum(x, axis=0)
    with pytest.raises(nki.errors.UnsupportedError, match="cumsum: dtype int32"):
        cumsum(np.ones((4, 8), np.int32))
