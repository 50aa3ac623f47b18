"""Adaptive Eager one-pass runs: stretches of IEEE-exact fp32 arithmetic inside a fused kernel
(add, sub, mul, div, neg, abs, x**2, reciprocal) are evaluated in one pass over small tiles
instead of one ATen call each. Results must be CPU's bit for bit, NaN payloads and signs,
infinities and signed zeros included, whatever the operands: broadcast rows and columns,
strided views, Python and 0-dim tensor scalars, in-place chains and kept intermediates."""
from __future__ import annotations

import pytest
import torch

import torch_neuronx

from _compare import assert_same_bits, run_twice  # noqa: E402


def _check(program, *inputs):
    """Runs `program` on CPU and twice on neuron (the first run teaches signatures); returns
    the second run's one-pass op count after checking every output bit for bit."""
    want, got, stats = run_twice(program, *inputs)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_same_bits(g, w, f"output {k}")
    return stats["one_pass_ops"]


def _specials(shape):
    """Normal values with NaNs of several payloads and both signs, infinities and -0.0."""
    torch.manual_seed(0)
    a, b = torch.randn(shape), torch.randn(shape)
    ai, bi = a.view(-1).view(torch.int32), b.view(-1).view(torch.int32)
    ai[::3] = 0x7FC00001
    bi[::3] = 0x7FC00002
    bi[1::5] = -0x3FFFFD  # 0xffc00003: a negative NaN
    a.view(-1)[2::7] = float("inf")
    b.view(-1)[2::7] = float("-inf")
    a.view(-1)[4::11] = -0.0
    b.view(-1)[5::13] = 0.0
    return a, b


def _arith(a, b):
    c = a + b
    d = b - a
    e = a * b
    f = (b / a) - a
    g = (-a).abs() * (1 / b)
    h = a.pow(2) - b
    return [c * 1.5, d + 2, e - 1, f * 3, g + 0, h * 1]


@pytest.mark.parametrize("shape", [(1 << 18,), (300, 1024), (7, 40000)])
def test_special_values_match_cpu_in_pure_windows(shape):
    assert _check(_arith, *_specials(shape)) > 0


def test_special_values_match_cpu_with_row_broadcasts():
    a, b = _specials((512, 1024))
    w = torch.randn(1024)

    def program(a, b, w):
        r = a.amax(-1, keepdim=True)  # a per-row value (NaN rows included)
        return [(a - r) * w + b / 3, (b + r) * (w - a), (a * b).sum(-1, keepdim=True) / r]
    assert _check(program, a, b, w) > 0


def test_scalars_of_every_kind_match_cpu():
    torch.manual_seed(1)
    x = torch.randn(256, 1024)

    def program(x):
        t64 = torch.tensor(0.1, dtype=torch.float64)  # rounds to float as ATen rounds it
        ti = torch.tensor(3)
        y = x * 0.7978845608 + 1
        z = (y / ti - t64) * 3 + x / 7.0
        return [z, 2 - z, z.pow(2) * 1e-3]
    assert _check(program, x) > 0


def test_in_place_chains_and_kept_intermediates_match_cpu():
    torch.manual_seed(2)
    x = torch.randn(512, 1024)

    def program(x):
        y = x.clone()
        y.mul_(2).add_(1).neg_()
        kept = y * x  # held by the program: must reach memory
        out = (kept + 1) * (kept - 1)
        y.div_(3)
        return [y, kept, out]
    assert _check(program, x) > 0


def test_strided_views_and_several_row_dims_match_cpu():
    torch.manual_seed(3)
    x = torch.randn(64, 16, 1024)
    w = torch.randn(512)

    def program(x, w):
        h1, h2 = x[..., ::2], x[..., 1::2]  # column stride 2
        r = x.mean(-1, keepdim=True)
        rot = torch.cat([h1 * w - h2 * 2, h2 * w + h1 / 3], -1)
        return [rot, (x - r) * (x + r)]
    assert _check(program, x, w) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_stays_on_aten_kernels(dtype):
    torch.manual_seed(4)
    x = torch.randn(256, 1024).to(dtype)

    def program(x):
        return [(x * 3 + 1) * (x - 2)]
    # bf16/fp16 round after every op as ATen's kernels do; one-pass runs are fp32 only.
    assert _check(program, x) == 0


def test_off_switch_leaves_results_identical():
    a, b = _specials((300, 1024))
    torch_neuronx.set_adaptive_eager(False)
    try:
        assert _check(_arith, a, b) == 0
    finally:
        torch_neuronx.set_adaptive_eager(True)


@pytest.mark.parametrize("shape", [(512, 1024), (64, 16, 1024), (3, 129, 128)])
def test_per_row_values_without_the_last_dim_match_cpu(shape):
    torch.manual_seed(5)
    x = torch.randn(shape)

    def program(x):
        s = x.sum(-1)  # rank one less than the window: its blocks are narrowed row ranges
        t = s * 2 + 1
        u = x * 3 - 1
        return [t, u.amax(-1) / t - s, u]
    assert _check(program, x) > 0


def _folded_cat_programs():
    def rope(x, c, s):
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return [torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)]

    def three_way(x, c, s):
        h = x.shape[-1] // 2
        return [torch.cat([x[..., :h] * 2 + c, (x[..., h:] - s) / 3, c * s], -1)]

    def cat_then_scaled(x, c, s):  # the cat's own result is an intermediate: no fold
        h = x.shape[-1] // 2
        return [torch.cat([x[..., :h] * 2 + c, c * s], -1) * 0.5]

    def input_also_read(x, c, s):  # one input is read again: no fold
        h = x.shape[-1] // 2
        a = x[..., :h] * c
        return [torch.cat([a, x[..., h:] + s], -1), a.sum(-1, keepdim=True)]

    def input_kept(x, c, s):  # the program keeps an input: it must reach memory
        h = x.shape[-1] // 2
        a = x[..., :h] * c
        out = torch.cat([a, x[..., h:] - s], -1)
        return [out, a]
    return [rope, three_way, cat_then_scaled, input_also_read, input_kept]


@pytest.mark.parametrize("program", _folded_cat_programs(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(256, 1024), (3, 129, 1030), (40, 2002)])
def test_last_dim_cat_of_run_outputs_matches_cpu(program, shape):
    torch.manual_seed(6)
    x = torch.randn(shape)
    c = torch.randn(*shape[:-1], shape[-1] // 2)
    s = torch.randn(*shape[:-1], shape[-1] // 2)
    assert _check(program, x, c, s) > 0


def _exp_inputs(shape):
    """Every range exp treats apart: overflow and underflow to 0 and to denormals, NaNs of
    both signs, infinities, signed zeros and ordinary values."""
    a, b = _specials(shape)
    flat = a.view(-1)
    flat[6::17] = 89.0  # overflows
    flat[7::19] = -95.0  # a denormal result
    flat[8::23] = -110.0  # underflows to 0
    flat[9::29] = 1e-30
    return a, b


def test_softmax_written_out_matches_cpu():
    # exp joins the subtraction's run; the max and the sum stay ATen's reductions.
    x, _ = _exp_inputs((512, 1024))
    x.view(-1)[::3] = 0.5  # NaN rows aside, most rows give finite results
    x[:64] = torch.randn(64, 1024) * 30

    def program(x):
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return [e / e.sum(-1, keepdim=True)]
    assert _check(program, x) >= 1


@pytest.mark.parametrize("shape", [(1 << 18,), (300, 1024)])
def test_exp_special_values_match_cpu_in_runs(shape):
    a, b = _exp_inputs(shape)

    def program(a, b):
        return [torch.exp(a * 2 - b) + 1, torch.exp(-a).neg(), torch.exp(b) * torch.exp(a)]
    assert _check(program, a, b) > 0


def test_exp_of_broadcast_and_strided_operands_matches_cpu():
    torch.manual_seed(6)
    x = torch.randn(256, 2048) * 40
    col = torch.randn(256, 1) * 50

    def program(x, col):
        t = x[:, ::2]  # strided rows of 1024
        return [torch.exp(t - col) * 2]
    assert _check(program, x, col) > 0

    def per_row(x):
        y = x[:, :1024] * 0.01
        return [y * (y.sum(-1, keepdim=True).exp() - 1)]  # a run of width 1
    assert _check(per_row, x) >= 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_exp_in_other_dtypes_stays_on_aten_kernels(dtype):
    torch.manual_seed(7)
    x = torch.randn(256, 1024).to(dtype)

    def program(x):
        return [torch.exp(x * 3) - 1]
    assert _check(program, x) == 0


def _softmax(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return [e / e.sum(-1, keepdim=True)]


def _layernorm(x):
    mu = x.mean(-1, keepdim=True)
    d = x - mu
    return [d / ((d * d).mean(-1, keepdim=True) + 1e-5)]


@pytest.mark.parametrize("width", [8, 16, 64, 100, 1024, 2047, 4096])
@pytest.mark.parametrize("program,ops", [(_softmax, 5), (_layernorm, 6)])
def test_by_row_runs_hold_last_dim_reductions(program, ops, width):
    # Rows up to 4096 wide run row by row: sum, mean and amax join the run (summing in
    # ATen's own order), so every op of the block is one pass.
    torch.manual_seed(width)
    x = torch.randn(max(8, 300000 // width), width) * torch.logspace(-8, 8, width)
    assert _check(program, x) == ops


def test_rows_wider_than_a_by_row_run_stay_exact():
    torch.manual_seed(8)
    x = torch.randn(40, 4097)
    assert _check(_softmax, x) == 3  # sub, exp, div; the reductions run as ATen's kernels


def test_reductions_of_special_rows_match_cpu():
    # Rows whose bits depend on order in ATen's kernels (a NaN's payload, the sign of a zero
    # maximum) are reduced by ATen's own kernel; every other row by the run.
    torch.manual_seed(9)
    x = torch.randn(256, 1024)
    xi = x.view(torch.int32)
    xi[0, 5], xi[0, 700] = 0x7FC00001, -0x3FFFFD  # two NaNs of different payloads and signs
    xi[1, 9] = 0x7FA00000  # a signalling NaN
    x[2] = 0.0
    x[2, 1::3] = -0.0  # maximum 0 from zeros of both signs
    x[3] = -0.0
    x[4] = float("-inf")
    x[5, 3] = float("inf")
    x[6, 3], x[6, 4] = float("inf"), float("-inf")  # a NaN sum
    x[7] = -x[7].abs() - 1
    x[7, 1::2] = -0.0  # negative values and -0.0: maximum -0.0
    x[8, :512], x[8, 512:] = 0.0, -0.0  # zeros of both signs, each sign together
    x[9, :512], x[9, 512:] = -0.0, 0.0

    def program(x):
        return [x.amax(-1, keepdim=True) + 0, x.sum(-1, keepdim=True) * 1, x.mean(-1, keepdim=True) - 0,
                x * x.amax(-1, keepdim=True)]
    assert _check(program, x) >= 4


@pytest.mark.parametrize("width", [16, 64, 300])
def test_short_rows_in_groups_match_cpu(width):
    # Short rows run in groups: an op over rows lying contiguous is one call, one with per-row
    # scalars (x - max) one call looping over them; strided rows are gathered first.
    torch.manual_seed(width)
    x = torch.randn(60000 // width, 2 * width) * 20

    def program(x):
        t = x[:, ::2]
        y = t - t.amax(-1, keepdim=True)  # kept
        e = torch.exp(y)
        return [y, e / e.sum(-1, keepdim=True), (y * 2).mean(-1, keepdim=True)]
    assert _check(program, x) >= 5


def test_product_of_two_different_nans_at_eager_loop_tails():
    # ATen's mul gives the first operand's NaN in parts of its compiled loop tails, the
    # second's elsewhere: the run must give each element the one eager's loop gave it.
    torch.manual_seed(0)
    x = torch.randn(70, 1000)

    def program(x):
        r = x.amin(-1, keepdim=True).rsqrt()  # -NaN in every row
        return [r * r.amax(-1, keepdim=True)]  # times +NaN: eager gives -NaN in rows 64-67
    assert _check(program, x) >= 1
