"""A compiled graph as the chip runs it: one program, engines overlapping.

On Trainium a compiled graph is one program (one launch): its kernels' instructions run on
TensorE, VectorE, ScalarE, GpSimd and the DMA queues in parallel, each engine in program
order, ordered only by data dependencies. This module lays a graph's kernels out as such
instructions and times them on the NKI simulator's engine timeline
(``nki.simulator.timing.Timeline``: the same scheduler, semaphores and DMA queues that time
NKI kernels), so there is one timing mechanism for both.

The layout of each kernel (``items`` as ``codegen``/``cost`` describe them):

- a fused kernel is cut into tiles along its data; per tile, its HBM inputs are loaded by
  DMA, its element-wise/reduction work runs on VectorE (two ALU ops per instruction), its
  transcendentals on ScalarE, and its HBM outputs are stored by DMA. SBUF slots rotate, so
  loads of tile i+1 overlap compute on tile i;
- a matmul (extern ``mm``/``bmm``/``addmm``/...) loads its operands, runs on TensorE
  (systolic-array cycles from ``cost_model``), evacuates PSUM on VectorE and stores;
- any other extern kernel is a DMA in, GpSimd pass, DMA out.

Dependencies between kernels are per HBM buffer and tile: a consumer's tile waits for the
producer's store of that tile, so independent kernels (a matmul on TensorE next to
element-wise work on VectorE) overlap. Intermediates inside a fused kernel never reach HBM.
The program's time is the timeline's end plus one launch, and never less than its HBM
traffic at the core's HBM bandwidth.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from nki.simulator.timing import ENGINES, Timeline

# Loop-body operations one VectorE instruction applies per element (tensor_scalar: two ALU
# ops in one pass).
OPS_PER_INSTRUCTION = 2
_TILE_BYTES = 1 << 20      # data per tile of a kernel (128 partitions x 8 KiB)
_MAX_TILES = 16
_SLOTS = 3                 # SBUF buffers a kernel rotates through
_ROW_BYTES = 2048          # DMA rows this long run near the queues' peak rate


@dataclass
class Program:
    """Modelled execution of one compiled graph."""
    seconds: float
    busy: dict = field(default_factory=dict)   # engine -> busy seconds ("dma" included)
    hbm_bytes: int = 0
    launches: int = 1
    bound: str = ""                            # the engine (or "hbm") the time is bound by
    events: list = field(default_factory=list)  # the Timeline's instructions (profiler lanes)


def _tiles(nbytes: int) -> int:
    return max(1, min(_MAX_TILES, math.ceil(nbytes / _TILE_BYTES)))


def _box(i, n, total):
    step = max(1, math.ceil(total / n))
    return (i * step, min(total, (i + 1) * step))


class _Layout:
    def __init__(self, p, lnc, bufs):
        self.p, self.lnc, self.bufs = p, lnc, bufs
        # A logical core of LNC physical cores drives all their DMA queues, and owns its
        # share of HBM bandwidth (the timeline's defaults are one core's queues and the
        # chip's default LNC). A compiled kernel spreads each transfer's descriptors over
        # half of them (loads and stores each get half), as a well-written kernel does with
        # several DMA instructions; one instruction per transfer keeps the timeline short.
        queues = p.dma_queues * lnc
        self.tl = Timeline(dataclasses.replace(
            p, dma_queues=queues, dma_queues_per_instruction=max(1, queues // 2)))
        self.tl.hbm_bytes_per_ns = p.core_hbm_bandwidth(lnc) / 1e9
        self.hbm = 0

    # SBUF slots of kernel k: an input, an output and a middle buffer per rotation slot.
    @staticmethod
    def _slot(k, which, slot):
        base = which * _SLOTS + slot
        return (f"sbuf{k}", (base, base + 1))

    def _dma(self, name, b, lo, hi, sbuf, load):
        hbm = (f"hbm{b}", (lo, hi))
        # Contiguous HBM data spread over partitions in rows of >= 2 KiB where it can be
        # (fewer partitions for a small transfer), as a kernel lays out its tiles.
        row = max((hi - lo) // self.p.partitions, min(hi - lo, _ROW_BYTES))
        self.tl.dma(name, hi - lo, max(1, (hi - lo) // max(row, 1)), max(4, row), True,
                    [hbm if load else sbuf], [sbuf if load else hbm])
        self.hbm += hi - lo

    def _load(self, k, name, reads, i, n, slot):
        for b in reads:
            lo, hi = _box(i, n, self.bufs[b])
            if hi > lo:
                self._dma(f"{name}.load", b, lo, hi, self._slot(k, 0, slot), True)

    def _store(self, k, name, writes, i, n, slot):
        for b in writes:
            lo, hi = _box(i, n, self.bufs[b])
            if hi > lo:
                self._dma(f"{name}.store", b, lo, hi, self._slot(k, 1, slot), False)

    def _tiles_of(self, k, name, reads, writes, body):
        """The kernel as software-pipelined tile steps (callables issuing instructions, in
        order): each step first issues the loads of a later slot, so DMA queues prefetch
        while the engines work on this one."""
        n = _tiles(sum(self.bufs[b] for b in (*reads, *writes)))
        ahead = _SLOTS - 1

        def step(i):
            if i == 0:
                for j in range(min(n, ahead)):
                    self._load(k, name, reads, j, n, j % _SLOTS)
            if i + ahead < n:
                self._load(k, name, reads, i + ahead, n, (i + ahead) % _SLOTS)
            body(i % _SLOTS, n)
            self._store(k, name, writes, i, n, i % _SLOTS)

        return [lambda i=i: step(i) for i in range(n)]

    def fused(self, k, name, vec_ops, sca_ops, reads, writes):
        p = self.p

        def body(slot, n):
            vec = vec_ops / OPS_PER_INSTRUCTION / p.vector_lanes / self.lnc / n
            sca = sca_ops / p.vector_lanes / self.lnc / n
            src, dst, mid = (self._slot(k, w, slot) for w in range(3))
            if vec or not sca:
                self.tl.compute(f"{name}.vector", "vector", vec, [src], [mid if sca else dst])
            if sca:
                self.tl.compute(f"{name}.scalar", "scalar", sca, [mid if vec else src], [dst])

        return self._tiles_of(k, name, reads, writes, body)

    def matmul(self, k, name, tensor_seconds, out_elems, reads, writes):
        p = self.p

        def body(slot, n):
            psum = (f"psum{k}", (slot, slot + 1))
            self.tl.compute(f"{name}.tensor", "tensor", tensor_seconds * p.tensor_clock / n,
                            [self._slot(k, 0, slot)], [psum])
            self.tl.compute(f"{name}.evacuate", "vector",
                            out_elems / p.vector_lanes / self.lnc / n, [psum],
                            [self._slot(k, 1, slot)])

        return self._tiles_of(k, name, reads, writes, body)

    def other(self, k, name, elems, reads, writes):
        def body(slot, n):
            self.tl.compute(f"{name}.gpsimd", "gpsimd", elems / self.p.vector_lanes / self.lnc / n,
                            [self._slot(k, 0, slot)], [self._slot(k, 1, slot)])

        return self._tiles_of(k, name, reads, writes, body)

    def result(self) -> Program:
        p = self.p
        hbm_ns = self.hbm / self.tl.hbm_bytes_per_ns
        end_ns = max(self.tl.end, hbm_ns)
        busy = {e: self.tl.busy[e] * 1e-9 for e in (*ENGINES, "dma")}
        if hbm_ns >= self.tl.end:
            bound = "hbm"
        else:
            bound = max(busy, key=busy.get)
        return Program(seconds=(end_ns + p.launch_overhead_ns) * 1e-9, busy=busy,
                       hbm_bytes=int(self.hbm), bound=bound, events=self.tl.events)


def _waves(items):
    """Runs of consecutive kernels that share no buffer one of them writes: the compiler
    may interleave their instructions (one program), the timeline then overlaps them."""
    wave, touched, written = [], set(), set()
    for item in items:
        reads, writes = set(item[-2]), set(item[-1])
        if wave and (reads & written or writes & touched):
            yield wave
            wave, touched, written = [], set(), set()
        wave.append(item)
        touched |= reads | writes
        written |= writes
    if wave:
        yield wave


def simulate(p, lnc: int, bufs, items, extern_cost) -> Program:
    """Time one compiled graph on the engine timeline.

    ``bufs``: bytes of each HBM buffer the graph's kernels exchange; ``items``, in program
    order: ``("kernel", vec_ops, sca_ops, reads, writes)`` or
    ``("extern", name, shapes, itemsize, reads, writes)``, reads/writes indexing ``bufs``;
    ``extern_cost(name, shapes, itemsize) -> (tensor_seconds or None, out_elems)``.
    """
    lay = _Layout(p, lnc, bufs)
    k = 0
    for wave in _waves(items):
        streams = []
        for item in wave:
            if item[0] == "kernel":
                _, vec, sca, reads, writes = item
                streams.append(lay.fused(k, f"kernel{k}", vec, sca, reads, writes))
            else:
                _, name, shapes, itemsize, reads, writes = item
                tensor_seconds, elems = extern_cost(name, shapes, itemsize)
                if tensor_seconds is not None:
                    streams.append(lay.matmul(k, name, tensor_seconds, elems, reads, writes))
                else:
                    streams.append(lay.other(k, name, elems, reads, writes))
            k += 1
        # Independent kernels' tile steps are issued round-robin.
        for i in range(max(len(st) for st in streams)):
            for st in streams:
                if i < len(st):
                    st[i]()
    return lay.result()
