"""``nki.lnc``: the two physical NeuronCores of a logical core (LNC=2) synchronising and
exchanging tiles, as AWS documents the module: ``core_barrier``, ``sendrecv`` and
``sendrecv_compute``. A kernel launched as ``kernel[2]`` runs one program per core
(``nl.program_id(0)`` is the core's rank); the simulator runs the pair in turns and joins
their timelines at each of these instructions (``nki/simulator/lnc.py``).
"""
from __future__ import annotations

import numpy as np

from . import errors as E
from .isa._common import _ENG, _T, _put
from .isa._instruction import issued
from .isa.constants import dma_engine, engine
from .simulator import context as _ctx
from .simulator import lnc as _lnc
from .simulator import rules as _rules

__all__ = ["core_barrier", "sendrecv", "sendrecv_compute"]

_REDUCE = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum}


def _sim(instr):
    sim = _ctx.current()
    if sim.profile.nki_target == "gen2":
        _rules.fail(E.UnsupportedError, f"nki.lnc.{instr}: available only on NeuronCore-v3 or newer; "
                                        f"{sim.target} has {sim.profile.core_version}")
    return sim


def _rank(sim, pair):
    return sim.k - pair.k0


def _priority(instr, sim, priority, dma=None):
    if priority is None:
        return
    if dma == dma_engine.gpsimd_dma:
        _rules.fail(E.NkiRuleError, f"nki.lnc.{instr}: priority must be None with "
                                    f"dma_engine.gpsimd_dma, got {priority!r}")
    if not (isinstance(priority, int) and 0 <= priority <= 3):
        _rules.fail(E.NkiRuleError, f"nki.lnc.{instr}: priority runs from 0 (highest) to 3 (lowest), "
                                    f"got {priority!r}")
    if sim.profile.nki_target == "gen3":
        _rules.fail(E.NkiRuleError, f"nki.lnc.{instr}: a DMA priority needs NeuronCore-v4 or newer; "
                                    f"{sim.target} has {sim.profile.core_version}")


def _peers(instr, rank, send_to_rank, recv_from_rank):
    for what, r in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if r not in (0, 1):
            _rules.fail(E.NkiRuleError, f"nki.lnc.{instr}: {what} must be 0 or 1 (a rank within the "
                                        f"LNC=2 logical core), got {r!r}")
        if r == rank:
            _rules.fail(E.NkiRuleError, f"nki.lnc.{instr}: core {rank} names itself as {what}; the "
                                        f"peer core is {1 - rank}")


def _on_chip_or_hbm(instr, t, what):
    if t.kind == "psum":
        _rules.fail(E.NkiRuleError, f"nki.lnc.{instr}: {what} is in PSUM, which DMA cannot reach "
                                    f"(SBUF or HBM)")


def _dma_timing(sim, pair, slot, instr):
    """Both cores' transfers start together, once each side's source and destination are
    ready: a sendrecv is a rendezvous of two DMAs."""
    if not sim.timing:
        return
    tls = {r: sim.timelines[(pair.k0 + r) % len(sim.timelines)] for r in slot}
    info = {}
    for r, a in slot.items():
        src, dst = a.args[0], a.args[1]
        rows = src.shape[0] if src.kind != "hbm" else max(1, src.size // max(1, src.shape[-1]))
        info[r] = (src, dst, rows)
    start = max(tls[r].earliest("dma", [info[r][0].box()], [info[r][1].box()], info[r][2]) for r in slot)
    for r in sorted(slot):
        src, dst, rows = info[r]
        nbytes = src.size * src.dtype.itemsize
        tls[r].dma(instr, nbytes, rows, max(1, nbytes // rows), "hbm" in (src.kind, dst.kind),
                   [src.box()], [dst.box()], not_before=start)


@issued
def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Core 0 and core 1 wait for each other here: each core's earlier writes to ``data``
    (shared HBM) are complete before either core reads it after the barrier."""
    I = "core_barrier"
    sim = _sim(I)
    _T(data, "data", I)
    if tuple(cores) != (0, 1):
        _rules.fail(E.NkiRuleError, f"nki.lnc.{I}: only cores=(0, 1) is supported, got {tuple(cores)}")
    if data.kind != "hbm":
        _rules.fail(E.NkiRuleError, f"nki.lnc.{I}: data must be the shared HBM tensor the cores "
                                    f"synchronise on, got a {data.kind.upper()} tile")
    eng = _ENG.get(engine)
    if eng is None:
        _rules.fail(E.NkiRuleError, f"nki.lnc.{I}: engine must be nki.isa.engine.tensor, vector, "
                                    f"scalar or gpsimd, got {engine!r}")
    pair = _lnc.pair_for(sim, I)

    def complete(slot):
        if not sim.timing:
            return
        tls = {r: sim.timelines[(pair.k0 + r) % len(sim.timelines)] for r in slot}
        arrive = {r: tls[r].earliest(eng, [slot[r].args[0].box()], []) for r in slot}
        # Each core's local semaphore wait ends when the peer's remote update lands.
        for r in sorted(slot):
            tls[r].compute(I, eng, 0, [slot[r].args[0].box()], [slot[r].args[0].box()],
                           not_before=arrive[1 - r] + sim.profile.semaphore_ns)

    sim.count += 1
    pair.meet(_rank(sim, pair), I, (data,), complete)


def _exchange(I, src, dst, send_to_rank, recv_from_rank, reduce=None):
    sim = _sim(I)
    _T(src, "src", I), _T(dst, "dst", I)
    _on_chip_or_hbm(I, src, "src"), _on_chip_or_hbm(I, dst, "dst")
    pair = _lnc.pair_for(sim, I)
    rank = _rank(sim, pair)
    _peers(I, rank, send_to_rank, recv_from_rank)

    def complete(slot):
        for r, a in slot.items():
            peer_src = slot[1 - r].args[0]
            if peer_src.size != a.args[1].size:
                _rules.fail(E.ShapeMismatchError,
                            f"nki.lnc.{I}: core {1 - r} sends src {tuple(peer_src.shape)} into core "
                            f"{r}'s dst {tuple(a.args[1].shape)}: different numbers of elements")
        _dma_timing(sim, pair, slot, I)
        # Both sources are read before either destination is written (they may alias).
        sent = {r: slot[r].args[0].dtype.to_real(slot[r].args[0].v).astype(np.float32) for r in slot}
        for r, a in slot.items():
            dst = a.args[1]
            got = sent[1 - r].reshape(dst.shape)
            if reduce is not None:
                got = reduce(sent[r].reshape(dst.shape), got)
            _put(dst, got)
            dst.buf.written = True

    sim.count += 1
    pair.meet(rank, I, (src, dst), complete)


@issued
def sendrecv(src, dst, send_to_rank, recv_from_rank, dma_engine=dma_engine.dma, name=None, priority=None):
    """Send ``src`` to the peer core's ``dst`` while receiving the peer's ``src`` into this
    core's ``dst`` (SBUF or HBM). The n-th sendrecv of one core pairs with the peer's n-th."""
    I = "sendrecv"
    sim = _sim(I)
    _priority(I, sim, priority, dma_engine)
    _exchange(I, src, dst, send_to_rank, recv_from_rank)


@issued
def sendrecv_compute(src, dst, send_to_rank, recv_from_rank, reduce_op, name=None, priority=None):
    """Exchange ``src`` with the peer core and write ``reduce_op(src, peer's src)`` to ``dst``
    (``nl.add``, ``nl.maximum`` or ``nl.minimum``, computed in float32 by the DMA engines)."""
    I = "sendrecv_compute"
    sim = _sim(I)
    _priority(I, sim, priority)
    fn = _REDUCE.get(getattr(reduce_op, "name", None))
    if fn is None:
        _rules.fail(E.NkiRuleError, f"nki.lnc.{I}: reduce_op must be nl.add, nl.maximum or nl.minimum, "
                                    f"got {reduce_op!r}")
    _T(src, "src", I), _T(dst, "dst", I)
    if src.kind != dst.kind:
        _rules.fail(E.NkiRuleError, f"nki.lnc.{I}: src ({src.kind.upper()}) and dst ({dst.kind.upper()}) "
                                    f"must be in the same memory space: both SBUF or both private HBM")
    _exchange(I, src, dst, send_to_rank, recv_from_rank, fn)
