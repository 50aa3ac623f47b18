"""Properties of the timing model (numbers come from the hardware profile)."""
import json

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nki.examples import matmul

RNG = np.random.default_rng(2)
BF16 = ml_dtypes.bfloat16


def bench(kernel, *args, target=None):
    return nki.benchmark(kernel, target=target)(*args)


def test_better_blocked_matmul_is_faster():
    a = RNG.standard_normal((512, 256)).astype(BF16)
    b = RNG.standard_normal((512, 2048)).astype(BF16)
    t1 = bench(matmul.matmul_basic, a, b)
    t2 = bench(matmul.matmul_hoisted, a, b)
    t3 = bench(matmul.matmul_blocked, a, b)
    assert t1.latency_ns > t2.latency_ns > t3.latency_ns
    assert t1.dma_bytes > t2.dma_bytes > t3.dma_bytes
    np.testing.assert_array_equal(t1.outputs, t3.outputs)


def _stream(reuse_buffer):
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        T = x.shape[0] // 128
        shared = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        for i in range(T):
            t = shared if reuse_buffer else nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x[i * 128:(i + 1) * 128, :])
            y = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
            nisa.activation(dst=y, op=nl.exp, data=t)
            nisa.activation(dst=y, op=nl.tanh, data=y)
            nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=y)
        return out
    return k


def test_overlapping_dma_with_compute_is_faster():
    x = RNG.standard_normal((128 * 8, 2048)).astype(np.float32)
    serial = bench(_stream(True), x)
    overlapped = bench(_stream(False), x)
    np.testing.assert_array_equal(serial.outputs, overlapped.outputs)
    assert overlapped.latency_ns < 0.8 * serial.latency_ns


def _mm_bound(dtype):
    @nki.jit
    def k(a):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        s = nl.ndarray((128, 128), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=a[:, 0:128])
        m = nl.ndarray((128, 512), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=m, src=a)
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        for i in range(64):
            nisa.nc_matmul(dst=acc, stationary=s, moving=m, accumulate=i > 0)
        r = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=acc)
        nisa.dma_copy(dst=out, src=r)
        return out
    return k


def test_fp32_matmul_about_4x_bf16():
    a32 = RNG.standard_normal((128, 512)).astype(np.float32)
    t32 = bench(_mm_bound(np.float32), a32)
    t16 = bench(_mm_bound(BF16), a32.astype(BF16))
    pe32, pe16 = t32.engine_busy_ns["tensor"], t16.engine_busy_ns["tensor"]
    assert 3.5 < pe32 / pe16 < 4.5
    assert 2.5 < t32.latency_ns / t16.latency_ns < 4.5


def test_target_selection_and_clock_scaling(monkeypatch):
    x = RNG.standard_normal((128, 2048)).astype(np.float32)
    k = _stream(False)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    r3 = bench(k, x)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    r2 = bench(k, x)
    r1 = bench(k, x, target="trn1")
    assert (r3.target, r2.target, r1.target) == ("trn3", "trn2", "trn1")
    assert r3.latency_ns < r2.latency_ns          # faster DMA queues on trn3
    assert r3.engine_busy_ns["scalar"] == pytest.approx(r2.engine_busy_ns["scalar"])   # 1.2 GHz both


def test_result_fields_and_trace(tmp_path):
    a = RNG.standard_normal((256, 256)).astype(BF16)
    b = RNG.standard_normal((256, 512)).astype(BF16)
    r = nki.profile(matmul.matmul_blocked, trace_path=str(tmp_path / "t.json"))(a, b)
    assert r.latency_ns > 0 and r.instruction_count == len(r.timeline)
    assert all(0 <= v <= 100 for v in r.engine_busy_pct.values())
    assert r.dma_bytes == a.nbytes + b.nbytes + 256 * 512 * 2
    tr = json.load(open(tmp_path / "t.json"))
    names = {e["name"] for e in tr["traceEvents"] if e["ph"] == "X"}
    assert {"nc_matmul", "dma_copy", "tensor_copy"} <= names
    lanes = {e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "TensorE" in lanes and any(n.startswith("DMA queue") for n in lanes)
    assert "trn2" in r.summary()


def test_dependent_chain_pays_semaphore_latency():
    from neuronhw import get_profile

    @nki.jit
    def k(a):
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.0)                           # VectorE
        u = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=u, op=nl.exp, data=t)               # ScalarE waits on VectorE
    r = bench(k, np.zeros((1, 1), np.float32))
    assert r.latency_ns >= get_profile("trn2").semaphore_ns


def test_work_after_a_register_load_waits_for_its_value():
    """A loaded register may steer what follows (dynamic control flow, DMA addresses), so
    nothing issued after the load starts before the value is computed, on any engine."""
    def make(load):
        @nki.jit
        def k(a, b):
            t = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            s = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=s, op=nl.add, data=t, axis=1)      # VectorE, after the DMA
            if load:
                r = nisa.register_alloc(0)
                nisa.register_load(r, s[0:1, 0:1])
            u = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=u, src=b)                               # independent of s
            out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=u)
            return out
        return k
    a, b = np.ones((128, 2048), np.float32), np.ones((128, 512), np.float32)
    free, held = bench(make(False), a, b), bench(make(True), a, b)
    reduce_end = max(st + d for name, lane, st, d, _ in held.timeline if name == "tensor_reduce")
    starts = [st for name, lane, st, d, _ in held.timeline if name == "dma_copy"]
    assert starts[1] >= reduce_end            # b's load waited for the register
    assert held.latency_ns > free.latency_ns


def test_kernel_called_from_a_kernel_joins_its_program():
    """A jit kernel called inside a running kernel is a sub-kernel: one run, one timeline,
    its SBUF tiles shared with the caller (NKI-lib's fused blocks are built this way)."""
    @nki.jit
    def scale(t):
        nisa.activation(dst=t, op=nl.copy, data=t, scale=2.0)
        return t

    @nki.jit
    def outer(a):
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        t = scale(t)                      # an SBUF tile in and out: only a sub-kernel can
        out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    a = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    r = bench(outer, a)
    assert np.array_equal(r.outputs, 2 * a)
    assert [e[0] for e in r.timeline].count("activation") == 1
