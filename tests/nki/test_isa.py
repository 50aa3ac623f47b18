"""Every instruction against a NumPy reference, for each dtype it supports."""
import numpy as np
import pytest

import nki
import nki.errors
import nki.isa as nisa
import nki.language as nl

from helpers import as_dtype_np, rounded, run_instr

RNG = np.random.default_rng(0)
FLOATS = ["float32", "bfloat16", "float16", "float8_e4m3", "float8_e5m2"]


def rand(shape, dtype="float32", lo=-2.0, hi=2.0):
    return as_dtype_np(RNG.uniform(lo, hi, shape), dtype)


def f32(x):
    return np.asarray(x).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3", "float8_e5m2", "tfloat32"])
def test_nc_matmul(dtype):
    a, b = rand((128, 96), dtype if dtype != "tfloat32" else "float32"), rand((128, 512), dtype if dtype != "tfloat32" else "float32")
    if dtype == "tfloat32":
        a, b = as_dtype_np(a, "tfloat32"), as_dtype_np(b, "tfloat32")
    r = run_instr(lambda d, x, y: nisa.nc_matmul(d, x, y), [a, b], (96, 512), nl.float32, "psum")
    ref = f32(a).astype(np.float64).T @ f32(b).astype(np.float64)
    np.testing.assert_allclose(r, ref, rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulates_in_fp32_psum():
    a = [rand((128, 64), "bfloat16") for _ in range(3)]
    b = [rand((128, 256), "bfloat16") for _ in range(3)]

    def fn(d, a0, a1, a2, b0, b1, b2):
        for k, (x, y) in enumerate(((a0, b0), (a1, b1), (a2, b2))):
            nisa.nc_matmul(d, x, y, accumulate=(k > 0))
    r = run_instr(fn, a + b, (64, 256), nl.float32, "psum")
    ref = sum(f32(x).astype(np.float64).T @ f32(y) for x, y in zip(a, b))
    np.testing.assert_allclose(r, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nc_transpose_tensor_and_vector(dtype):
    x = rand((128, 64), dtype)
    r = run_instr(lambda d, t: nisa.nc_transpose(d, t), [x], (64, 128), dtype, "psum")
    np.testing.assert_array_equal(r, f32(x).T)
    y = rand((32, 16), dtype)
    r = run_instr(lambda d, t: nisa.nc_transpose(d, t, engine=nisa.engine.vector), [y], (16, 32), dtype)
    np.testing.assert_array_equal(r, f32(y).T)


ACTS = {"exp": np.exp, "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0), "square": np.square,
        "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "abs": np.abs, "sin": np.sin,
        "silu": lambda x: x / (1 + np.exp(-x)), "copy": lambda x: x,
        "gelu_apprx_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(ACTS))
def test_activation(name, dtype):
    x = rand((128, 64), dtype)
    bias = rand((128, 1))
    r = run_instr(lambda d, t, b: nisa.activation(d, getattr(nl, name), t, bias=b, scale=0.5), [x, bias], (128, 64), dtype)
    ref = rounded(ACTS[name](f32(x).astype(np.float64) * 0.5 + f32(bias)), dtype)
    np.testing.assert_allclose(r, ref, rtol=2e-6 if dtype == "float32" else 1e-2, atol=1e-6)


def test_activation_reduce_and_reduce_cmd():
    x = rand((128, 100))
    r = run_instr(lambda d, t: (nisa.activation(nl.ndarray((128, 100), nl.float32), nl.exp, t,
                                                reduce_op=nl.add, reduce_res=d)), [x], (128, 1), nl.float32)
    np.testing.assert_allclose(r[:, 0], np.exp(x.astype(np.float64)).sum(1), rtol=1e-5)

    def fn(d, t):
        tmp = nl.ndarray((128, 100), nl.float32)
        nisa.activation(tmp, nl.copy, t, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(tmp, nl.copy, t, reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.activation_reduce(tmp, nl.square, t, reduce_op=nl.add, reduce_res=d)
    r = run_instr(fn, [x], (128, 1), nl.float32)
    np.testing.assert_allclose(r[:, 0], (x.astype(np.float64) ** 2).sum(1), rtol=1e-5)


BIN = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
       "minimum": np.minimum, "divide": np.divide, "greater": np.greater, "equal": np.equal,
       "less_equal": np.less_equal}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", sorted(BIN))
def test_tensor_tensor(op, dtype):
    a, b = rand((128, 48), dtype), rand((128, 48), dtype, 0.5, 2.0)
    r = run_instr(lambda d, x, y: nisa.tensor_tensor(d, x, y, getattr(nl, op)), [a, b], (128, 48), dtype)
    np.testing.assert_array_equal(r, rounded(BIN[op](f32(a), f32(b)).astype(np.float32), dtype))


@pytest.mark.parametrize("dtype", ["int32", "uint8", "int16"])
def test_tensor_tensor_int_and_bitvec(dtype):
    a = RNG.integers(0, 100, (64, 32)).astype(dtype)
    b = RNG.integers(1, 100, (64, 32)).astype(dtype)
    r = run_instr(lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.add), [a, b], (64, 32), dtype)
    np.testing.assert_array_equal(r, np.clip(a.astype(np.int64) + b, np.iinfo(dtype).min, np.iinfo(dtype).max))
    r = run_instr(lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.bitwise_xor), [a, b], (64, 32), dtype)
    np.testing.assert_array_equal(r, a ^ b)


def test_tensor_tensor_power_runs_on_gpsimd():
    a, b = rand((64, 16), "float32", 0.5, 2), rand((64, 16), "float32", -1, 1)
    r = run_instr(lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.power), [a, b], (64, 16), "float32")
    np.testing.assert_allclose(r, np.power(a, b), rtol=1e-6)


def test_tensor_tensor_scan():
    a, b = rand((128, 40)), rand((128, 40))
    r = run_instr(lambda d, x, y: nisa.tensor_tensor_scan(d, x, y, 0.5, nl.multiply, nl.add), [a, b], (128, 40), "float32")
    ref = np.empty_like(a)
    prev = np.full(128, 0.5, np.float32)
    for i in range(40):
        prev = (a[:, i] * prev + b[:, i]).astype(np.float32)
        ref[:, i] = prev
    np.testing.assert_allclose(r, ref, rtol=1e-6)


@pytest.mark.parametrize("dtype", FLOATS)
def test_tensor_scalar(dtype):
    x, v = rand((128, 64), dtype), rand((128, 1), "float32", 0.5, 1.5)
    r = run_instr(lambda d, t, s: nisa.tensor_scalar(d, t, nl.subtract, s, op1=nl.multiply, operand1=3.0),
                  [x, v], (128, 64), dtype)
    np.testing.assert_array_equal(r, rounded((f32(x) - v) * np.float32(3.0), dtype))
    r = run_instr(lambda d, t, s: nisa.tensor_scalar(d, t, nl.subtract, s, reverse0=True), [x, v], (128, 64), dtype)
    np.testing.assert_array_equal(r, rounded(v - f32(x), dtype))


def test_tensor_scalar_bitvec_and_reduce():
    x = RNG.integers(0, 1 << 20, (32, 16)).astype(np.int32)
    r = run_instr(lambda d, t: nisa.tensor_scalar(d, t, nl.bitwise_and, 0xFF, op1=nl.left_shift, operand1=2),
                  [x], (32, 16), "int32")
    np.testing.assert_array_equal(r, (x & 0xFF) << 2)
    y = rand((128, 30))
    r = run_instr(lambda d, t: nisa.tensor_scalar_reduce(nl.ndarray((128, 30), nl.float32), t, nl.multiply, 2.0,
                                                         nl.max, d), [y], (128, 1), "float32")
    np.testing.assert_array_equal(r[:, 0], (y * 2).max(1))


def test_scalar_tensor_tensor():
    x, v, z = rand((128, 32)), rand((128, 1)), rand((128, 32))
    r = run_instr(lambda d, a, s, b: nisa.scalar_tensor_tensor(d, a, nl.multiply, s, nl.add, b), [x, v, z], (128, 32), "float32")
    np.testing.assert_array_equal(r, x * v + z)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op,ref", [("add", np.sum), ("max", np.max), ("min", np.min), ("multiply", np.prod)])
def test_tensor_reduce(op, ref, dtype):
    x = rand((128, 4, 16), dtype, 0.9, 1.1)
    r = run_instr(lambda d, t: nisa.tensor_reduce(d, getattr(nl, op), t, axis=(1, 2)), [x], (128, 1), dtype)
    np.testing.assert_allclose(r[:, 0], rounded(ref(f32(x), axis=(1, 2)), dtype), rtol=1e-6)
    r = run_instr(lambda d, t: nisa.tensor_reduce(d, getattr(nl, op), t, axis=2, negate=True), [x], (128, 4), dtype)
    np.testing.assert_allclose(r, rounded(-ref(f32(x), axis=2), dtype), rtol=1e-6)


def test_tensor_partition_reduce():
    x = rand((64, 8))
    r = run_instr(lambda d, t: nisa.tensor_partition_reduce(d, nl.add, t), [x], (1, 8), "float32")
    np.testing.assert_allclose(r[0], x.sum(0), rtol=1e-6)


@pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("bfloat16", "float32"), ("float32", "float8_e4m3"),
                                     ("float32", "int32"), ("int8", "int8"), ("float16", "float16")])
def test_tensor_copy(src, dst):
    x = rand((128, 32), src, -50, 50) if "int" not in src else RNG.integers(-100, 100, (128, 32)).astype(src)
    r = run_instr(lambda d, t: nisa.tensor_copy(d, t), [x], (128, 32), dst)
    ref = np.rint(f32(x)).astype(dst) if "int" in dst else rounded(f32(x), dst)
    np.testing.assert_array_equal(r, ref)


def test_tensor_copy_predicated():
    x, y = rand((128, 32)), rand((128, 32))
    pred = (RNG.random((128, 32)) > 0.5).astype(np.uint8)

    def fn(d, a, b, p):
        nisa.tensor_copy(d, a)
        nisa.tensor_copy_predicated(d, b, p)
    r = run_instr(fn, [x, y, pred], (128, 32), "float32")
    np.testing.assert_array_equal(r, np.where(pred != 0, y, x))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_memset_and_iota(dtype):
    r = run_instr(lambda d: nisa.memset(d, 7), [], (64, 10), dtype)
    np.testing.assert_array_equal(r, np.full((64, 10), 7))
    r = run_instr(lambda d: nisa.iota(d, [[1, 4], [10, 3]], offset=5, channel_multiplier=100), [], (64, 12), dtype)
    ref = 5 + 100 * np.arange(64)[:, None] + (np.arange(4)[:, None] + 10 * np.arange(3)[None, :]).reshape(-1)[None, :]
    np.testing.assert_array_equal(r, rounded(ref, dtype) if dtype != "int32" else ref)


def test_affine_select_causal_mask():
    x = rand((128, 128))
    r = run_instr(lambda d, t: nisa.affine_select(d, [[-1, 128]], 1, t, -1e4, cmp_op=nl.greater_equal, offset=0),
                  [x], (128, 128), "float32")
    np.testing.assert_array_equal(r, np.where(np.tril(np.ones((128, 128))) > 0, x, np.float32(-1e4)))


def test_range_select():
    x = rand((128, 64))
    lo = RNG.integers(0, 30, (128, 1)).astype(np.float32)
    hi = lo + 20

    def fn(d, t, a, b):
        red = nl.ndarray((128, 1), nl.float32)
        nisa.range_select(d, t, nl.greater_equal, nl.less, a, b, reduce_res=red, on_false_value=-1e9)
        nisa.tensor_tensor(d[:, 0:1], d[:, 0:1], red, nl.multiply)  # exercise reduce_res
    r = run_instr(fn, [x, lo, hi], (128, 64), "float32")
    idx = np.arange(64)[None, :]
    ref = np.where((idx >= lo) & (idx < hi), x, np.float32(-1e9))
    red = ref.max(1)
    ref[:, 0] = ref[:, 0] * red
    np.testing.assert_array_equal(r, ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reciprocal(dtype):
    x = rand((128, 16), dtype, 0.5, 4)
    r = run_instr(lambda d, t: nisa.reciprocal(d, t), [x], (128, 16), dtype)
    np.testing.assert_array_equal(r, rounded(np.float32(1) / f32(x), dtype))


def test_bn_stats_bn_aggr():
    x = rand((128, 700))

    def fn(d, t):
        st = nl.ndarray((128, 12), nl.float32)
        nisa.bn_stats(st[:, 0:6], t[:, 0:512])
        nisa.bn_stats(st[:, 6:12], t[:, 512:700])
        nisa.bn_aggr(d, st)
    r = run_instr(fn, [x], (128, 2), "float32")
    np.testing.assert_allclose(r[:, 0], x.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r[:, 1], x.var(1), rtol=1e-5)


def test_max8_find_index8_match_replace8():
    x = rand((64, 100))
    top = -np.sort(-x, axis=1)[:, :8]
    r = run_instr(lambda d, t: nisa.max8(d, t), [x], (64, 8), "float32")
    np.testing.assert_array_equal(r, top)

    def fn(d, t):
        v = nl.ndarray((64, 8), nl.float32)
        nisa.max8(v, t)
        nisa.nc_find_index8(d, t, v)
    r = run_instr(fn, [x], (64, 8), "uint32")
    np.testing.assert_array_equal(r, np.argsort(-x, axis=1)[:, :8])

    def fn2(d, t):
        v = nl.ndarray((64, 8), nl.float32)
        nisa.max8(v, t)
        nisa.nc_match_replace8(d, t, v, imm=-100.0)
    r = run_instr(fn2, [x], (64, 100), "float32")
    ref = x.copy()
    np.put_along_axis(ref, np.argsort(-x, axis=1)[:, :8], -100.0, axis=1)
    np.testing.assert_array_equal(r, ref)


def test_local_gather():
    # AWS's semantics: a core's 16 x 2 indices, flattened partition-first, are positions in
    # every partition's own row; each partition gathers runs of num_elem_per_idx there
    src = rand((32, 12))
    idx = RNG.integers(0, 6, (32, 2)).astype(np.uint16)
    r = run_instr(lambda d, s, i: nisa.local_gather(d, s, i, num_elem_per_idx=2), [src, idx],
                  (32, 64), "float32")
    for c in range(2):
        pos = idx[16 * c:16 * (c + 1)].T.reshape(-1).astype(np.int64)
        runs = src[16 * c:16 * (c + 1)].reshape(16, 6, 2)[:, pos, :].reshape(16, -1)
        np.testing.assert_array_equal(r[16 * c:16 * (c + 1)], runs)
    # num_valid_indices: only the first ones of each core
    r = run_instr(lambda d, s, i: (nisa.memset(d, -1.0), nisa.local_gather(
        d, s, i, num_elem_per_idx=2, num_valid_indices=5)), [src, idx], (32, 64), "float32")
    pos = idx[:16].T.reshape(-1)[:5].astype(np.int64)
    want = src[:16].reshape(16, 6, 2)[:, pos, :].reshape(16, -1)
    np.testing.assert_array_equal(r[:16, :10], want)
    assert (r[:, 10:] == -1.0).all()


def test_dropout_rng():
    x = rand((128, 256), "float32", 1, 2)
    r = run_instr(lambda d, t: nisa.dropout(d, t, 0.3), [x], (128, 256), "float32")
    kept = r != 0
    np.testing.assert_array_equal(r[kept], x[kept])
    assert 0.25 < 1 - kept.mean() < 0.35
    r = run_instr(lambda d: nisa.dropout(d, nl.ones((128, 4), nl.float32), 1.0), [], (128, 4), "float32")
    assert (r == 0).all()
    r = run_instr(lambda d: nisa.rng(d), [], (128, 64), "float32")
    assert (r >= 0).all() and (r < 1).all() and r.std() > 0.2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_dma_copy_and_rmw_and_transpose(dtype):
    import nki

    x = rand((128, 64), dtype) if dtype != "int8" else RNG.integers(-50, 50, (128, 64)).astype(np.int8)

    @nki.jit
    def k(a):
        out = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)                         # HBM -> HBM
        t = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out, src=t, dst_rmw_op=nl.add)      # out += a
        return out
    r = np.asarray(k(x)).astype(np.float64)
    ref = f32(x).astype(np.float64) * 2
    np.testing.assert_array_equal(r, rounded(ref, dtype) if dtype != "int8" else ref)

    if dtype == "bfloat16":
        @nki.jit
        def kt(a):
            out = nl.ndarray((64, 128), dtype=a.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray((64, 128), dtype=a.dtype, buffer=nl.sbuf)
            nisa.dma_transpose(dst=t, src=a)
            nisa.dma_copy(dst=out, src=t)
            return out
        np.testing.assert_array_equal(f32(kt(x)), f32(x).T)


def test_language_ops_match_numpy():
    import nki

    x, y = rand((128, 64)), rand((128, 64), "float32", 0.5, 2)

    @nki.jit
    def k(a, b):
        out = nl.ndarray((7, 128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        ta, tb = nl.load(a), nl.load(b)
        nl.store(out[0], nl.exp(ta))
        nl.store(out[1], nl.add(ta, tb))
        nl.store(out[2], ta * 2.0 - tb)
        nl.store(out[3], nl.where(nl.greater(ta, 0.0), ta, tb))
        nl.store(out[4], nl.maximum(ta, tb) / tb)
        s = nl.sum(ta, axis=1, keepdims=True)
        nl.store(out[5], nl.multiply(tb, s))
        m = nl.copy(nl.matmul(ta[:, 0:64], tb, transpose_x=True))
        nl.store(out[6, 0:64, :], m)
        nl.store(out[6, 64:128, :], nl.copy(ta[64:128, :]))
        return out
    r = k(x, y)
    np.testing.assert_allclose(r[0], np.exp(x), rtol=1e-6)
    np.testing.assert_array_equal(r[1], x + y)
    np.testing.assert_array_equal(r[2], x * 2 - y)
    np.testing.assert_array_equal(r[3], np.where(x > 0, x, y))
    np.testing.assert_array_equal(r[4], np.maximum(x, y) / y)
    np.testing.assert_allclose(r[5], y * x.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(r[6, :64], x[:, :64].astype(np.float64).T @ y, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(r[6, 64:], x[64:])


def test_missing_instruction_is_named():
    import nki.errors
    with pytest.raises(NotImplementedError, match="nki.isa.tensor_copy_dynamic_src"):
        nisa.tensor_copy_dynamic_src
    with pytest.raises(nki.errors.UnsupportedError, match="atomic_rmw"):
        nl.atomic_rmw


@pytest.mark.parametrize("reverse", [False, True])
def test_select_reduce_against_numpy(reverse):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((128, 96)).astype(np.float32)
    pred = (rng.random((128, 96)) > 0.5).astype(np.uint8)
    fill = rng.standard_normal((128, 1)).astype(np.float32)

    @nki.jit
    def k(x, pred, fill):
        t, p, f = nl.load(x), nl.load(pred), nl.load(fill)
        d = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        m = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=d, predicate=p, on_true=t, on_false=f, reduce_res=m,
                           reduce_op=nl.maximum, reverse_pred=reverse)
        d2 = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=d2, predicate=p, on_true=t, on_false=-1.0)
        out = nl.ndarray((128, 2 * 96 + 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out[:, 0:96], d)
        nl.store(out[:, 96:192], d2)
        nl.store(out[:, 192:193], m)
        return out
    r = k(x, pred, fill)
    keep = (pred != 0) != reverse
    ref = np.where(keep, x, fill)
    np.testing.assert_array_equal(r[:, :96], ref)
    np.testing.assert_array_equal(r[:, 96:192], np.where(pred != 0, x, -1.0))
    np.testing.assert_array_equal(r[:, 192], ref.max(axis=1))


def test_select_reduce_rules():
    @nki.jit
    def k(x):
        t = nl.load(x)
        d = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=d, predicate=t, on_true=t, on_false=0.0)  # PRED
    with pytest.raises(nki.errors.DtypeLegalityError, match=r"predicate dtype .*\(at .*test_isa.py"):
        k(np.zeros((128, 8), np.float32))
