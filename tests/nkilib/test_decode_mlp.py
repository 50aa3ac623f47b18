"""NKI-lib decode attention (attention_tkg, contiguous and paged KV cache) and the gated MLP in
the simulator against PyTorch on CPU, on trn2 and trn3; modelled-timing checks that decode is
bandwidth-bound and the MLP keeps TensorE busy."""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nki
from neuronhw import get_profile
from nki.simulator.timing import Timeline
from nkilib.core.attention.attention_tkg import AttnTKGConfig, attention_tkg
from nkilib.core.mlp.mlp import mlp
from nkilib.core.utils.common_types import ActFnType, NormType, QuantizationType

BF16 = ml_dtypes.bfloat16
TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def _cast(t, dtype):
    """A torch tensor rounded to the kernel's dtype (the reference sees the same inputs) and
    the NumPy array the kernel gets."""
    if dtype == "bfloat16":
        t = t.to(torch.bfloat16).float()
        return t, t.numpy().astype(BF16)
    return t, t.numpy().copy()


# ------------------------------------------------------------------ decode attention
def _sdpa_ref(q, ks, vs, scale):
    """q [B, H, s, d]; ks/vs per sequence [Hkv, T, d] (every key it may see, the active ones
    last). Query i sits at position T - s + i and sees positions <= its own."""
    B, H, s, d = q.shape
    out = []
    for b in range(B):
        k, v = ks[b], vs[b]
        T, g = k.shape[1], H // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        allowed = torch.arange(T)[None] <= torch.arange(T - s, T)[:, None]
        out.append(F.scaled_dot_product_attention(q[b:b + 1], k[None], v[None], attn_mask=allowed,
                                                  scale=scale)[0])
    return torch.stack(out)


def _decode_inputs(B, H, Hkv, s, d, lens, dtype, cache, active, seed=0):
    """Kernel arguments and the SDPA reference for one decode step.

    cache: "paged<block_size>" (vLLM's layout: a shuffled block table with spare blocks), or
    "contig" / "contig_tp" (per sequence, K as [B, Hkv, d, S] or [B, Hkv, S, d]).
    active: new tokens' K/V passed separately (AWS's convention) instead of already cached."""
    g = torch.Generator().manual_seed(seed)
    scale = d ** -0.5
    q, qn = _cast(torch.randn(B, H, s, d, generator=g), dtype)
    args = dict(q=np.ascontiguousarray(qn.transpose(0, 3, 1, 2)), k_active=None, v_active=None,
                context_lens=np.array(lens, np.int32), scale=scale)
    if cache.startswith("paged"):
        bs = int(cache[5:])
        nblk = [-(-L // bs) for L in lens]
        NB = sum(nblk) + 3
        kc, kn = _cast(torch.randn(NB, bs, Hkv, d, generator=g), dtype)
        vc, vn = _cast(torch.randn(NB, bs, Hkv, d, generator=g), dtype)
        perm = torch.randperm(NB, generator=g)
        table = torch.full((B, max(nblk) + 2), NB - 1, dtype=torch.int32)   # padding: a valid id
        used = 0
        for b in range(B):
            table[b, :nblk[b]] = perm[used:used + nblk[b]]
            used += nblk[b]

        def seq(cache_t, b):     # gather the sequence's pages through the table
            return cache_t[table[b, :nblk[b]].long()].reshape(-1, Hkv, d)[:lens[b]].transpose(0, 1)
        ks = [seq(kc, b) for b in range(B)]
        vs = [seq(vc, b) for b in range(B)]
        args.update(k_prior=kn, v_prior=vn, active_blocks_table=table.numpy())
    else:
        S = max(lens) + 5
        kc, kn = _cast(torch.randn(B, Hkv, S, d, generator=g), dtype)
        vc, vn = _cast(torch.randn(B, Hkv, S, d, generator=g), dtype)
        tp = cache == "contig_tp"
        args.update(k_prior=kn if tp else np.ascontiguousarray(kn.transpose(0, 1, 3, 2)),
                    v_prior=vn, cfg=AttnTKGConfig(tp_k_prior=tp))
        ks = [kc[b, :, :lens[b]] for b in range(B)]
        vs = [vc[b, :, :lens[b]] for b in range(B)]
    if active:
        ka, kan = _cast(torch.randn(B, Hkv, s, d, generator=g), dtype)
        va, van = _cast(torch.randn(B, Hkv, s, d, generator=g), dtype)
        args.update(k_active=np.ascontiguousarray(kan.transpose(0, 1, 3, 2)), v_active=van)
        ks = [torch.cat([ks[b], ka[b]], 1) for b in range(B)]
        vs = [torch.cat([vs[b], va[b]], 1) for b in range(B)]
    return args, _sdpa_ref(q, ks, vs, scale)


def _check_decode(out, ref, dtype):
    got = np.asarray(out, np.float32).transpose(0, 1, 3, 2)      # [B, H, d, s] -> [B, H, s, d]
    np.testing.assert_allclose(got, ref.numpy(), atol=TOL[dtype], rtol=TOL[dtype])


DECODE_CASES = [  # B, H, Hkv, s_active, d, context lengths, cache, active K/V separate
    (3, 4, 4, 1, 64, [37, 100, 1], "paged16", False),           # GQA 1, one-token sequence
    (2, 8, 2, 4, 64, [300, 45], "paged32", True),               # GQA 4, AWS-style active tokens
    (3, 16, 2, 4, 128, [129, 517, 64], "paged16", False),       # GQA 8, lengths across blocks
    (1, 8, 1, 1, 128, [1000], "paged128", True),                # big blocks split over partitions
    (2, 8, 2, 4, 64, [37, 290], "contig", False),               # K stored transposed (AWS default)
    (2, 16, 2, 1, 128, [511, 130], "contig_tp", True),          # GQA 8, K transposed on chip
]


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_attention_tkg_matches_sdpa(case, dtype, target):
    B, H, Hkv, s, d, lens, cache, active = case
    args, ref = _decode_inputs(B, H, Hkv, s, d, lens, dtype, cache, active)
    out, k_out = nki.simulate(attention_tkg, platform_target=target)(**args)
    assert k_out is None
    _check_decode(out, ref, dtype)


def test_attention_tkg_aws_forms():
    """AWS's 3-D forms (one kv head: k_active [B, d, s], a block cache [blocks, block_len, d]),
    a cache valid up to cfg.curr_sprior, a caller's out, and an LNC=2 launch."""
    args, ref = _decode_inputs(2, 4, 1, 2, 32, [40, 70], "float32", "paged16", True, seed=1)
    args["k_prior"], args["v_prior"] = args["k_prior"][:, :, 0], args["v_prior"][:, :, 0]
    args["k_active"] = args["k_active"][:, 0]
    _check_decode(attention_tkg(**args)[0], ref, "float32")

    args, ref = _decode_inputs(2, 8, 2, 3, 64, [90, 90], "float32", "contig", True, seed=2)
    args["context_lens"] = None
    args["cfg"] = AttnTKGConfig(bs=2, q_head=8, s_active=3, d_head=64, curr_sprior=90)
    out = np.zeros((2, 8, 64, 3), np.float32)
    attention_tkg(**args, out=out)
    _check_decode(out, ref, "float32")

    args, ref = _decode_inputs(3, 8, 2, 4, 64, [200, 31, 77], "bfloat16", "paged16", False, seed=3)
    _check_decode(nki.cpu_simulate(attention_tkg)[2](**args)[0], ref, "bfloat16")


def test_attention_tkg_rejects_what_it_does_not_cover():
    args, _ = _decode_inputs(1, 4, 2, 1, 32, [20], "float32", "paged16", False)
    with pytest.raises(nki.errors.UnsupportedError, match="attention sinks"):
        attention_tkg(**args, sink=np.zeros((4, 1), np.float32))
    with pytest.raises(nki.errors.UnsupportedError, match="cfg.fuse_rope"):
        attention_tkg(**args, cfg=AttnTKGConfig(fuse_rope=True))
    with pytest.raises(nki.errors.ShapeMismatchError, match="not a multiple of 2 kv heads"):
        attention_tkg(**dict(args, q=np.zeros((1, 32, 3, 1), np.float32)))
    with pytest.raises(nki.errors.ShapeMismatchError, match="cfg.d_head"):
        attention_tkg(**args, cfg=AttnTKGConfig(d_head=64))
    with pytest.raises(nki.errors.IndexOutOfBoundsError, match="context length 9999"):
        attention_tkg(**dict(args, context_lens=np.array([9999], np.int32)))
    with pytest.raises(nki.errors.DtypeLegalityError, match="v_prior is bfloat16"):
        attention_tkg(**dict(args, v_prior=args["v_prior"].astype(BF16)))


def _hbm_bytes_per_ns(target):
    return Timeline(get_profile(target)).hbm_bytes_per_ns


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_attention_tkg_is_bandwidth_bound(target):
    """Modelled latency within 3x of (KV bytes) / (one core's HBM share), growing with the
    context about as fast as the bytes do. A paged cache on trn2 too (one indirect DMA per
    fold; its folds are shorter, so it reaches about 40% of the HBM rate)."""
    lat = {}
    for S in (4096, 8192):
        args, _ = _decode_inputs(4, 16, 2, 4, 128, [S] * 4, "bfloat16", "contig", False)
        lat[S] = nki.benchmark(attention_tkg, target=target)(**args).latency_ns
        roofline = 4 * 2 * S * 128 * 2 * 2 / _hbm_bytes_per_ns(target)
        assert lat[S] < 3 * roofline, (S, lat[S], roofline)
    slope = (lat[8192] - lat[4096]) / (4 * 2 * 4096 * 128 * 2 * 2 / _hbm_bytes_per_ns(target))
    assert 1.0 <= slope < 2.0, slope     # the extra bytes cost about their transfer time
    if target == "trn2":
        args, _ = _decode_inputs(2, 64, 8, 4, 128, [4096] * 2, "bfloat16", "paged16", False)
        r = nki.benchmark(attention_tkg, target=target)(**args)
        assert r.latency_ns < 3 * 2 * 8 * 4096 * 128 * 2 * 2 / _hbm_bytes_per_ns(target)


# ------------------------------------------------------------------ MLP
_TORCH_ACT = {ActFnType.SiLU: F.silu, ActFnType.GELU: F.gelu,
              ActFnType.GELU_Tanh_Approx: lambda x: F.gelu(x, approximate="tanh"),
              ActFnType.Swish: lambda x: x * torch.sigmoid(1.702 * x)}


def _mlp_case(B, S, H, I, dtype, norm, act=ActFnType.SiLU, bias=False, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, xn = _cast(torch.randn(B, S, H, generator=g), dtype)
    wg, wgn = _cast(torch.randn(H, I, generator=g) / H ** 0.5, dtype)
    wu, wun = _cast(torch.randn(H, I, generator=g) / H ** 0.5, dtype)
    wd, wdn = _cast(torch.randn(I, H, generator=g) / I ** 0.5, dtype)
    w, wn = _cast(1 + 0.1 * torch.randn(1, H, generator=g), dtype)
    args = dict(hidden_tensor=xn, gate_proj_weights_tensor=wgn, up_proj_weights_tensor=wun,
                down_proj_weights_tensor=wdn, activation_fn=act,
                normalization_type=NormType.RMS_NORM if norm else NormType.NO_NORM)
    if norm:
        args["normalization_weights_tensor"] = wn
    bg = bu = bd = 0.0
    if bias:
        (bg, args["gate_proj_bias_tensor"]), (bu, args["up_proj_bias_tensor"]), \
            (bd, args["down_proj_bias_tensor"]) = (_cast(0.1 * torch.randn(1, n, generator=g), dtype)
                                                   for n in (I, I, H))
    h = x
    if residual:
        r, args["fused_add_tensor"] = _cast(torch.randn(B, S, H, generator=g), dtype)
        h = x + r
        if dtype == "bfloat16":     # the kernel adds in the tensors' dtype
            h = h.to(torch.bfloat16).float()
    added = h
    if norm:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    ref = (_TORCH_ACT[act](h @ wg + bg) * (h @ wu + bu)) @ wd + bd
    return args, ref, added


def _check_mlp(out, ref, dtype):
    tol = TOL[dtype] * 4 if dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), ref.numpy(), atol=tol, rtol=tol)


MLP_CASES = [  # B, S, H, I, RMSNorm
    (1, 1, 256, 512, True),          # one decode token
    (2, 150, 320, 700, True),        # 300 tokens, partial 128-chunks everywhere
    (1, 520, 128, 384, False),       # two token blocks, the second of 8 tokens
]


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", MLP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_mlp_matches_torch(case, dtype, target):
    B, S, H, I, norm = case
    args, ref, _ = _mlp_case(B, S, H, I, dtype, norm)
    out = nki.simulate(mlp, platform_target=target)(**args)
    assert isinstance(out, list) and len(out) == 1 and out[0].shape == (B, S, H)
    _check_mlp(out[0], ref, dtype)


@pytest.mark.parametrize("act", list(ActFnType), ids=lambda a: a.name)
def test_mlp_activations_biases_residual(act):
    args, ref, added = _mlp_case(1, 70, 192, 320, "float32", True, act, bias=True, residual=True)
    out, fused = mlp(**args, store_fused_add_result=True)
    _check_mlp(out, ref, "float32")
    np.testing.assert_allclose(fused, added.numpy(), atol=1e-6)


def test_mlp_clamps_and_output_dtype():
    args, _, _ = _mlp_case(1, 20, 128, 256, "float32", False, seed=1)
    x, wg, wu, wd = (torch.tensor(np.asarray(args[k], np.float32)) for k in
                     ("hidden_tensor", "gate_proj_weights_tensor", "up_proj_weights_tensor",
                      "down_proj_weights_tensor"))
    ref = (F.silu((x @ wg).clamp(max=0.5)) * (x @ wu).clamp(-0.3, 0.3)) @ wd
    out, = mlp(**args, gate_clamp_upper_limit=0.5, up_clamp_lower_limit=-0.3,
               up_clamp_upper_limit=0.3, output_dtype=BF16)
    assert out.dtype == BF16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref.numpy(), atol=2e-2, rtol=2e-2)


def test_mlp_rejects_what_it_does_not_cover():
    args, _, _ = _mlp_case(1, 4, 128, 256, "float32", False)
    with pytest.raises(nki.errors.UnsupportedError, match="quantized"):
        mlp(**args | dict(quantization_type=QuantizationType.ROW))
    with pytest.raises(nki.errors.UnsupportedError, match="LAYER_NORM"):
        mlp(**args | dict(normalization_type=NormType.LAYER_NORM))
    with pytest.raises(nki.errors.ShapeMismatchError, match="down_proj_weights_tensor"):
        mlp(**args | dict(down_proj_weights_tensor=np.zeros((255, 128), np.float32)))
    with pytest.raises(nki.errors.ShapeMismatchError, match="needs normalization_weights_tensor"):
        mlp(**args | dict(normalization_type=NormType.RMS_NORM))
    H = 16384      # the fp32 accumulator of one token's row leaves no room for weights
    with pytest.raises(nki.errors.UnsupportedError, match="hidden size 16384 in float32"):
        mlp(np.zeros((1, 1, H), np.float32), np.zeros((H, 16), np.float32),
            np.zeros((H, 16), np.float32), np.zeros((16, H), np.float32))


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_mlp_keeps_tensor_engine_busy(target):
    """Prefill-sized: a real fraction of TensorE's bf16 peak; decode-sized: within 2.5x of
    the time to stream the weights from HBM (the last I block's compute follows its load)."""
    H, I = 1024, 2816
    args, _, _ = _mlp_case(1, 512, H, I, "bfloat16", True)
    r = nki.benchmark(mlp, target=target)(**args)
    flops = 6 * 512 * H * I
    assert flops / (r.latency_ns * 1e-9) > 0.5 * get_profile(target).core_tflops["bfloat16"] * 1e12
    args, _, _ = _mlp_case(1, 8, H, I, "bfloat16", True)
    r = nki.benchmark(mlp, target=target)(**args)
    assert r.latency_ns < 2.5 * 3 * H * I * 2 / _hbm_bytes_per_ns(target)
