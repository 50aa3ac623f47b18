"""The state of one kernel run: target profile, on-chip allocators, the program's position in
its launch grid, and (when timing) the engine timelines. Instructions report here."""
from __future__ import annotations

import math
import os
import sys

import numpy as np
from neuronhw import get_profile

from .. import errors as E
from . import rules
from .dtypes import DType
from .memory import Allocator
from .tensor import Buffer, NkiTensor, new_id, take_spare
from .tensore import busy, drain
from .timing import Timeline


# Set while a profiler wants each instruction's kernel source line (torch_neuronx's
# NeuronProfiler); otherwise issuing an instruction costs one flag test more.
record_source = False
_NKI_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_EXAMPLES_DIR = _NKI_DIR + "examples" + os.sep


def _source_args():
    """The instruction's timeline args: the innermost frame outside nki's own modules (the
    kernel's line; nki's example kernels are kernels)."""
    f = sys._getframe(2)
    while f is not None:
        file = f.f_code.co_filename
        if not file.startswith(_NKI_DIR) or file.startswith(_EXAMPLES_DIR):
            return {"source_file": file, "source_line": f.f_lineno}
        f = f.f_back
    return None


def _touches_busy(reads, writes) -> bool:
    for t in reads:
        if busy(t.buf.data):
            return True
    for t in writes:
        if busy(t.buf.data):
            return True
    return False


class Sim:
    def __init__(self, target=None, timing=False):
        self.profile = p = get_profile(target)
        self.target = p.name
        self.pmax = p.partitions
        self.sbuf, self.psum = self.core_memory()
        self.timing = timing
        self.ncores = max(1, p.default_lnc)
        self.timelines = [Timeline(p, c) for c in range(self.ncores)] if timing else []
        self.tl = self.timelines[0] if timing else None
        self.count = 0
        self.grid = ()
        self.pid = ()
        self.shared: list = []          # shared_hbm buffers of program 0, reused by the others
        self.shared_i = 0
        self.scalar_regs = None         # ScalarE reduce registers (activation accumulate)
        self.vector_regs = None
        self.bridge = None              # framework of the call's tensors (nki.frameworks)
        self.device = None              # their device
        self.device_outputs = False     # HBM outputs are allocated as tensors on that device
        self.in_run = False             # set by runner.run, which drains queued GEMMs
        self.k = 0                      # the running program's index in the grid
        self.lnc = None                 # the core pair of an LNC=2 round, once it communicates
        self.run_program = None         # runner's: run program k of the grid (lnc.py starts core 1)

    def core_memory(self):
        """A physical core's empty SBUF and PSUM."""
        p = self.profile
        return (Allocator("sbuf", p.sbuf_partition_bytes),
                Allocator("psum", p.psum_partition_bytes, bank_bytes=p.psum_bank_bytes))

    # -- allocation ----------------------------------------------------------------
    def alloc(self, shape, dtype: DType, kind: str, name=None, fill="nan",
              address=None) -> NkiTensor:
        shape = tuple(int(s) for s in shape)
        name = name or f"{kind}_{new_id()}"
        if address is not None and kind not in ("sbuf", "psum"):
            rules.fail(E.UnsupportedError, f"tensor {name!r}: address= places SBUF and PSUM "
                                           f"tiles; {kind.upper()} tensors take none")
        # The programs of a grid share its HBM outputs: the n-th one a program allocates is
        # the n-th of the first program that allocated it (the cores of an LNC=2 pair may
        # interleave, see lnc.py).
        if kind in ("shared_hbm", "hbm") and self.grid:
            if self.shared_i < len(self.shared):
                buf = self.shared[self.shared_i]
                self.shared_i += 1
                return NkiTensor(buf, buf.data)
        if self.device_outputs and kind in ("shared_hbm", "hbm") and dtype.storage == np.dtype(dtype.real):
            # An output in device memory: the kernel writes the device tensor directly.
            t = self.bridge.empty(shape, dtype.storage, self.device)
            view = self.bridge.host_view(t)
            _fill(view, dtype, fill)
            buf = Buffer("hbm", dtype, view, name)
            buf.framework_tensor = t
            if self.grid:
                self.shared.append(buf)
                self.shared_i += 1
            return NkiTensor(buf, view)
        # Storage a queued GEMM still uses is passed over, so the GEMMs keep running behind
        # a loop that allocates a tile per step.
        store = take_spare(shape, dtype.storage, busy)
        if store is None:
            store = np.empty(shape, dtype=dtype.storage)
        _fill(store, dtype, fill)
        if kind in ("shared_hbm", "hbm", "private_hbm"):
            buf = Buffer("hbm", dtype, store, name)
            buf.recycle = True
            if kind != "private_hbm" and self.grid:
                self.shared.append(buf)
                self.shared_i += 1
            return NkiTensor(buf, store)
        if not shape:
            rules.fail(E.ShapeMismatchError, f"an {kind.upper()} tensor needs a partition dimension")
        if shape[0] > self.pmax:
            rules.fail(E.PartitionDimensionError,
                       f"{kind.upper()} tensor {name!r} of shape {shape} has partition dimension "
                       f"{shape[0]} > {self.pmax} (nl.tile_size.pmax)")
        per_part = math.prod(shape[1:]) * dtype.itemsize
        alloc = self.sbuf if kind == "sbuf" else self.psum
        if address is None:
            buf = Buffer(kind, dtype, store, name, alloc.alloc(per_part, name), alloc)
        else:
            p0, addr = _address(address, name)
            if p0 + shape[0] > self.pmax:
                rules.fail(E.PartitionDimensionError,
                           f"{kind.upper()} tile {name!r} of shape {shape} placed at partition "
                           f"{p0} runs past partition {self.pmax - 1}")
            placed = alloc.place(addr, per_part, name, max(1, dtype.itemsize))
            buf = Buffer(kind, dtype, store, name, addr, placed, pbase=p0)
        buf.recycle = True
        if kind == "psum":
            buf.groups = []
        return NkiTensor(buf, store)

    # -- instruction issue -----------------------------------------------------------
    def compute(self, name, engine, cycles, reads=(), writes=(), not_before=0.0):
        self.count += 1
        if name != "nc_matmul" and _touches_busy(reads, writes):
            drain()             # queued GEMMs finish before anything touches their tiles
        rules.check_access(name, engine, reads, writes)
        rules.check_partitions(name, engine, list(reads) + list(writes), self.pmax)
        for w in writes:
            w.buf.written = True
        if self.timing:
            self.tl.compute(name, engine, cycles, [t.box() for t in reads], [t.box() for t in writes],
                            _source_args() if record_source else None, not_before=not_before)

    def dma(self, name, dst, src, efficiency=1.0, transpose=False, not_before=0.0):
        self.count += 1
        if _touches_busy((src,), (dst,)):
            drain()
        rules.check_access(name, "dma", [src], [dst])
        rules.check_partitions(name, "dma", [src, dst], self.pmax)
        dst.buf.written = True
        if self.timing:
            nbytes = dst.size * dst.dtype.itemsize
            onchip = dst if dst.kind != "hbm" else src
            rows = onchip.shape[0] if onchip.kind != "hbm" else math.prod(dst.shape[:-1]) or 1
            row_bytes = max(1, nbytes // max(rows, 1))
            self.tl.dma(name, nbytes, rows, row_bytes, "hbm" in (dst.kind, src.kind),
                        [src.box()], [dst.box()], efficiency,
                        _source_args() if record_source else None, transpose=transpose,
                        not_before=not_before)

    def ns(self, engine, cycles):
        return self.tl.compute_ns(engine, cycles) if self.tl else 0.0


def _fill(store, dtype, fill):
    if fill == "nan":
        if dtype.is_float:
            store.fill(np.nan)
        elif dtype.name == "bool":
            store.fill(True)
        else:
            # Integers cannot hold NaN: uninitialised integer memory reads as the max value.
            store.fill(np.iinfo(dtype.storage).max)
    elif fill is not None:
        store.fill(fill)


_current: Sim | None = None


def current() -> Sim:
    global _current
    if _current is None:
        _current = Sim()            # interactive use outside a kernel run: functional only
    return _current


def set_current(sim):
    global _current
    prev, _current = _current, sim
    return prev


def _address(address, name):
    """AWS's ``address=(partition_offset, byte_offset)`` of a placed tile."""
    try:
        p0, addr = (int(a) for a in address)
    except (TypeError, ValueError):
        rules.fail(E.UnsupportedError, f"tile {name!r}: address={address!r} is not a "
                                       f"(partition_offset, byte_offset) pair of integers")
    if p0 < 0:
        rules.fail(E.PartitionDimensionError, f"tile {name!r}: partition offset {p0} < 0")
    return p0, addr
