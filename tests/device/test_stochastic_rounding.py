"""Stochastic rounding (NEURON_RT_STOCHASTIC_ROUNDING_EN): off, bf16/fp16 are CPU's bits; on,
casts and op results round to one of the two neighbouring values on the target grid (found
with NumPy here), up with probability equal to the distance from the lower one, drawn from
the device's generator."""
import os
import subprocess
import sys
import textwrap
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from torch_neuronx.kernels.stochastic_rounding import (_set_stochastic_rounding,
                                                       _stochastic_rounding_enabled)

DEV = "neuron"
BF16, F16 = torch.bfloat16, torch.float16
NP = {BF16: ml_dtypes.bfloat16, F16: np.float16}


@pytest.fixture
def sr():
    assert not _stochastic_rounding_enabled()
    _set_stochastic_rounding(True)
    try:
        yield
    finally:
        _set_stochastic_rounding(False)


def _neighbours(x: np.ndarray, dtype):
    """NumPy: the grid values below and above |x| (with x's sign) and the chance of the
    upper one, on the target's grid continued past its maximum (the upper value is then inf)."""
    nd = NP[dtype]
    finfo = ml_dtypes.finfo(nd) if nd is ml_dtypes.bfloat16 else np.finfo(np.float16)
    top_step = float(np.spacing(nd(float(finfo.max) / 2))) * 2  # spacing of the top binade
    lo, hi, p = [], [], []
    for v in x.astype(np.float64):
        a = abs(v)
        if a > float(finfo.max):
            below = float(finfo.max) + top_step * np.floor((a - float(finfo.max)) / top_step)
            up = below + top_step
        else:
            near = float(nd(a))  # round to nearest even, then step back if it went past
            below = near if near <= a else float(np.nextafter(nd(near), nd(0)))
            up = below if below == a else float(np.nextafter(nd(below), nd(np.inf)))
            if np.isinf(up):
                up = below + top_step
        frac = 0.0 if up == below else (a - below) / (up - below)
        big = float(finfo.max)
        lo.append(np.copysign(below if below <= big else np.inf, v))
        hi.append(np.copysign(up if up <= big else np.inf, v))
        p.append(frac)
    return np.array(lo), np.array(hi), np.array(p)


def _check_rounding(x: torch.Tensor, dtype, draws=4000):
    """Rounds each value of x `draws` times on the device; checks the outcomes against
    NumPy's neighbours and chances (5 sigma)."""
    y = x.to(DEV).expand(draws, -1).to(dtype).cpu().double().numpy()
    lo, hi, p = _neighbours(x.numpy(), dtype)
    for j in range(x.numel()):
        col = y[:, j]
        is_lo, is_hi = col == lo[j], (col == hi[j]) & (col != lo[j])
        assert np.all(is_lo | (col == hi[j])), (x[j].item(), set(col.tolist()), lo[j], hi[j])
        sigma = np.sqrt(p[j] * (1 - p[j]) / draws)
        assert abs(is_hi.mean() - p[j]) <= 5 * sigma + 1e-12, (x[j].item(), is_hi.mean(), p[j])


# --- off: CPU's bits ---------------------------------------------------------------------

def test_off_by_default_and_bit_identical_to_cpu():
    assert not _stochastic_rounding_enabled()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 48, generator=g), torch.randn(48, 32, generator=g)
    for dt in (BF16, F16):
        ad, bd = a.to(DEV), b.to(DEV)
        torch.testing.assert_close(ad.to(dt).cpu(), a.to(dt), rtol=0, atol=0)
        torch.testing.assert_close((ad.to(dt) @ bd.to(dt)).cpu(), a.to(dt) @ b.to(dt), rtol=0, atol=0)
        torch.testing.assert_close((ad.to(dt) * 1.001).sum(0).cpu(), (a.to(dt) * 1.001).sum(0),
                                   rtol=0, atol=0)


# --- the rounding itself -------------------------------------------------------------------

def test_bf16_cast_neighbours_and_chances(sr):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, generator=g) * torch.logspace(-30, 30, 24, base=2.0)
    x = torch.cat([x, torch.tensor([1 + 2.0 ** -9, -(1 + 3 * 2.0 ** -10), 3.0, 2.0 ** -130,
                                    -2.0 ** -149, 3.3e38, 3.4028235e38])])
    _check_rounding(x, BF16)


def test_fp16_cast_neighbours_and_chances(sr):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, generator=g) * torch.logspace(-20, 14, 20, base=2.0)
    x = torch.cat([x, torch.tensor([1024.5, -1024.25, 2.0 ** -20 * 1.3, -2.0 ** -25,
                                    6.1e-5, 65504.0, 65510.0, -65530.0, 5.0])])
    _check_rounding(x, F16)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.filterwarnings("ignore:.*ran on Double")
def test_cast_from_fp64_and_between_narrow_dtypes(sr, dtype):
    x = torch.tensor([1 + 2.0 ** -9 + 2.0 ** -40, -3.3, 1e-6, 2.0 ** -20, 100.1], dtype=torch.float64)
    _check_rounding(x, dtype, draws=2000)
    other = F16 if dtype == BF16 else BF16  # fp16 has bits bf16 lacks and the reverse
    y = torch.tensor([1 + 2.0 ** -10, 3 * 2.0 ** -9, 1e-5, 300.0]).to(other).float()
    got = y.to(other).to(DEV).expand(2000, -1).to(dtype).cpu().double().numpy()
    lo, hi, _ = _neighbours(y.numpy(), dtype)
    assert np.all((got == lo) | (got == hi))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_special_values(sr, dtype):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e6, -1e6, 3e38])
    y = x.to(DEV).expand(200, -1).to(dtype).cpu()
    assert torch.isnan(y[:, 0]).all()
    assert (y[:, 1] == float("inf")).all() and (y[:, 2] == -float("inf")).all()
    assert (y[:, 3] == 0).all() and not torch.signbit(y[:, 3]).any()
    assert (y[:, 4] == 0).all() and torch.signbit(y[:, 4]).all()
    if dtype == F16:  # past fp16's grid: always inf
        assert (y[:, 5:7].abs() == float("inf")).all() and (y[:, 6] < 0).all()
    nan_payload = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(nan_payload.to(DEV).to(dtype).cpu()).all()  # not carried into inf


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_unbiased(sr, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.rand(64, generator=g) * 10 + 1  # spacing 2**-7..2**-4 (bf16), 2**-10..2**-7
    draws = 8192
    mean = x.to(DEV).expand(draws, -1).to(dtype).cpu().double().mean(0)
    spacing = torch.tensor(np.spacing(x.numpy().astype(NP[dtype])).astype(np.float64))
    # one rounding errs by less than a spacing: the mean of `draws` within 5 sigma
    assert ((mean - x.double()).abs() <= 5 * spacing / 2 / np.sqrt(draws)).all()
    rne_err = (x.to(dtype).double() - x.double()).abs().mean()
    assert (mean - x.double()).abs().mean() < rne_err / 4


def test_aws_fp16_example(sr):
    """AWS's rounding-modes page: fp16 1024, 2048 times `a + 0.5` gives 1024 with round to
    nearest even and about 2048 (their run printed 2056) with stochastic rounding."""
    chains = 256
    a = torch.full((chains,), 1024.0, dtype=F16, device=DEV)
    torch.manual_seed(0)
    for _ in range(2048):
        a = a + 0.5
    a = a.double().cpu()
    assert abs(a.mean().item() - 2048) < 10  # E = 2048; one chain's sd ~ 30
    assert ((a > 1900) & (a < 2200)).all() and len(set(a.tolist())) > 4
    assert (a[a >= 2048].remainder(2) == 0).all()  # fp16 above 2048 holds even numbers only


def test_aws_fp16_example_off():
    a = torch.tensor(1024.0, dtype=F16, device=DEV)
    for _ in range(2048):
        a = a + 0.5
    assert a.item() == 1024


# --- seeding -------------------------------------------------------------------------------

def test_deterministic_under_seed(sr):
    x = torch.randn(4096).to(DEV)

    def run(seed, seeder):
        seeder(seed)
        return torch.cat([x.to(BF16).float(), (x.to(F16) * 1.1).float()]).cpu()

    a, b = run(7, torch.manual_seed), run(7, torch.neuron.manual_seed)
    assert torch.equal(a, b)
    assert not torch.equal(a, run(8, torch.manual_seed))
    # the rounding draws from the device's generator, not the CPU's
    torch.neuron.manual_seed(7)
    torch.randn(100)
    c = torch.cat([x.to(BF16).float(), (x.to(F16) * 1.1).float()]).cpu()
    assert torch.equal(a, c)


def _run_child(code, **env):
    full = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()


_CHILD = """
    import torch
    from torch_neuronx.kernels.stochastic_rounding import _stochastic_rounding_enabled
    x = torch.linspace(1, 2, 4097).to("neuron")
    torch.manual_seed(5)
    a = x.to(torch.bfloat16)
    torch.manual_seed(6)
    b = x.to(torch.bfloat16)
    print(_stochastic_rounding_enabled())
    print(int((a.float().cpu() != x.cpu().to(torch.bfloat16).float()).sum()))
    print(hash(tuple(a.float().cpu().tolist())), hash(tuple(b.float().cpu().tolist())))
"""


def test_env_switch_at_import():
    on = _run_child(_CHILD, NEURON_RT_STOCHASTIC_ROUNDING_EN="1")
    assert on[0] == "True" and int(on[1]) > 1000  # about half differ from nearest even
    h5, h6 = on[2].split()
    assert h5 != h6  # torch.manual_seed reaches the rounding
    off = _run_child(_CHILD, NEURON_RT_STOCHASTIC_ROUNDING_EN="0")
    assert off[0] == "False" and off[1] == "0"
    assert _run_child(_CHILD, NEURON_RT_STOCHASTIC_ROUNDING_EN="true")[0] == "True"


def test_env_seed_gives_its_own_stream():
    """NEURON_RT_STOCHASTIC_ROUNDING_SEED: the rounding has a generator of its own, seeded
    with it, as AWS's runtime: torch.manual_seed does not change it, the same seed does not
    change across runs."""
    env = dict(NEURON_RT_STOCHASTIC_ROUNDING_EN="1", NEURON_RT_STOCHASTIC_ROUNDING_SEED="3")
    one, two = _run_child(_CHILD, **env), _run_child(_CHILD, **env)
    assert one == two
    h5, h6 = one[2].split()
    assert h5 != h6  # the stream moves on between the two casts
    other = _run_child(_CHILD, NEURON_RT_STOCHASTIC_ROUNDING_EN="1",
                       NEURON_RT_STOCHASTIC_ROUNDING_SEED="4")
    assert other[2] != one[2]


def test_bad_env_value_warns():
    out = _run_child("""
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import torch
        from torch_neuronx.kernels.stochastic_rounding import _stochastic_rounding_enabled
        print(_stochastic_rounding_enabled())
        print(any("NEURON_RT_STOCHASTIC_ROUNDING_EN" in str(x.message) for x in w))
    """, NEURON_RT_STOCHASTIC_ROUNDING_EN="maybe")
    assert out == ["False", "True"]


# --- ops -----------------------------------------------------------------------------------

def _up_fraction(y, lo):
    return (y.float().cpu() != lo).float().mean().item()


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_op_results_round_stochastically(sr, dtype):
    n = 20000
    one = torch.ones(n, dtype=dtype, device=DEV)
    q = float(np.spacing(NP[dtype](1.0))) / 4  # a quarter spacing: nearest even drops it
    torch.manual_seed(0)
    # functional, in-place, out=, Scalar and Tensor forms: up a quarter of the time
    results = [one + q, one.clone().add_(q), torch.add(one, torch.full_like(one, q)),
               torch.add(one, q, out=torch.empty_like(one))]
    for y in results:
        assert y.dtype == dtype
        frac = _up_fraction(y, 1.0)
        assert abs(frac - 0.25) < 5 * np.sqrt(0.25 * 0.75 / n), frac


def test_matmul_and_reduction_unbiased(sr):
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(16, 64, generator=g), torch.randn(64, 8, generator=g)
    ref = (a.to(BF16).float() @ b.to(BF16).float()).double()  # CPU's fp32 result
    ad, bd = a.to(BF16).to(DEV), b.to(BF16).to(DEV)  # exact casts: no randomness
    assert torch.equal(ad.cpu(), a.to(BF16))
    outs = torch.stack([(ad @ bd).double().cpu() for _ in range(400)])
    spacing = torch.tensor(np.abs(np.spacing(ref.numpy().astype(ml_dtypes.bfloat16))).astype(np.float64))
    assert ((outs.mean(0) - ref).abs() <= 5 * spacing / 2 / 20 + 1e-6).all()
    assert ((outs - ref).abs() <= spacing + 1e-6 * ref.abs()).all()  # one of the neighbours
    # a reduction to a narrow dtype from fp32 inputs (dtype=): rounded stochastically
    x = torch.full((8192, 3), 1 + 2.0 ** -10).to(DEV)
    s = x.sum(1, dtype=BF16)  # 3 + 3 * 2**-10: 3/16 of bf16's spacing at 3 (2**-6)
    frac = _up_fraction(s, 3.0)
    assert abs(frac - 3 / 16) < 5 * np.sqrt(3 / 16 * 13 / 16 / 8192), frac


def test_optimizer_step_accumulates_small_updates(sr):
    """bf16 weights updated by a hundredth of their spacing: nearest even never moves them;
    stochastic rounding moves them by the sum of the updates on average."""
    def train(device):
        w = torch.nn.Parameter(torch.ones(16384, dtype=BF16, device=device))
        opt = torch.optim.SGD([w], lr=2.0 ** -7 / 100)
        for _ in range(200):
            opt.zero_grad()
            w.grad = torch.ones_like(w)
            opt.step()
        return w.detach().double().cpu()

    assert (train("cpu") == 1).all()  # nearest even: every update is lost
    drift = 1 - train(DEV).mean().item()
    assert abs(drift - 2 * 2.0 ** -7) < 0.1 * 2 * 2.0 ** -7, drift  # 200 hundredths of 2**-7


def test_mixed_dtype_error_kept(sr):
    a = torch.randn(4, 4, device=DEV, dtype=BF16)
    b = torch.randn(4, 4, device=DEV)
    with pytest.raises(RuntimeError) as dev_err:
        torch.mm(a, b)
    with pytest.raises(RuntimeError) as cpu_err:
        torch.mm(a.cpu(), b.cpu())
    assert str(cpu_err.value) in str(dev_err.value)


def test_exact_ops_and_constants_unchanged(sr):
    x = torch.randn(1000).to(BF16)
    xd = x.to(DEV)
    for f in (lambda t: torch.cat([t, -t]), lambda t: t.clamp(-0.1, 0.1), lambda t: t.flip(0),
              lambda t: t.masked_fill(t > 0, 0.1), lambda t: torch.full_like(t, 0.1),
              lambda t: t.max(0).values, lambda t: t.sort().values):
        assert torch.equal(f(xd).cpu(), f(x))


def test_convolution(sr):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 3, 8, 8, generator=g).to(BF16), torch.randn(4, 3, 3, 3, generator=g).to(BF16)
    ref = torch.nn.functional.conv2d(x.float(), w.float()).double()  # CPU's fp32 result
    outs = torch.stack([torch.nn.functional.conv2d(x.to(DEV), w.to(DEV)).double().cpu()
                        for _ in range(64)])
    spacing = torch.tensor(np.abs(np.spacing(ref.numpy().astype(ml_dtypes.bfloat16))).astype(np.float64))
    assert ((outs - ref).abs() <= spacing + 1e-5 * ref.abs()).all()
    assert (outs != outs[0]).any()  # rounded at random


# --- training ------------------------------------------------------------------------------

def test_tiny_llama_bf16_trains(sr):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DEV, BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 16), generator=g).to(DEV)
    losses = []
    for _ in range(20):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.float().item())
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses


# --- kernels that write device memory directly: scaled and grouped matmuls ------------------

def _check_kernel_sr(fn, ref32, dtype=BF16, draws=200):
    """``fn()`` (a bf16/fp16 kernel result) rounds the fp32 result ``ref32`` (computed on CPU)
    stochastically: every outcome a neighbour, unbiased per element, reproducible under a seed."""
    torch.manual_seed(11)
    first = fn()
    torch.manual_seed(11)
    assert torch.equal(fn().cpu(), first.cpu())  # the device's generator decides
    assert first.dtype == dtype
    outs = torch.stack([fn().double().cpu() for _ in range(draws)])
    ref = ref32.double()
    # the gap above |ref| (NumPy's spacing of a negative power of two is the gap below it)
    spacing = torch.tensor(np.spacing(np.abs(ref32.numpy()).astype(NP[dtype])).astype(np.float64))
    assert ((outs - ref).abs() <= spacing + 1e-6 * ref.abs()).all()
    # Bernoulli draws: standard deviation at most half a spacing
    assert ((outs.mean(0) - ref).abs() <= 5 * spacing / 2 / np.sqrt(draws) + 1e-6 * ref.abs()).all()
    assert (outs != outs[0]).any()


def _fp8(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_scaled_mm_tensorwise_rowwise(sr, dtype):
    a, b = _fp8((32, 64), 0), _fp8((48, 64), 1).t()
    sa, sb = torch.rand(32, 1) + 0.5, torch.rand(1, 48) + 0.5
    bias = torch.randn(48).to(dtype)
    ad, bd, sad, sbd, biasd = (t.to(DEV) for t in (a, b, sa, sb, bias))
    ref = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32) + bias.float()
    _check_kernel_sr(lambda: torch._scaled_mm(ad, bd, sad, sbd, bias=biasd, out_dtype=dtype), ref, dtype)
    one = torch.tensor(1.0)
    ref = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
    _check_kernel_sr(lambda: torch._scaled_mm(ad, bd, one.to(DEV), one.to(DEV), out_dtype=dtype), ref, dtype)


def test_scaled_mm_mx(sr):
    from torch.testing._internal.common_quantized import to_blocked, to_mxfp
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(64, 96, generator=g), torch.randn(32, 96, generator=g)
    (sx, qx), (sw, qw) = to_mxfp(x), to_mxfp(w)
    ref = (qx.float() * sx.float().repeat_interleave(32, 1)) @ (qw.float() * sw.float().repeat_interleave(32, 1)).t()
    args = [t.to(DEV) for t in (qx, qw, to_blocked(sx), to_blocked(sw))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trn2 has no MX path (a one-time warning)
        _check_kernel_sr(lambda: torch._scaled_mm(args[0], args[1].t(), args[2], args[3],
                                                  out_dtype=BF16), ref)


def test_scaled_grouped_mm_rowwise(sr):
    a, b = _fp8((64, 32), 3), _fp8((2, 48, 32), 4).transpose(-2, -1)
    sa, sb = torch.rand(64) + 0.5, torch.rand(2, 48) + 0.5
    offs = torch.tensor([24, 64], dtype=torch.int32)
    ref = torch._grouped_mm(a.float() * sa[:, None], b.float() * sb[:, None, :], offs)
    args = [t.to(DEV) for t in (a, b, sa, sb, offs)]
    _check_kernel_sr(lambda: torch._scaled_grouped_mm(*args), ref)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_grouped_mm(sr, dtype):
    """fp16 too: CUDA's meta checks take bf16 only, CPU's kernel (what neuron runs) fp16 as well."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(64, 32, generator=g).to(dtype), torch.randn(4, 32, 24, generator=g).to(dtype)
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32)
    ref = torch._grouped_mm(a.float(), b.float(), offs)
    ad, bd, od = a.to(DEV), b.to(DEV), offs.to(DEV)
    _check_kernel_sr(lambda: torch._grouped_mm(ad, bd, od), ref, dtype)


def test_kernels_off_stay_cpus_bits():
    assert not _stochastic_rounding_enabled()
    a, b = _fp8((32, 64), 0), _fp8((48, 64), 1).t()
    one = torch.tensor(1.0)
    got = torch._scaled_mm(a.to(DEV), b.to(DEV), one.to(DEV), one.to(DEV), out_dtype=BF16)
    assert torch.equal(got.cpu(), torch._scaled_mm(a, b, one, one, out_dtype=BF16))
    x, w = torch.randn(64, 32).to(BF16), torch.randn(4, 32, 24).to(BF16)
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32)
    got = torch._grouped_mm(x.to(DEV), w.to(DEV), offs.to(DEV))
    assert torch.equal(got.cpu(), torch._grouped_mm(x, w, offs))


def test_scaled_grouped_mm_mx(sr):
    from torch.testing._internal.common_quantized import to_blocked, to_mxfp
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(64, 64, generator=g), torch.randn(2, 32, 64, generator=g)
    parts = [to_mxfp(x[:24]), to_mxfp(x[24:])]  # each group's scales blocked on their own
    qx = torch.cat([q for _, q in parts])
    sx = torch.cat([to_blocked(s).reshape(-1) for s, _ in parts]).reshape(-1, 4)
    ws = [to_mxfp(w[i]) for i in range(2)]
    qw = torch.stack([q for _, q in ws]).transpose(-2, -1)
    sw = torch.stack([to_blocked(s).reshape(-1) for s, _ in ws])
    offs = torch.tensor([24, 64], dtype=torch.int32)
    deq = lambda q, s: q.float() * s.float().repeat_interleave(32, 1)  # noqa: E731
    xf = torch.cat([deq(q, s) for s, q in parts])
    ref = torch.cat([xf[:24] @ deq(ws[0][1], ws[0][0]).t(), xf[24:] @ deq(ws[1][1], ws[1][0]).t()])
    args = [t.to(DEV) for t in (qx, qw, sx, sw, offs)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trn2 has no MX path (a one-time warning)
        _check_kernel_sr(lambda: torch._scaled_grouped_mm(*args), ref)


def _nki_mul_to(dtype):
    import nki
    import nki.language as nl

    @nki.jit
    def mul_narrow(a, b):
        out = nl.ndarray(a.shape, dtype=dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.multiply(nl.load(a), nl.load(b), dtype=dtype))
        return out
    return mul_narrow


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_nki_kernel_writes_round_stochastically(sr, dtype):
    import nki.language as nl
    kernel = _nki_mul_to({BF16: nl.bfloat16, F16: nl.float16}[dtype])
    g = torch.Generator().manual_seed(12)
    a, b = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    ad, bd = a.to(DEV), b.to(DEV)
    _check_kernel_sr(lambda: kernel(ad, bd), a * b, dtype)
    assert torch.equal(kernel(a, b), (a * b).to(dtype))  # CPU tensors: not the device's runtime


def test_nki_kernel_off_rounds_to_nearest_even():
    import nki.language as nl
    assert not _stochastic_rounding_enabled()
    g = torch.Generator().manual_seed(13)
    a, b = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    got = _nki_mul_to(nl.bfloat16)(a.to(DEV), b.to(DEV))
    assert torch.equal(got.cpu(), (a * b).to(BF16))
    got_cpu = _nki_mul_to(nl.bfloat16)(a, b)  # CPU tensors: no device runtime, no switch
    assert torch.equal(got_cpu, (a * b).to(BF16))
