"""TensorE's GEMMs, run on host worker threads while the kernel keeps issuing instructions.

One ``nc_matmul`` multiplies at most 128x128 by 128x512 tiles. BLAS spreads such a small GEMM
over all cores and spends most of its time synchronising them (7x slower than one big GEMM
of the same FLOPs on a loaded 2-core machine). So each GEMM runs single-threaded, and
independent GEMMs run side by side: one worker per core, each owning the PSUM banks that
hash to it, so matmuls into one bank (an accumulation group) stay in program order.

Hazards are simple because TensorE only reads SBUF and writes PSUM: every other
instruction (and every direct read of tile data) first waits for all queued GEMMs
(``drain``). Until then no instruction can overwrite a GEMM's inputs or read its output.
A dead tile's storage is recycled for a new tile; that waits only when a queued GEMM still
uses that storage (``busy``), so loops that allocate a tile per step keep the GEMMs
running behind them.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Below this many multiply-adds a GEMM is cheaper inline than a hand-off to a worker.
_MIN_ASYNC_MACS = 1 << 20


def _openblas_local_setter():
    """``openblas_set_num_threads_local`` of the OpenBLAS numpy uses (sets the BLAS thread
    count of the calling thread only), or None when numpy is built differently."""
    import numpy
    libdir = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
        try:
            fn = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def _ncores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class _Pool:
    def __init__(self):
        setter = _openblas_local_setter()
        n = min(4, _ncores()) if setter is not None else 0
        if os.environ.get("NKI_SIM_THREADS"):
            n = int(os.environ["NKI_SIM_THREADS"]) if setter is not None else 0
        self.workers = [ThreadPoolExecutor(1, thread_name_prefix=f"nki-tensore{i}",
                                           initializer=setter, initargs=(1,)) for i in range(n)] \
            if n > 1 else []
        self.pending = []
        self.busy = set()          # ids of the storages queued GEMMs read or write
        self.last = None
        self.scratch = threading.local()

    def tmp(self, shape):
        d = getattr(self.scratch, "d", None)
        if d is None:
            d = self.scratch.d = {}
        t = d.get(shape)
        if t is None:
            t = d[shape] = np.empty(shape, np.float32)
        return t

    def submit(self, key, macs, work, storages=()):
        """Queue ``work`` (or run it now when small); ``last`` is then its future, or None."""
        if not self.workers or macs < _MIN_ASYNC_MACS:
            if self.pending:
                self.drain()
            work()
            self.last = None
            return
        self.busy.update(id(a) for a in storages)
        self.last = self.workers[key % len(self.workers)].submit(work)
        self.pending.append(self.last)

    def drain(self):
        pending, self.pending = self.pending, []
        self.busy.clear()
        err = None
        for f in pending:
            e = f.exception()
            if e is not None and err is None:
                err = e
        if err is not None:
            raise err


_pool = None


def _forget_pool():
    # A forked child has none of the parent's worker threads: start a fresh pool there.
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def pool() -> _Pool:
    global _pool
    if _pool is None:
        _pool = _Pool()
    return _pool


def busy(storage) -> bool:
    """Whether a queued GEMM reads or writes this storage array."""
    return _pool is not None and id(storage) in _pool.busy


def drain():
    """Wait for every queued GEMM (before any other instruction touches tile data)."""
    if _pool is not None and _pool.pending:
        _pool.drain()
