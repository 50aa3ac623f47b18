"""Which NaN a result is, where the loop decides it. ATen's CPU kernels give NaN results whose
bits depend on the loop that computed them: a product of two NaNs is one operand's NaN or the
other's, maximum/minimum/clamp make a different NaN in their vector loop than in their scalar
one, and bf16/fp16 kernels round a NaN to a different NaN in each. Fused kernels must give every
element the bits eager's loop gave it, so NaNs are placed where eager's thread ranges end (where
its loops switch from vector to scalar) and compared bit for bit."""
from __future__ import annotations

import pytest
import torch

from _compare import assert_same_bits, bits, run_twice

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# 300 x 1000: eager's two thread ranges meet at row 150, and over the flat elements the first
# ends in a tail of 16 (150000 = 32 * 4687 + 16) that a block of rows runs in its vector loop.
# 301 x 1000: the ranges meet in the middle of row 150, which eager runs as two loop calls.
SHAPES = [(300, 1000), (301, 1000), (70, 1000), (1000, 77), (4096, 333)]


def _nan_half(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    x[x > 0] = float("nan")
    return x


def _check(program, *inputs):
    want, got, stats = run_twice(program, *inputs)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_same_bits(g, w, f"output {k}")
    return stats


def _centre_abs(x):
    y = x - x.sum(-1, keepdim=True)
    return [y.abs() * 2]


def _centre_maximum(x):
    y = x - x.amax(-1, keepdim=True)
    return [torch.maximum(y, y * 3) * 2]


def _centre_scale(x):
    y = x - x.mean(-1, keepdim=True)
    return [y * x[0]]  # row 0 scales every row: eager's loop calls are rows


def _pure_maximum(x):
    y = x * 3
    return [torch.maximum(y, x).abs() * 2]


def _products_of_nans(x):
    r = x.amin(-1, keepdim=True).rsqrt()  # -NaN in most rows
    y = x * r
    return [y * y.neg() * 2]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("program", [_centre_abs, _centre_maximum, _centre_scale, _pure_maximum,
                                     _products_of_nans],
                         ids=lambda f: f.__name__)
def test_nan_bits_match_eager_at_loop_boundaries(program, dtype, shape):
    _check(program, _nan_half(shape, dtype))


def test_rows_windows_with_row_broadcasts_still_fuse_in_bf16():
    # Ops whose last dim cannot coalesce with the rows (a weight, a per-row scale) meet each
    # row in one loop call, as blocks of rows do: their NaN bits need no more.
    x = _nan_half((512, 1024), torch.bfloat16)
    w = torch.randn(1024, dtype=torch.bfloat16)
    w[::5] = float("nan")

    def program(x, w):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return [(x * torch.rsqrt(v + 1e-6).to(x.dtype)) * w]
    assert _check(program, x, w)["fused_ops"] >= 3


def _pairs(shape, first=0x7FC00001, second=-0x3FFFFE):
    """Two tensors that are NaN together at every third element, with different payloads and signs."""
    torch.manual_seed(1)
    a, b = torch.randn(shape), torch.randn(shape)
    a.view(-1).view(torch.int32)[::3] = first
    b.view(-1).view(torch.int32)[::3] = second
    return a, b


@pytest.mark.parametrize("numel", [40000, 64010, 262144 * 2 + 37, 1000003])
def test_products_of_two_nans_in_pure_windows(numel):
    # Eager's ranges end in compiled tails wherever numel splits unevenly; one-pass runs must
    # give those elements the first operand's NaN as eager did.
    a, b = _pairs((numel,))

    def program(a, b):
        return [(a + 0) * (b - 0) + 1, (a * 2) * float("nan")]
    assert _check(program, a, b)["one_pass_ops"] >= 5


def test_products_of_two_nans_with_broadcasts_and_strides():
    a, b = _pairs((333, 998))  # rows end in a tail of 6: compiled 4-wide, the first's NaN
    w = torch.full((998,), float("nan"))
    w.view(torch.int32)[::2] = -0x3FFFFF
    bt = b.t().contiguous()

    def program(a, bt, w):
        b = bt.t()  # a strided operand: eager's scalar loop
        s = a.sum(-1, keepdim=True)
        return [(a * w) * (b * s) - 1, (a - s) * (b * 1.5)]
    assert _check(program, a, bt, w)["one_pass_ops"] >= 4


def test_in_place_product_of_two_nans():
    # In-place products stay ATen calls inside the fused kernel, on eager's own loop calls.
    a, b = _pairs((64010,))  # two ranges of 32005: each ends in a tail of 5

    def program(a, b):
        y = a + 0
        y.mul_(b)
        return [y, y * a]
    assert _check(program, a, b)["fused_ops"] >= 3


# Exact ops whose results do not depend on the loop even for NaNs (csrc/aten/fusable.cpp, NanLoop),
# per result dtype: checked here against this machine's ATen, over calls of every tail length.
_FREE = {
    torch.float32: ["add", "sub", "div", "neg", "abs", "sqrt", "rsqrt", "reciprocal", "relu",
                    "clamp_scalar", "pow2", "exp", "where"],
    torch.float64: ["add", "sub", "div", "neg", "abs", "sqrt", "rsqrt", "reciprocal", "relu",
                    "clamp_scalar", "pow2", "where"],
    torch.bfloat16: ["where"],
    torch.float16: ["where"],
}
_OPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "div": lambda a, b: a / b,
    "neg": lambda a, b: -a, "abs": lambda a, b: a.abs(), "sqrt": lambda a, b: a.sqrt(),
    "rsqrt": lambda a, b: a.rsqrt(), "reciprocal": lambda a, b: a.reciprocal(),
    "relu": lambda a, b: a.relu(), "clamp_scalar": lambda a, b: a.clamp(-1.0, 1.0),
    "pow2": lambda a, b: a.pow(2), "exp": lambda a, b: a.exp(),
    "where": lambda a, b: torch.where(b > 0, a, b),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_free_ops_give_one_nan_wherever_the_loop_is(dtype):
    it = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    nans = {torch.float32: [0x7F800001, -0x3FFFFE, 0x7FC00000],
            torch.float64: [0x7FF0000000000001, -0x7FFFFFFFFFFFE, 0x7FF8000000000000],
            torch.bfloat16: [0x7F81, -0x3E, 0x7FC0], torch.float16: [0x7C01, -0x1FE, 0x7E00]}[dtype]
    for name in _FREE[dtype]:
        for p in nans:
            for q in [p, nans[0], -2.0]:
                x = torch.tensor([p], dtype=it).view(dtype)
                y = torch.tensor([q], dtype=it).view(dtype) if isinstance(q, int) else torch.tensor([q], dtype=dtype)
                seen = set()
                for n in range(1, 200):
                    out = _OPS[name](x.expand(n).contiguous(), y.expand(n).contiguous())
                    seen.update(bits(out).tolist())
                assert len(seen) == 1, f"{name} {dtype}: NaN bits depend on the loop: {seen}"


def test_products_of_two_nans_over_per_row_values():
    # Per-row values without the last dim, two NaNs of different signs per row: eager's two
    # thread ranges of 51205 rows each end in a tail of 5.
    torch.manual_seed(2)
    x, y = torch.randn(102410, 4), torch.randn(102410, 4)
    y[torch.rand(y.shape) < 0.3] = float("nan")

    def program(x, y):
        top = y.amax(-1)  # +NaN where a row of y holds one
        r = x.amin(-1).rsqrt()  # -NaN where a row's minimum is negative
        return [top * r, r * top]
    assert _check(program, x, y)["one_pass_ops"] >= 2


@pytest.mark.parametrize("shape", [(1000, 1000), (333, 998), (4097, 77)], ids=str)
def test_products_with_a_nan_scalar_over_rows_eager_coalesces(shape):
    # Eager runs (x + s) * nan over the flat elements (its loop calls are the thread ranges,
    # not rows): the run must model eager's coalesced iteration, not the rows it goes by.
    torch.manual_seed(3)
    x = torch.randn(shape)
    x.view(torch.int32)[torch.rand(shape) < 0.3] = 0x7FC00001

    def program(x):
        s = x.sum(-1, keepdim=True)
        return [(x + s) * float("nan"), float("nan") * (x - s)]
    assert _check(program, x)["one_pass_ops"] >= 4


def _random_bits(shape, dtype, seed):
    """Every bit pattern equally likely: NaNs of many payloads and signs, infinities, -0.0."""
    g = torch.Generator().manual_seed(seed)
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(ints).view(dtype)


def _rope_interleaved(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return [x1 * cos - x2 * sin, x1 * sin + x2 * cos, x2 / cos, x1 * 0.5 + x2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(16, 64, 1024), (3, 301, 1000), (7, 33, 130)], ids=str)
def test_strided_operands_fuse_with_eager_nan_bits(dtype, shape):
    # x[..., ::2] steps along the last dim: ATen's binary arithmetic runs its scalar loop on
    # every element there, in eager and in blocks, so those ops join a rows window in every
    # dtype, and every NaN keeps eager's bits (random bit patterns: NaNs of all payloads).
    x = _random_bits(shape, dtype, 1)
    cos = _random_bits(shape[1:-1] + (shape[-1] // 2,), dtype, 2)
    sin = _random_bits(shape[1:-1] + (shape[-1] // 2,), dtype, 3)
    stats = _check(_rope_interleaved, x, cos, sin)
    if x.numel() >= 2 ** 17:
        assert stats["fused_ops"] >= 6, stats


def _table_over_batch(x, table):
    y = x * table                      # a [S, D] table over [B, S, D]
    return [y * x - table, (y + x) * 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(16, 64, 1024), (8, 16, 384), (3, 301, 1000), (5, 7, 2048)],
                         ids=str)
def test_tables_broadcast_over_leading_dims_keep_eager_nan_bits(dtype, shape):
    # Eager runs x * table as loop calls cut at every S * D elements; where that extent, its
    # thread ranges and the blocks all fall on 128-element steps, every element is computed
    # in the vector loop both ways and such ops join in bf16/fp16 too; elsewhere they must not
    # (random bit patterns: NaNs of every payload).
    x = _random_bits(shape, dtype, 4)
    table = _random_bits(shape[1:], dtype, 5)
    stats = _check(_table_over_batch, x, table)
    if shape == (16, 64, 1024):
        assert stats["fused_ops"] >= 5, stats
