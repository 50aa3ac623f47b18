"""``NkiInstruction``: the handle every ``nki.isa`` operation returns, and its explicit
scheduling edges (``c.depends_on(a, b)``: c starts after a and b complete).

The timing model schedules an instruction when it is issued, so an edge added afterwards
moves the consumer's already-scheduled events later. That is exact only while nothing
was issued after the consumer, which is how AWS's guide uses it
(``nisa.activation(...).depends_on(load)``); an edge on an older instruction is refused.
Functionally the simulator runs instructions in program order, so an edge never changes
a result.
"""
from __future__ import annotations

import functools

from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules


def _engine(lane: str) -> str:
    return "dma" if lane.startswith("dma") else lane


class NkiInstruction:
    """Opaque handle to an issued NKI instruction (AWS: ``nki.isa.NkiInstruction``)."""

    __slots__ = ("_tl", "_first", "_last", "_name")

    def __init__(self, tl, first, last, name):
        self._tl, self._first, self._last, self._name = tl, first, last, name

    def __repr__(self):
        return f"NkiInstruction({self._name})"

    def depends_on(self, *producers: "NkiInstruction") -> "NkiInstruction":
        """Add scheduling dependencies: this instruction starts after every producer
        completes (plus the cross-engine semaphore latency when the engines differ).
        Returns self, so edges chain."""
        for p in producers:
            if not isinstance(p, NkiInstruction):
                _rules.fail(E.NkiRuleError, f"{self._name}.depends_on: producers must be the "
                                            f"NkiInstruction handles nki.isa operations return, "
                                            f"got {type(p).__name__}")
        tl = self._tl
        if tl is None:                  # functional run: program order already holds
            return self
        if self._last != len(tl.events):
            _rules.fail(E.UnsupportedError,
                        f"{self._name}.depends_on: this simulator schedules an instruction when it "
                        f"is issued, so an edge can only be added to the instruction issued last "
                        f"(call .depends_on right after issuing it)")
        mine = tl.events[self._first:self._last]
        if not mine:
            return self
        engines = {_engine(ev[1]) for ev in mine}
        sem = _ctx.current().profile.semaphore_ns
        need = 0.0
        for p in producers:
            if p._tl is not tl:
                _rules.fail(E.NkiRuleError, f"{self._name}.depends_on({p._name}): the producer ran "
                                            f"on another core (use nki.lnc for cross-core order)")
            for _, lane, start, dur, _ in tl.events[p._first:p._last]:
                t = start + dur + (0.0 if engines == {_engine(lane)} else sem)
                if t > need:
                    need = t
        begin = min(ev[2] for ev in mine)
        if need > begin:
            tl.delay(self._first, need - begin)
        return self


def issued(fn):
    """Wrap an ``nki.isa`` operation to return the handle of what it issued."""
    name = f"{'nki.lnc' if fn.__module__ == 'nki.lnc' else 'nki.isa'}.{fn.__name__}"

    @functools.wraps(fn)
    def op(*args, **kwargs):
        sim = _ctx.current()
        tl = sim.tl
        first = len(tl.events) if tl is not None else 0
        out = fn(*args, **kwargs)
        if out is not None:
            return out
        return NkiInstruction(tl, first, len(tl.events) if tl is not None else 0, name)
    return op
