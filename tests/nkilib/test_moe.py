"""moe_cte (blockwise MoE MLP for prefill) and grouped_mm (torch._grouped_mm's kernel) against
PyTorch on CPU, on trn2 and trn3, and grouped_mm's modelled TensorE time against its FLOPs."""
import ml_dtypes
import numpy as np
import pytest
import torch

import nki
import neuronhw
from nki import errors as E
from nkilib.core.moe.moe_cte.blocks import routing_blocks
from nkilib.core.moe.moe_cte.grouped_mm import grouped_mm
from nkilib.core.moe.moe_cte.moe_cte import MoECTESpec, moe_cte
from nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode

BF16 = ml_dtypes.bfloat16
TARGETS = ["trn2", "trn3"]


@pytest.fixture
def target(request, monkeypatch):
    monkeypatch.setenv("NKI_NC_VERSION", {"trn2": "gen3", "trn3": "gen4"}[request.param])
    return request.param


def _f32(x):
    return np.asarray(x, dtype=np.float32)


# ------------------------------------------------------------------ moe_cte
def _routing(T, E, k, B, rng):
    """Top-k routing of T tokens to E experts, as AWS's inputs: masked affinities [(T+1)*E, 1],
    token_position_to_id [N*B] (padding id T) and block_to_expert [N, 1]."""
    logits = rng.standard_normal((T, E)).astype(np.float32)
    top = np.argsort(-logits, axis=1)[:, :k]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    aff = np.zeros((T + 1, E), np.float32)
    for t in range(T):
        aff[t, top[t]] = p[t, top[t]]
    return (aff, *routing_blocks(top, E, B))


def _moe_inputs(dtype, T=300, H=256, I=384, E=4, k=2, B=256, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((T + 1, H)).astype(np.float32)
    h[T] = 0.0                                       # the padding row
    wgu = (rng.standard_normal((E, H, 2, I)) / np.sqrt(H)).astype(np.float32)
    wd = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    aff, pos, b2e = _routing(T, E, k, B, rng)
    cast = lambda x: x.astype(dtype)
    return cast(h), cast(aff.reshape(-1, 1)), cast(wgu), cast(wd), pos, b2e, B


def _moe_ref(h, aff, wgu, wd, act=torch.nn.functional.silu, gclamp=None):
    """The MoE from the routing itself (not the blocks): sum over a token's experts."""
    h, aff, wgu, wd = (torch.from_numpy(_f32(x)).double() for x in (h, aff, wgu, wd))
    E = wgu.shape[0]
    aff = aff.reshape(-1, E)
    out = torch.zeros_like(h)
    for e in range(E):
        g, u = h @ wgu[e, :, 0, :], h @ wgu[e, :, 1, :]
        if gclamp:
            g = g.clamp(*gclamp)
        out += aff[:, e:e + 1] * ((act(g) * u) @ wd[e])
    return out.numpy()


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-4), (BF16, 3e-2)])
def test_moe_cte_matches_torch(target, dtype, tol):
    args = _moe_inputs(dtype)
    out = nki.simulate(moe_cte, platform_target=target)(*args, spec=MoECTESpec())
    ref = _moe_ref(*args[:4])
    assert out.shape == ref.shape and out.dtype == np.dtype(dtype)
    err = np.abs(_f32(out) - ref).max() / np.abs(ref).max()
    assert err < tol, err


def test_moe_cte_options():
    """GELU, a gate clamp, and conditions stopping after the first block."""
    h, aff, wgu, wd, pos, b2e, B = _moe_inputs(np.float32, T=200, H=128, I=200, E=2, k=1, B=128)
    gelu = lambda x: torch.nn.functional.gelu(x)
    out = nki.simulate(moe_cte)(h, aff, wgu, wd, pos, b2e, B, activation_function=ActFnType.GELU,
                                gate_clamp_lower_limit=-1.0, gate_clamp_upper_limit=1.0)
    ref = _moe_ref(h, aff, wgu, wd, act=gelu, gclamp=(-1.0, 1.0))
    np.testing.assert_allclose(out, ref, atol=1e-4 * np.abs(ref).max())
    cond = np.zeros(len(b2e) + 1, np.int32)
    cond[0] = 1
    out1 = nki.simulate(moe_cte)(h, aff, wgu, wd, pos, b2e, B, conditions=cond)
    toks = pos[:B][pos[:B] < 200]
    rest = np.setdiff1d(np.arange(201), toks)
    assert np.abs(out1[toks]).max() > 0 and np.all(out1[rest] == 0)


def test_moe_cte_rejects():
    h, aff, wgu, wd, pos, b2e, B = _moe_inputs(np.float32, T=100, H=128, I=128, E=2, k=1, B=128)
    with pytest.raises(E.UnsupportedError, match="moe_cte: quantization"):
        nki.simulate(moe_cte)(h, aff, wgu, wd, pos, b2e, B, gate_up_proj_scale=wd)
    with pytest.raises(E.ShapeMismatchError, match="moe_cte: down_proj_weight"):
        nki.simulate(moe_cte)(h, aff, wgu, wd[:, :64], pos, b2e, B)
    bad = pos.copy()
    bad[5] = 101                # past the padding row
    with pytest.raises(E.IndexOutOfBoundsError, match="dma_copy: indirect src offset"):
        nki.simulate(moe_cte)(h, aff, wgu, wd, bad, b2e, B)


def test_moe_cte_padding_row_is_never_read_into_the_output():
    """Padding slots gather the padding row (here NaN) and are dropped at the scatter: the
    output's padding row stays zero and no NaN reaches a token's row."""
    h, aff, wgu, wd, pos, b2e, B = _moe_inputs(np.float32, T=150, H=128, I=128, E=3, k=2, B=128)
    ref = _moe_ref(h, aff, wgu, wd)
    h[150] = np.nan
    for scaling in (ExpertAffinityScaleMode.POST_SCALE, ExpertAffinityScaleMode.NO_SCALE):
        out = nki.simulate(moe_cte)(h, aff, wgu, wd, pos, b2e, B,
                                    expert_affinities_scaling_mode=scaling)
        assert np.all(out[150] == 0) and np.isfinite(out).all()
        if scaling == ExpertAffinityScaleMode.POST_SCALE:
            np.testing.assert_allclose(out[:150], ref[:150], atol=1e-4 * np.abs(ref).max())


# ------------------------------------------------------------------ grouped_mm
def _gmm_inputs(dtype, sizes, K, N, tail=0, seed=0):
    rng = np.random.default_rng(seed)
    M = sum(sizes) + tail
    a = rng.standard_normal((M, K)).astype(dtype)
    b = (rng.standard_normal((len(sizes), K, N)) / np.sqrt(K)).astype(dtype)
    return a, b, np.cumsum(sizes).astype(np.int32)


def _gmm_ref(a, b, offs):
    a, b = torch.from_numpy(_f32(a)), torch.from_numpy(_f32(b))
    out = torch.zeros(a.shape[0], b.shape[2])
    s = 0
    for g, e in enumerate(offs.tolist()):
        out[s:e] = a[s:e].double().matmul(b[g].double()).float()
        s = e
    return out.numpy()


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (BF16, 1e-2)])
def test_grouped_mm_matches_torch(target, dtype, tol):
    a, b, offs = _gmm_inputs(dtype, [70, 0, 200, 130, 1], K=300, N=640, tail=9)
    out = nki.simulate(grouped_mm, platform_target=target)(a, b, offs)
    ref = _gmm_ref(a, b, offs)
    assert out.shape == ref.shape and out.dtype == np.dtype(dtype)
    err = np.abs(_f32(out) - ref).max() / np.abs(ref).max()
    assert err < tol, err
    assert np.all(_f32(out)[offs[-1]:] == 0)


def test_grouped_mm_agrees_with_torch_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    a, b, offs = _gmm_inputs(BF16, [128, 0, 37, 219], K=256, N=512)
    ta = torch.from_numpy(_f32(a)).bfloat16()
    tb = torch.from_numpy(_f32(b)).bfloat16()
    try:
        ref = torch._grouped_mm(ta, tb, offs=torch.from_numpy(offs)).float().numpy()
    except (RuntimeError, NotImplementedError) as ex:     # no CPU kernel in this torch
        pytest.skip(f"torch._grouped_mm on CPU: {ex}")
    out = _f32(nki.simulate(grouped_mm)(a, b, offs))
    np.testing.assert_allclose(out, ref, atol=2e-2 * np.abs(ref).max())


def test_grouped_mm_rejects():
    a, b, offs = _gmm_inputs(np.float32, [10, 20], K=64, N=64)
    with pytest.raises(E.ShapeMismatchError, match="grouped_mm: .*disagree"):
        nki.simulate(grouped_mm)(a[:, :32], b, offs)
    with pytest.raises(E.IndexOutOfBoundsError, match="grouped_mm: offs"):
        nki.simulate(grouped_mm)(a, b, np.array([20, 10], np.int32))


@pytest.mark.parametrize("target", TARGETS)
def test_grouped_mm_timing_near_tensore_peak(target):
    a, b, offs = _gmm_inputs(BF16, [512, 0, 384, 128], K=1024, N=2048)
    r = nki.benchmark(grouped_mm, target=target)(a, b, offs)
    flops = 2.0 * int(offs[-1]) * 1024 * 2048
    peak_ns = flops / (neuronhw.get_profile(target).core_tflops["bfloat16"] * 1e3)
    # summed from the timeline: engine_busy_ns averages over the LNC=2 pair, one of them idle
    tensor_ns = sum(ev[3] for ev in r.timeline if ev[1] == "tensor")
    # TensorE time over the FLOPs at peak: transposes and partial tiles cost a little extra
    assert 0.9 * peak_ns <= tensor_ns <= 1.6 * peak_ns, (tensor_ns, peak_ns)
    # the 128-row group reads 4 MiB of weights for 0.5 GFLOP: HBM-bound, hence the slack
    assert r.latency_ns <= 2.5 * peak_ns, (r.latency_ns, peak_ns)
