"""NKI-lib RMSNorm and LayerNorm (``rmsnorm_tkg``, ``layernorm_tkg``) in the simulator against
PyTorch on CPU, in the natural and in AWS's [128, B*S, H/128] layouts, plus their modelled
latency against the HBM roofline."""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nki
from neuronhw import get_profile
from nkilib.core.subkernels.layernorm_tkg import layernorm_tkg
from nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg

BF16 = ml_dtypes.bfloat16
NC = {"trn2": "gen3", "trn3": "gen4"}

# B, S, H: one token (decode), rows not a multiple of 128, H from 64 to 4096 and not a
# multiple of 128, more rows than one tile, short rows packed several to a partition (the
# last partition of the last tile partly filled)
SHAPES = [(1, 1, 64), (1, 1, 4096), (2, 65, 256), (1, 300, 1000), (1, 257, 2048), (4, 64, 4096),
          (3, 7, 96), (1, 1000, 64), (2, 301, 256)]


def _inputs(B, S, H, dtype, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((B, S, H)) + offset).astype(dtype)
    g = rng.standard_normal((1, H)).astype(dtype)
    b = rng.standard_normal((1, H)).astype(dtype)
    return x, g, b


def _t(a):
    """The float32 torch tensor of exactly the kernel's (possibly bf16) values."""
    return torch.from_numpy(np.asarray(a, np.float32))


def _check(got, ref, dtype):
    got = np.asarray(got, np.float32)
    if dtype == np.float32:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    else:    # a few bf16 roundings of values up to |ref|.max()
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=1e-2 * np.abs(ref).max())


def _aws_layout(y, lnc=1, tp=False):
    """AWS's [128, B*S, H/128] output from the natural [B*S, H] (its torch reference)."""
    R, H = y.shape
    if tp:
        return y.reshape(R, H // 128, 128).transpose(2, 0, 1)
    return np.concatenate([p.reshape(R, 128, H // 128 // lnc).transpose(1, 0, 2)
                           for p in np.split(y, lnc, axis=1)], axis=2)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rmsnorm_matches_torch(shape, dtype, target):
    B, S, H = shape
    x, g, _ = _inputs(B, S, H, dtype)
    out = nki.simulate(rmsnorm_tkg, platform_target=target)(x, g, eps=1e-5)
    ref = F.rms_norm(_t(x), (H,), _t(g)[0], eps=1e-5).numpy()
    assert out.shape == x.shape and out.dtype == x.dtype
    _check(out, ref, dtype)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("beta", [True, False], ids=["beta", "nobeta"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layernorm_matches_torch(shape, beta, dtype, target):
    B, S, H = shape
    x, g, b = _inputs(B, S, H, dtype, offset=3.0)     # a mean to remove
    out = nki.simulate(layernorm_tkg, platform_target=target)(x, g, beta=b if beta else None)
    ref = F.layer_norm(_t(x), (H,), _t(g)[0], _t(b)[0] if beta else None, eps=1e-6).numpy()
    _check(out, ref, dtype)


@pytest.mark.parametrize("shape", [(1, 300, 4096), (1, 3, 4096), (1, 601, 256)],
                         ids=["whole-rows", "segmented-rows", "packed-rows"])
def test_layernorm_keeps_accuracy_when_mean_dwarfs_spread(shape):
    """Mean 100, spread 0.1: statistics from E[x^2] - mean^2 would lose all precision."""
    B, S, H = shape
    x = (np.random.default_rng(2).standard_normal(shape) * 0.1 + 100).astype(np.float32)
    g = np.ones((1, H), np.float32)
    out = layernorm_tkg(x, g)
    ref = F.layer_norm(_t(x), (H,), eps=1e-6).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("lnc, tp", [(1, False), (2, False), (1, True), (2, True)])
def test_rmsnorm_writes_aws_output_layout(lnc, tp, monkeypatch):
    """AWS's form: rmsnorm_tkg(input, gamma, output) fills output [128, B*S, H/128] (with
    LNC=2 the hidden halves are two shards; hidden_dim_tp transposes) and returns it."""
    monkeypatch.setenv("NKI_NC_VERSION", "gen3")
    B, S, H = 3, 50, 1024
    x, g, _ = _inputs(B, S, H, np.float32)
    out = np.zeros((128, B * S, H // 128), np.float32)
    ret = nki.cpu_simulate(rmsnorm_tkg)[lnc](input=x, gamma=g, output=out, hidden_dim_tp=tp)
    ref = _aws_layout(F.rms_norm(_t(x), (H,), _t(g)[0], eps=1e-6).numpy().reshape(B * S, H), lnc, tp)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ret, out)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_layernorm_writes_aws_output_layout(lnc, dtype, monkeypatch):
    monkeypatch.setenv("NKI_NC_VERSION", "gen4")
    B, S, H = 1, 1, 2048           # one decode token: a row spread over all partitions
    x, g, b = _inputs(B, S, H, dtype, offset=1.0)
    out = np.zeros((128, B * S, H // 128), dtype)
    nki.cpu_simulate(layernorm_tkg)[lnc](input=x, gamma=g, output=out, beta=b)
    ref = F.layer_norm(_t(x), (H,), _t(g)[0], _t(b)[0], eps=1e-6).numpy().reshape(B * S, H)
    _check(out, _aws_layout(ref, lnc), dtype)


def test_rmsnorm_natural_output_argument_and_hidden_actual():
    """An output of the input's shape is filled in the natural layout; hidden_actual divides
    the sum of squares of a zero-padded hidden dimension (AWS's padded inputs)."""
    B, S, H, Ha = 2, 5, 512, 384
    x, g, _ = _inputs(B, S, H, np.float32)
    x[..., Ha:] = 0.0
    out = np.zeros_like(x)
    rmsnorm_tkg(x, g, out, hidden_actual=Ha)
    ref = F.rms_norm(_t(x[..., :Ha]), (Ha,), _t(g)[0, :Ha], eps=1e-6).numpy()
    np.testing.assert_allclose(out[..., :Ha], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[..., Ha:], 0.0)


def test_norms_take_torch_tensors():
    x = torch.randn(2, 70, 320, dtype=torch.bfloat16)
    g = torch.randn(320, dtype=torch.bfloat16)
    y = rmsnorm_tkg(x, g)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = F.rms_norm(x.float(), (320,), g.float(), eps=1e-6)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_norms_reject_bad_input_with_named_errors():
    x = np.zeros((2, 3, 256), np.float32)
    with pytest.raises(nki.errors.ShapeMismatchError, match=r"rmsnorm_tkg: gamma must be \[1, 256\]"):
        rmsnorm_tkg(x, np.ones((1, 128), np.float32))
    with pytest.raises(nki.errors.ShapeMismatchError, match=r"layernorm_tkg: beta must be \[1, 256\]"):
        layernorm_tkg(x, np.ones((1, 256), np.float32), beta=np.ones((2, 256), np.float32))
    with pytest.raises(nki.errors.ShapeMismatchError, match=r"rmsnorm_tkg: output must be .*\(128, 6, 2\)"):
        rmsnorm_tkg(x, np.ones((1, 256), np.float32), np.zeros((128, 6, 3), np.float32))
    with pytest.raises(nki.errors.ShapeMismatchError, match="layernorm_tkg: input must be"):
        layernorm_tkg(np.zeros(256, np.float32), np.ones((1, 256), np.float32))
    with pytest.raises(nki.errors.UnsupportedError, match="rmsnorm_tkg: input dtype int32"):
        rmsnorm_tkg(np.zeros((2, 256), np.int32), np.ones((1, 256), np.float32))


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("kernel", [rmsnorm_tkg, layernorm_tkg], ids=["rmsnorm", "layernorm"])
def test_norm_latency_near_hbm_roofline(kernel, target):
    """A large bf16 norm is bandwidth-bound: its modelled time is within a sane factor of
    reading and writing the tensor once at one core's share of the chip's HBM bandwidth.
    (On trn3 the 16 DMA queues, 33 GB/s each, move less than that share: the bound is
    looser.)"""
    B, S, H = 1, 2048, 4096
    x, g, b = _inputs(B, S, H, BF16)
    kw = {"beta": b} if kernel is layernorm_tkg else {}
    r = nki.benchmark(kernel, target=target)(x, g, **kw)
    p = get_profile(target)
    roofline_ns = 2 * x.nbytes / (p.hbm_bandwidth / p.physical_cores) * 1e9
    ratio = r.latency_ns / roofline_ns
    limit = {("rmsnorm_tkg", "trn2"): 1.3, ("rmsnorm_tkg", "trn3"): 1.7,
             ("layernorm_tkg", "trn2"): 1.6, ("layernorm_tkg", "trn3"): 2.4}[kernel.__name__, target]
    assert 0.95 < ratio < limit, r.summary()
