"""nki.lnc: the two cores of an LNC=2 launch (kernel[2]) synchronising and exchanging tiles.
Results equal NumPy; the rendezvous joins the cores' timelines; kernels that would deadlock
the chip raise, and the process stays usable."""
import threading
import warnings

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nki.lnc as lnc
from nki import errors as E

RNG = np.random.default_rng(11)


def _load_half(a):
    """In a kernel: a shared HBM output like ``a``, the core's rank, and its half of ``a``."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    r = nl.program_id(0)
    t = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[r * 128:(r + 1) * 128, :])
    return out, r, t


def _exchange_kernel(op=None, dtype=None):
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=dtype or a.dtype, buffer=nl.shared_hbm)
        r = nl.program_id(0)
        p = a.shape[0] // 2
        mine = nl.ndarray((p, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        got = nl.ndarray((p, a.shape[1]), dtype=dtype or a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine, src=a[r * p:(r + 1) * p, :])
        if op is None:
            lnc.sendrecv(src=mine, dst=got, send_to_rank=1 - r, recv_from_rank=1 - r)
        else:
            lnc.sendrecv_compute(src=mine, dst=got, send_to_rank=1 - r, recv_from_rank=1 - r,
                                 reduce_op=op)
        nisa.dma_copy(dst=out[r * p:(r + 1) * p, :], src=got)
        return out
    return k


def test_sendrecv_swaps_the_cores_tiles():
    a = RNG.standard_normal((256, 96)).astype(np.float32)
    out = _exchange_kernel()[2](a)
    np.testing.assert_array_equal(out, np.concatenate([a[128:], a[:128]]))


def test_sendrecv_into_a_bf16_tile_rounds_like_numpy():
    import ml_dtypes
    a = RNG.standard_normal((256, 32)).astype(np.float32)
    out = _exchange_kernel(dtype=nl.bfloat16)[2](a)
    want = np.concatenate([a[128:], a[:128]]).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out, np.float32), want)


@pytest.mark.parametrize("op,fn", [(nl.add, np.add), (nl.maximum, np.maximum), (nl.minimum, np.minimum)])
def test_sendrecv_compute_reduces_both_cores_tiles(op, fn):
    a = RNG.standard_normal((256, 64)).astype(np.float32)
    out = _exchange_kernel(op)[2](a)
    both = fn(a[:128], a[128:])
    np.testing.assert_array_equal(out, np.concatenate([both, both]))


def test_core_barrier_orders_writes_to_shared_hbm():
    """Each core writes its half of a shared HBM tensor, meets the peer, then reads the
    whole tensor: both cores see both halves (program order alone would not)."""
    @nki.jit
    def k(a):
        scratch = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        out = nl.ndarray((2, 128, a.shape[1]), dtype=a.dtype, buffer=nl.shared_hbm)
        r = nl.program_id(0)
        t = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[r * 128:(r + 1) * 128, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=float(2.0))
        nisa.dma_copy(dst=scratch[r * 128:(r + 1) * 128, :], src=t)
        lnc.core_barrier(scratch, (0, 1))
        other = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=other, src=scratch[(1 - r) * 128:(2 - r) * 128, :])
        nisa.dma_copy(dst=out[r], src=other)
        return out
    a = RNG.standard_normal((256, 48)).astype(np.float32)
    out = k[2](a)
    np.testing.assert_array_equal(out[0], 2 * a[128:])
    np.testing.assert_array_equal(out[1], 2 * a[:128])


def test_a_ring_of_exchanges_pairs_by_position():
    """Three exchanges in a row, each feeding the next: the n-th pairs with the peer's n-th
    (an all-reduce by repeated sendrecv_compute stays the sum)."""
    @nki.jit
    def k(a):
        out = nl.ndarray((2, 128, a.shape[1]), dtype=a.dtype, buffer=nl.shared_hbm)
        r = nl.program_id(0)
        acc = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc, src=a[r * 128:(r + 1) * 128, :])
        for _ in range(3):
            nxt = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
            lnc.sendrecv_compute(src=acc, dst=nxt, send_to_rank=1 - r, recv_from_rank=1 - r,
                                 reduce_op=nl.add)
            acc = nxt
        nisa.dma_copy(dst=out[r], src=acc)
        return out
    a = RNG.integers(-4, 4, (256, 16)).astype(np.float32)     # exact in fp32
    out = k[2](a)
    s = a[:128] + a[128:]
    for _ in range(2):
        s = s + s
    np.testing.assert_array_equal(out[0], s)
    np.testing.assert_array_equal(out[1], s)


def test_a_grid_of_two_pairs_exchanges_within_each_pair():
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        g = nl.program_id(0)
        r = g % 2
        t = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        got = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[g * 128:(g + 1) * 128, :])
        lnc.sendrecv(src=t, dst=got, send_to_rank=1 - r, recv_from_rank=1 - r)
        nisa.dma_copy(dst=out[g * 128:(g + 1) * 128, :], src=got)
        return out
    a = RNG.standard_normal((512, 8)).astype(np.float32)
    out = k[4](a)
    np.testing.assert_array_equal(out, np.concatenate([a[128:256], a[:128], a[384:], a[256:384]]))


def _barrier_after(work_on_core0: int):
    @nki.jit
    def k(a):
        out, r, t = _load_half(a)
        if r == 0:
            for _ in range(work_on_core0):
                nisa.activation(dst=t, op=nl.exp, data=t)
        nisa.dma_copy(dst=out[r * 128:(r + 1) * 128, :], src=t)
        lnc.core_barrier(out, (0, 1))
        nisa.dma_copy(dst=t, src=out[r * 128:(r + 1) * 128, :])
        return out
    return k


def test_the_barrier_holds_the_idle_core_until_the_busy_one_arrives():
    a = RNG.standard_normal((256, 512)).astype(np.float32) * 0.01
    res = nki.benchmark(_barrier_after(8)[2])(a)
    ev = {}
    for name, lane, start, dur, _ in res.timeline:
        ev.setdefault(name, []).append((start, dur, lane))
    from neuronhw import get_profile
    sem = get_profile("trn2").semaphore_ns
    # Core 0's barrier starts after its own write; core 1's, after core 0's arrival + the
    # semaphore latency, although core 1 had nothing else to do.
    barriers = sorted(ev["core_barrier"])
    acts = ev["activation"]
    assert len(barriers) == 2 and len(acts) == 8
    last_act_end = max(s + d for s, d, _ in acts)
    assert barriers[1][0] >= last_act_end + sem - 1e-6
    # Without the work, the barrier comes much earlier: the model sees the wait.
    quick = nki.benchmark(_barrier_after(0)[2])(a)
    assert res.latency_ns > quick.latency_ns + sum(d for _, d, _ in acts) * 0.9


def test_the_deprecated_isa_names_warn_and_work():
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        r = nl.program_id(0)
        t = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        got = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[r * 128:(r + 1) * 128, :])
        nisa.sendrecv(t, got, 1 - r, 1 - r, pipe_id=0)
        nisa.dma_copy(dst=out[r * 128:(r + 1) * 128, :], src=got)
        nisa.core_barrier(out, (0, 1))
        return out
    a = RNG.standard_normal((256, 8)).astype(np.float32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = k[2](a)
    np.testing.assert_array_equal(out, np.concatenate([a[128:], a[:128]]))
    msgs = [str(x.message) for x in w if issubclass(x.category, DeprecationWarning)]
    assert any("nki.isa.sendrecv is deprecated; use nki.lnc.sendrecv" in m for m in msgs)
    assert any("nki.isa.core_barrier is deprecated" in m for m in msgs)
    # The warning points at the kernel's line, not at the wrapper.
    assert all(x.filename == __file__ for x in w if issubclass(x.category, DeprecationWarning))


# ----------------------------------------------------------------------------------------
# Kernels that would deadlock or break a rule say so; the process stays usable.

def _mismatched(kind1):
    @nki.jit
    def k(a):
        out, r, t = _load_half(a)
        if r == 0 or kind1 == "barrier":
            lnc.core_barrier(out, (0, 1))
        elif kind1 == "sendrecv":
            lnc.sendrecv(src=t, dst=t, send_to_rank=0, recv_from_rank=0)
        nisa.dma_copy(dst=out[r * 128:(r + 1) * 128, :], src=t)
        return out
    return k


@pytest.mark.parametrize("kind1,match", [("sendrecv", "core 0's 1st core-to-core instruction is "
                                                      "core_barrier and core 1's is sendrecv"),
                                         ("nothing", "core 0 issued its 1st core-to-core instruction "
                                                     "but core 1's program ended after 0")])
def test_cores_that_would_deadlock_raise(kind1, match):
    a = RNG.standard_normal((256, 8)).astype(np.float32)
    with pytest.raises(E.NkiRuleError, match=match):
        _mismatched(kind1)[2](a)
    assert not [t for t in threading.enumerate() if t.name.startswith("nki-core1")]
    np.testing.assert_array_equal(_exchange_kernel()[2](a), np.concatenate([a[128:], a[:128]]))


def test_an_error_on_core_1_reaches_the_caller():
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        r = nl.program_id(0)
        lnc.core_barrier(out, (0, 1))
        if r == 1:
            nl.ndarray((256, 8), dtype=a.dtype, buffer=nl.sbuf)     # 256 partitions
        return out
    with pytest.raises(E.PartitionDimensionError, match="partition dimension 256"):
        k[2](np.zeros((256, 8), np.float32))


def test_rules():
    a = np.zeros((256, 8), np.float32)

    def run(body, grid=2, target=None):
        @nki.jit(platform_target=target)
        def k(a):
            out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray((128, 8), dtype=a.dtype, buffer=nl.sbuf)
            body(out, t, nl.program_id(0))
            return out
        return k[grid](a) if grid else k(a)

    with pytest.raises(E.UnsupportedError, match=r"single program.*kernel\[2\]"):
        run(lambda o, t, r: lnc.core_barrier(o, (0, 1)), grid=None)
    with pytest.raises(E.UnsupportedError, match="NeuronCore-v3 or newer"):
        run(lambda o, t, r: lnc.core_barrier(o, (0, 1)), target="trn1")
    with pytest.raises(E.NkiRuleError, match="only cores=\\(0, 1\\)"):
        run(lambda o, t, r: lnc.core_barrier(o, (0, 2)))
    with pytest.raises(E.NkiRuleError, match="data must be the shared HBM tensor"):
        run(lambda o, t, r: lnc.core_barrier(t, (0, 1)))
    with pytest.raises(E.NkiRuleError, match="core 0 names itself as send_to_rank"):
        run(lambda o, t, r: lnc.sendrecv(src=t, dst=t, send_to_rank=r, recv_from_rank=1 - r))
    with pytest.raises(E.NkiRuleError, match="send_to_rank must be 0 or 1"):
        run(lambda o, t, r: lnc.sendrecv(src=t, dst=t, send_to_rank=2, recv_from_rank=1 - r))
    with pytest.raises(E.NkiRuleError, match="reduce_op must be nl.add, nl.maximum or nl.minimum"):
        run(lambda o, t, r: lnc.sendrecv_compute(src=t, dst=t, send_to_rank=1 - r, recv_from_rank=1 - r,
                                                 reduce_op=nl.multiply))
    with pytest.raises(E.NkiRuleError, match="same memory space"):
        run(lambda o, t, r: lnc.sendrecv_compute(src=t, dst=o[0:128, :], send_to_rank=1 - r,
                                                 recv_from_rank=1 - r, reduce_op=nl.add))
    with pytest.raises(E.NkiRuleError, match="priority needs NeuronCore-v4"):
        run(lambda o, t, r: lnc.sendrecv(src=t, dst=t, send_to_rank=1 - r, recv_from_rank=1 - r,
                                         priority=1))
    run(lambda o, t, r: lnc.sendrecv(src=t, dst=t, send_to_rank=1 - r, recv_from_rank=1 - r,
                                     priority=1), target="trn3")


def test_the_module_has_aws_names():
    assert set(lnc.__all__) == {"core_barrier", "sendrecv", "sendrecv_compute"}
    assert nki.lnc is lnc
