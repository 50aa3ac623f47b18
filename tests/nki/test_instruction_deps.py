"""nki.isa operations return NkiInstruction handles; ``c.depends_on(a)`` makes c start after
a completes in the timing model and never changes results."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from neuronhw import get_profile
from nki import errors as E

SEM = get_profile("trn2").semaphore_ns
A = np.random.default_rng(5).random((128, 2048)).astype(np.float32)


def _kernel(edges):
    """load a -> t (DMA), memset u (VectorE, independent), u += t, store. ``edges`` says
    how the memset is tied to the load."""
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        u = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        v = nl.ndarray((128, 1), dtype=a.dtype, buffer=nl.sbuf)
        ld = nisa.dma_copy(dst=t, src=a)
        side = nisa.memset(dst=v, value=0.0)
        m = nisa.memset(dst=u, value=1.0)
        if edges == "load":
            assert m.depends_on(ld) is m
        elif edges == "chain":
            m.depends_on(side).depends_on(ld)
        elif edges == "both":
            m.depends_on(side, ld)
        elif edges == "same-engine":
            m.depends_on(side)
        nisa.tensor_tensor(dst=u, data1=u, data2=t, op=nl.add)
        nisa.dma_copy(dst=out, src=u)
        return out
    return k


def _events(edges):
    r = nki.benchmark(_kernel(edges))(A)
    np.testing.assert_array_equal(r.outputs, A + 1)          # edges never change results
    return r, {(name, i): ev for i, name in enumerate(["load", "side", "memset", "add", "store"])
               for ev in [r.timeline[i]] if ev[0] in ("dma_copy", "memset", "tensor_tensor")}


def test_every_operation_returns_a_handle():
    got = []

    @nki.jit
    def k(a):
        t = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.sbuf)
        p = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.psum)
        got.append(nisa.dma_copy(dst=t, src=a))
        got.append(nisa.activation(dst=t, op=nl.exp, data=t))
        got.append(nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0))
        got.append(nisa.nc_matmul(dst=p, stationary=t[:, 0:64], moving=t))
        got.append(nisa.tensor_copy(dst=t[0:64, :], src=p))
        out = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.shared_hbm)
        got.append(nisa.dma_copy(dst=out, src=t))
        return out
    k(np.zeros((128, 64), np.float32))
    assert all(isinstance(h, nisa.NkiInstruction) for h in got)
    assert repr(got[1]) == "NkiInstruction(nki.isa.activation)"


def test_an_edge_starts_the_consumer_after_the_producer_plus_the_semaphore():
    free, _ = _events(None)
    tied, _ = _events("load")
    load = tied.timeline[0]
    memset_free, memset_tied = free.timeline[2], tied.timeline[2]
    assert memset_free[2] < load[2] + load[3]          # without the edge it overlaps the load
    assert memset_tied[2] == pytest.approx(load[2] + load[3] + SEM)
    # VectorE runs in order: the add after the memset moves with it, and so does the end.
    add = tied.timeline[3]
    assert add[2] >= memset_tied[2] + memset_tied[3] - 1e-9
    assert tied.latency_ns > free.latency_ns


def test_chained_and_listed_edges_agree():
    chain, _ = _events("chain")
    both, _ = _events("both")
    assert [ev[2] for ev in chain.timeline] == [ev[2] for ev in both.timeline]


def test_an_edge_to_a_finished_producer_on_the_same_engine_changes_nothing():
    free, _ = _events(None)
    same, _ = _events("same-engine")
    assert [ev[2] for ev in same.timeline] == [ev[2] for ev in free.timeline]


def test_bad_edges_are_refused():
    def run(body):
        @nki.jit
        def k(a):
            t = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.sbuf)
            body(a, t)
            return a
        return nki.benchmark(k)(np.zeros((128, 64), np.float32))

    def older(a, t):
        first = nisa.dma_copy(dst=t, src=a)
        second = nisa.memset(dst=t, value=0.0)
        nisa.activation(dst=t, op=nl.exp, data=t)
        second.depends_on(first)

    with pytest.raises(E.UnsupportedError, match="only be added to the instruction issued last"):
        run(older)
    with pytest.raises(E.NkiRuleError, match="must be the NkiInstruction handles"):
        run(lambda a, t: nisa.memset(dst=t, value=0.0).depends_on(t))


def test_a_functional_run_accepts_edges():
    np.testing.assert_array_equal(_kernel("load")(A), A + 1)
