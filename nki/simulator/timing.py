"""The timing model: engines run in parallel, each in program order, ordered by data
dependencies between the regions instructions read and write.

Dependencies are tracked per region (SBUF/PSUM by partition x byte address, HBM by element
box): a read waits for the last overlapping write (RAW); a write waits for overlapping reads
and writes (WAR, WAW). Waiting on another engine costs the cross-engine semaphore latency.
Every number comes from the hardware profile.
"""
from __future__ import annotations

ENGINES = ("tensor", "vector", "scalar", "gpsimd")


def _overlap(a, b):
    for i in range(0, len(a), 2):
        if a[i] >= b[i + 1] or b[i] >= a[i + 1]:
            return False
    return True


def _contains(outer, inner):
    for i in range(0, len(outer), 2):
        if inner[i] < outer[i] or inner[i + 1] > outer[i + 1]:
            return False
    return True


class Timeline:
    def __init__(self, profile, core: int = 0):
        self.p, self.core = profile, core
        self.free = {e: 0.0 for e in ENGINES}
        self.queues = [0.0] * profile.dma_queues
        self.busy = {e: 0.0 for e in ENGINES}
        self.busy["dma"] = 0.0
        self.regions: dict = {}
        self.events: list = []
        self.dma_bytes = 0
        self.end = 0.0
        # No instruction issued after a register load starts before the loaded value is
        # known: each engine's sequencer reads the register in program order, and what
        # follows may depend on it (dynamic control flow, data-dependent DMA addresses).
        self.floor = 0.0
        # A logical core's share of the chip's HBM bandwidth, in bytes per ns.
        self.hbm_bytes_per_ns = profile.hbm_bandwidth / 1e9 / profile.logical_cores(profile.default_lnc) \
            / profile.default_lnc

    def compute_ns(self, engine: str, cycles: float) -> float:
        clock = {"tensor": self.p.tensor_clock, "vector": self.p.vector_clock,
                 "scalar": self.p.scalar_clock, "gpsimd": self.p.gpsimd_clock}[engine]
        # TensorE is deeply pipelined: AWS's cost model for it is the initiation interval
        # (max(N, MM_INIT_LATENCY) for back-to-back matmuls; Trainium/Inferentia2 architecture
        # guide, "Tensor Engine: Performance Consideration"), so the ~60-cycle tensor access
        # overhead is hidden there; the other engines pay it per instruction.
        if engine == "tensor":
            return cycles / clock * 1e9
        return (cycles + self.p.engine_access_overhead_cycles) / clock * 1e9

    def _ready(self, engine, reads, writes):
        sem = self.p.semaphore_ns
        ready = 0.0
        for space, b in reads:
            for e in self.regions.get(space, ()):
                if e[1] and _overlap(e[0], b):
                    t = e[1] + (sem if e[2] != engine else 0.0)
                    if t > ready:
                        ready = t
        for space, b in writes:
            for e in self.regions.get(space, ()):
                if _overlap(e[0], b):
                    if e[1]:
                        t = e[1] + (sem if e[2] != engine else 0.0)
                        if t > ready:
                            ready = t
                    if e[3]:
                        t = e[3] + (sem if e[4] != engine else 0.0)
                        if t > ready:
                            ready = t
        return ready

    def earliest(self, engine, reads, writes, rows=1):
        """When an instruction on ``engine`` (``"dma"``: a DMA of ``rows`` rows) could start
        on this core: its engine or queues free, its data ready."""
        if engine == "dma":
            k = max(1, min(self.p.dma_queues_per_instruction, len(self.queues), rows))
            free = sorted(self.queues)[k - 1]
        else:
            free = self.free[engine]
        return max(free, self._ready(engine, reads, writes))

    def register_read(self, reads):
        """A register loaded from ``reads``: everything issued after it waits for the value
        (its data ready, plus the semaphore that carries it to the engines)."""
        t = self._ready("register", reads, ())     # a semaphore from the writing engine
        self.floor = max(self.floor, t)
        self.end = max(self.end, t)

    def delay(self, first: int, delta: float):
        """Move the last-issued instruction (``events[first:]``) ``delta`` ns later: an
        explicit dependency added after it was scheduled (``NkiInstruction.depends_on``).
        Its engine (or DMA queues) and the regions it touched become free that much later."""
        moved = set()
        for i in range(first, len(self.events)):
            name, lane, start, dur, args = self.events[i]
            old, new = start + dur, start + dur + delta
            self.events[i] = (name, lane, start + delta, dur, args)
            engine = "dma" if lane.startswith("dma") else lane
            moved.add((old, engine))
            if engine == "dma":
                self.queues = [new if q == old else q for q in self.queues]
            elif self.free[engine] == old:
                self.free[engine] = new
            self.end = max(self.end, new)
        # An engine runs in order, so no earlier instruction of the same engine ends at the
        # same time: (end, engine) names the region records this instruction made.
        for lst in self.regions.values():
            for e in lst:
                if (e[1], e[2]) in moved:
                    e[1] += delta
                if (e[3], e[4]) in moved:
                    e[3] += delta

    def _record(self, engine, reads, writes, end):
        for space, b in reads:
            lst = self.regions.setdefault(space, [])
            for e in lst:
                if e[0] == b:
                    if end > e[3]:
                        e[3], e[4] = end, engine
                    break
            else:
                lst.append([b, 0.0, None, end, engine])
        for space, b in writes:
            lst = self.regions.setdefault(space, [])
            lst[:] = [e for e in lst if not _contains(b, e[0])]
            lst.append([b, end, engine, 0.0, None])

    def compute(self, name, engine, cycles, reads, writes, args=None, not_before=0.0):
        dur = self.compute_ns(engine, cycles)
        start = max(self.free[engine], self._ready(engine, reads, writes), not_before, self.floor)
        end = start + dur
        self.free[engine] = end
        self.busy[engine] += dur
        self._record(engine, reads, writes, end)
        self.events.append((name, engine, start, dur, args))
        self.end = max(self.end, end)
        return end

    def dma(self, name, nbytes, rows, row_bytes, touches_hbm, reads, writes, efficiency=1.0, args=None,
            transpose=False, not_before=0.0):
        """A DMA instruction's descriptors spread over up to ``dma_queues`` queues (one run
        of rows each); it starts when all of them are free and its data is ready. A DMA
        transpose runs on all the queues together at ``efficiency`` of their peak (AWS's
        Trainium2 architecture guide: the 16 DMA engines write each 128 x 16 output tile
        co-operatively), so it has no per-row cost of its own."""
        p = self.p
        k = len(self.queues) if transpose else max(1, min(p.dma_queues_per_instruction, len(self.queues), rows))
        order = sorted(range(len(self.queues)), key=self.queues.__getitem__)[:k]
        start = max(self.queues[order[-1]], self._ready("dma", reads, writes), not_before, self.floor)
        # Each contiguous row carries a fixed cost; rows of >= ~2 KiB approach peak.
        eff = efficiency if transpose else efficiency * row_bytes / (row_bytes + p.dma_row_overhead_bytes)
        rate = k * p.dma_queue_bytes_per_ns * max(eff, 1e-3)
        if touches_hbm:
            rate = min(rate, self.hbm_bytes_per_ns)      # one transfer cannot beat HBM
        end = start + p.dma_fixed_ns + nbytes / rate
        for q in order:
            self.queues[q] = end
        self.busy["dma"] += (end - start) * k / len(self.queues)
        self.dma_bytes += nbytes
        self._record("dma", reads, writes, end)
        if k > 1:  # the event sits on its first queue; traces show it on each
            args = {**args, "queues": order} if args else {"queues": order}
        self.events.append((name, f"dma{order[0]}", start, end - start, args))
        self.end = max(self.end, end)
        return end
