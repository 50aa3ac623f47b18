"""Classic kernels (the examples under nki/examples) against NumPy, and launch features."""
import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nki.examples import attention, layernorm, matmul, rmsnorm, softmax, transpose

RNG = np.random.default_rng(1)
BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("kernel", [matmul.matmul_basic, matmul.matmul_hoisted, matmul.matmul_blocked])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_matmul_stages(kernel, dtype):
    a = RNG.standard_normal((256, 256)).astype(dtype)
    b = RNG.standard_normal((256, 1024)).astype(dtype)
    r = kernel(a, b)
    assert r.dtype == np.dtype(dtype)
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    if dtype == np.float32:
        np.testing.assert_allclose(r, ref, rtol=1e-4, atol=1e-3)
    else:   # fp32 accumulation, one bf16 rounding of the result
        np.testing.assert_allclose(r.astype(np.float32), ref, rtol=8e-3, atol=1e-2)


def _softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.mark.parametrize("kernel", [softmax.softmax_kernel, softmax.softmax_language])
def test_softmax(kernel):
    x = RNG.standard_normal((256, 300)).astype(np.float32) * 4
    np.testing.assert_allclose(kernel(x), _softmax(x.astype(np.float64)), rtol=1e-5, atol=1e-7)


def test_softmax_bf16():
    x = RNG.standard_normal((128, 64)).astype(BF16)
    r = softmax.softmax_kernel(x)
    assert r.dtype == BF16
    np.testing.assert_allclose(r.astype(np.float32), _softmax(x.astype(np.float64)), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("kernel", [rmsnorm.rmsnorm_kernel, rmsnorm.rmsnorm_language])
def test_rmsnorm(kernel):
    x = RNG.standard_normal((256, 200)).astype(np.float32)
    w = RNG.standard_normal((1, 200)).astype(np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(kernel(x, w), ref, rtol=1e-5, atol=1e-6)


def test_layernorm():
    x = RNG.standard_normal((256, 1000)).astype(np.float32) + 3
    ref = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(layernorm.layernorm_kernel(x), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_transpose(dtype):
    x = RNG.standard_normal((256, 384)).astype(dtype)
    np.testing.assert_array_equal(transpose.transpose_kernel(x), x.T)


@pytest.mark.parametrize("causal", [True, False])
def test_attention(causal):
    S, d = 256, 64
    q, k, v = (RNG.standard_normal((S, d)).astype(np.float32) for _ in range(3))
    s = q.astype(np.float64) @ k.T / np.sqrt(d)
    if causal:
        s = np.where(np.tril(np.ones((S, S))) > 0, s, -np.inf)
    ref = _softmax(s) @ v
    r = attention.attention_kernel(np.ascontiguousarray(q.T), np.ascontiguousarray(k.T), v, causal=causal)
    np.testing.assert_allclose(r, ref, rtol=1e-4, atol=1e-5)


def test_grid_program_id_and_shared_output():
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        i = nl.program_id(0)
        n = nl.num_programs(0)
        rows = a.shape[0] // n
        t = nl.load(a[i * rows:(i + 1) * rows, :])
        nl.store(out[i * rows:(i + 1) * rows, :], nl.multiply(t, float(i + 1)))
        return out
    a = np.ones((256, 8), np.float32)
    r = k[2](a)
    np.testing.assert_array_equal(r[:128], 1)
    np.testing.assert_array_equal(r[128:], 2)
    r = nki.simulate(k[2])(a)
    np.testing.assert_array_equal(r[128:], 2)


def test_loops_fori_while_and_deprecated_ranges():
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        acc = nl.zeros(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        t = nl.load(a)

        def body(i):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
        nl.fori_loop(0, 3, body)
        for _ in nl.affine_range(2):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
        for _ in nl.sequential_range(1):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
        for _ in nl.static_range(1):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
        cnt = nisa.register_alloc(4)

        def wbody(r):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
            return nisa.register_alloc(r.value - 1)
        nl.while_loop(cnt, wbody)
        nl.store(out, acc)
        return out
    a = np.full((128, 4), 0.5, np.float32)
    np.testing.assert_array_equal(k(a), 0.5 * 11)


def test_dynamic_offsets_from_registers():
    # Offsets read from device memory into registers select the rows and columns to copy.
    @nki.jit
    def gather_blocks(a, offs):
        n = offs.shape[1]
        out = nl.ndarray((n * 32, 64), dtype=a.dtype, buffer=nl.shared_hbm)
        o = nl.load(offs)
        r = nisa.register_alloc(0)
        for j in range(n):
            nisa.register_load(r, o[0:1, j:j + 1])
            t = nl.ndarray((32, 64), dtype=a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a[nl.ds(r, 32), nl.ds(r, 64)])
            nl.store(out[j * 32:(j + 1) * 32, :], t)
        return out
    a = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    offs = np.array([[5, 0, 100, 7]], np.int32)
    ref = np.concatenate([a[o:o + 32, o:o + 64] for o in offs[0]])
    np.testing.assert_array_equal(gather_blocks(a, offs), ref)
    with pytest.raises(nki.errors.IndexOutOfBoundsError, match="out of bounds"):
        gather_blocks(a, np.array([[230]], np.int32))


def test_indexing_ds_arange_mgrid():
    @nki.jit
    def k(a):
        out = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.shared_hbm)
        i_p, i_f = nl.arange(128)[:, None], nl.arange(64)[None, :]
        t = nl.load(a[i_p, i_f + 64])
        g = nl.mgrid[0:128, 0:32]
        u = nl.load(a[g.p, g.x])
        nl.store(out[:, nl.ds(0, 32)], u)
        nl.store(out[:, nl.ds(32, 32)], t[:, 32:64])
        return out
    a = RNG.standard_normal((128, 128)).astype(np.float32)
    r = k(a)
    np.testing.assert_array_equal(r[:, :32], a[:, :32])
    np.testing.assert_array_equal(r[:, 32:], a[:, 96:128])


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")

    @nki.jit
    def k(a, b):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.add(nl.load(a), nl.load(b)))
        return out
    a, b = torch.randn(128, 16), torch.randn(128, 16)
    r = k(a, b)
    assert isinstance(r, torch.Tensor) and r.dtype == torch.float32
    torch.testing.assert_close(r, a + b, rtol=0, atol=0)
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    r = k(ab, bb)
    assert r.dtype == torch.bfloat16
    torch.testing.assert_close(r, (ab.float() + bb.float()).to(torch.bfloat16), rtol=0, atol=0)


def test_kernel_writes_inputs_in_place():
    @nki.jit
    def k(a):
        t = nl.load(a)
        nl.store(a, nl.multiply(t, 2.0))
    a32 = np.ones((128, 4), np.float32)
    k(a32)
    np.testing.assert_array_equal(a32, 2)
    abf = np.ones((128, 4), BF16)
    k(abf)
    np.testing.assert_array_equal(abf.astype(np.float32), 2)


def test_matmul_in_forked_child_after_parent_used_gemm_workers():
    # GEMM worker threads do not survive fork; the child must start its own.
    import os
    from nki.examples.matmul import matmul_basic
    rng = np.random.default_rng(5)
    a = rng.standard_normal((256, 128)).astype(np.float32)
    b = rng.standard_normal((256, 512)).astype(np.float32)
    np.testing.assert_allclose(matmul_basic(a, b), a.T @ b, rtol=1e-4, atol=1e-4)
    pid = os.fork()
    if pid == 0:
        ok = np.allclose(matmul_basic(a, b), a.T @ b, rtol=1e-4, atol=1e-4)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
