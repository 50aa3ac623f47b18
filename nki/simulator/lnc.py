"""The two physical cores of an LNC=2 launch meeting at core-to-core instructions.

The programs of a grid run one after another on the calling thread. That is exact as long
as they only meet through HBM they do not race on; ``core_barrier`` and ``sendrecv`` make a
program wait for its peer core, which has not started yet. So at the first such instruction
the peer program starts on a thread of its own and the two take turns: exactly one of them
runs at any time and the turn passes only at those instructions (or when a program ends).
The simulation stays deterministic and, in effect, single-threaded.

A core-to-core instruction pairs with the peer's instruction at the same position in its
program order (AWS: "the Nth sendrecv on one rank rendezvous with the Nth sendrecv on the
peer rank"). Instructions of different kinds at the same position, or a program that ends
while its peer waits, would deadlock the chip and raise here. The pair's core timelines meet
at the rendezvous: neither side's instruction starts before both have arrived.
"""
from __future__ import annotations

import threading

from .. import errors as E
from . import tensore

_ORD = {1: "1st", 2: "2nd", 3: "3rd"}


def _nth(n):
    return _ORD.get(n, f"{n}th")


class _Cancelled(BaseException):
    """Ends a waiting peer program when its launch failed elsewhere."""


class Arrival:
    """One core's side of a rendezvous: what it issued, and what the completion hands back."""

    __slots__ = ("kind", "args", "result")

    def __init__(self, kind, args):
        self.kind, self.args, self.result = kind, args, None


class Pair:
    """The two programs of one round (program ``k0`` on core 0, ``k0 + 1`` on core 1)."""

    def __init__(self, sim, k0, run_program):
        self.sim, self.k0, self.run_program = sim, k0, run_program
        self.cond = threading.Condition()
        self.turn = None
        self.slots: dict = {}            # position -> {rank: Arrival}
        self.issued = {0: 0, 1: 0}       # core-to-core instructions issued per rank
        self.state: dict = {}            # rank -> the Sim fields of a suspended program
        self.thread = None
        self.done = set()
        self.result = None
        self.error = None
        self.cancelled = False

    # -- turns ---------------------------------------------------------------------------
    _FIELDS = ("pid", "shared_i", "tl", "k", "scalar_regs", "vector_regs", "sbuf", "psum")

    def _save(self, rank):
        self.state[rank] = {f: getattr(self.sim, f) for f in self._FIELDS}

    def _restore(self, rank):
        for f, v in self.state.pop(rank).items():
            setattr(self.sim, f, v)

    def _give(self, rank, me):
        """Hand the turn to ``rank`` (starting its program if it has not run) and wait for
        it to come back to ``me``."""
        tensore.drain()
        self._save(me)
        with self.cond:
            self.turn = rank
            if rank == 1 and self.thread is None:
                self.thread = threading.Thread(target=self._peer_main, daemon=True,
                                               name=f"nki-core1-program{self.k0 + 1}")
                self.thread.start()
            self.cond.notify_all()
            self._wait_for(me)
        self._restore(me)

    def _wait_for(self, me):
        while self.turn != me and not self.cancelled:
            self.cond.wait()
        if self.cancelled and me == 1:
            raise _Cancelled()

    def _peer_main(self):
        with self.cond:
            self._wait_for(1)
        # Core 1 has its own SBUF and PSUM; core 0's tiles are still live.
        self.sim.sbuf, self.sim.psum = self.sim.core_memory()
        self.sim.scalar_regs = self.sim.vector_regs = None
        try:
            self.result = self.run_program(self.k0 + 1)
            tensore.drain()
        except _Cancelled:
            return
        except BaseException as e:        # handed to the launching thread, raised there
            self.error = e
        with self.cond:
            self.done.add(1)
            self.turn = 0
            self.cond.notify_all()

    def join(self):
        """Run core 1's program to its end (the launch loop reached it); its result."""
        mem = self.sim.sbuf, self.sim.psum
        with self.cond:
            if 1 not in self.done:
                self.turn = 1
                self.cond.notify_all()
                self._wait_for(0)
        self.thread.join()
        self.sim.sbuf, self.sim.psum = mem
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self):
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()

    # -- rendezvous ----------------------------------------------------------------------
    def meet(self, rank, kind, args, complete):
        """Core ``rank`` issues a core-to-core instruction; ``complete(arrivals)`` runs once
        both cores have issued theirs (by whichever arrives second) and fills each
        ``Arrival.result``. Returns this core's result."""
        pos = self.issued[rank]
        self.issued[rank] += 1
        slot = self.slots.setdefault(pos, {})
        mine = slot[rank] = Arrival(kind, args)
        peer = 1 - rank
        if peer not in slot:
            if peer in self.done:
                self._unmatched(rank, pos, kind)
            self._give(peer, rank)
            if peer not in slot:
                if self.error is not None and peer == 1:
                    raise self.error
                self._unmatched(rank, pos, kind)
            return mine.result
        other = slot[peer]
        if other.kind != kind:
            first = {rank: kind, peer: other.kind}
            raise E.NkiRuleError(
                f"nki.lnc: core 0's {_nth(pos + 1)} core-to-core instruction is {first[0]} and "
                f"core 1's is {first[1]}: the cores would deadlock (each core must issue the same "
                f"sequence of core_barrier / sendrecv / sendrecv_compute)")
        complete(slot)
        return mine.result

    def _unmatched(self, rank, pos, kind):
        raise E.NkiRuleError(
            f"nki.lnc.{kind}: core {rank} issued its {_nth(pos + 1)} core-to-core instruction but "
            f"core {1 - rank}'s program ended after {self.issued[1 - rank]}: the cores would "
            f"deadlock (each core must issue the same sequence of core_barrier / sendrecv / "
            f"sendrecv_compute)")


def pair_for(sim, instr):
    """The running program's pair, created at its first core-to-core instruction."""
    if sim.lnc is not None and sim.k in (sim.lnc.k0, sim.lnc.k0 + 1):
        return sim.lnc
    if sim.ncores < 2:
        E_fail(instr, f"needs the two physical cores of an LNC=2 logical core; {sim.target} "
                      f"runs kernels on one core (LNC=1)")
    programs = 1
    for g in sim.grid:
        programs *= g
    if programs < 2:
        E_fail(instr, "this launch runs a single program, so there is no peer core to meet: "
                      "launch the kernel on both cores of the logical NeuronCore (kernel[2])")
    if sim.k % 2 != 0:
        # Core 0's program ran to its end without meeting this core.
        raise E.NkiRuleError(
            f"nki.lnc.{instr}: core 1 issued its 1st core-to-core instruction but core 0's "
            f"program ended after 0: the cores would deadlock (each core must issue the same "
            f"sequence of core_barrier / sendrecv / sendrecv_compute)")
    if sim.k + 1 >= programs:
        E_fail(instr, f"program {sim.k} is the last of the grid {tuple(sim.grid)}, so its core has "
                      f"no peer program; launch the kernel on a grid of whole core pairs")
    sim.lnc = Pair(sim, sim.k, sim.run_program)
    return sim.lnc


def E_fail(instr, why):
    raise E.UnsupportedError(f"nki.lnc.{instr}: {why}")
