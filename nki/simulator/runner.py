"""Running a kernel: ``nki.jit``, ``nki.simulate``, ``nki.benchmark`` and ``nki.profile``.

Arguments may be NumPy arrays or torch tensors (CPU, or on the ``neuron`` device: copied to
the host and results copied back). Inputs become HBM tensors; float32 arrays are used in
place, other dtypes are converted and written back if the kernel writes them.
"""
from __future__ import annotations

import functools
import itertools
import time

import numpy as np

from .. import errors as E
from . import context, tensore, trace
from .dtypes import as_dtype
from .tensor import Buffer, NkiTensor, new_id


def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_numpy(x):
    """A host numpy view/copy of a torch tensor (bf16/fp8 go through float32)."""
    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    import torch
    if t.dtype in (torch.bfloat16,) or "float8" in str(t.dtype):
        import ml_dtypes
        name = str(t.dtype).replace("torch.", "")
        real = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
                "float8_e5m2": ml_dtypes.float8_e5m2}.get(name)
        if real is None:
            raise E.UnsupportedError(f"torch dtype {t.dtype} is not supported by the NKI simulator")
        return t.float().numpy().astype(real)
    return t.resolve_conj().numpy()


def _to_torch(a: np.ndarray, like):
    import torch
    name = a.dtype.name
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        out = torch.from_numpy(a.astype(np.float32)).to(getattr(torch, name))
    elif name.startswith("float8") or name.startswith("float4"):
        out = torch.from_numpy(a.astype(np.float32))
    else:
        out = torch.from_numpy(np.ascontiguousarray(a))
    if like is not None and like.device.type != "cpu":
        out = out.to(like.device)
    return out


def _wrap_input(x, sim, name):
    origin = x
    arr = _to_numpy(x) if _is_torch(x) else x
    d = as_dtype(arr.dtype)
    if arr.dtype == d.storage and arr.flags.c_contiguous and not _is_torch(x) and arr.flags.writeable:
        store, origin = arr, None        # used in place: writes land in the caller's array
    else:
        store = d.round(arr.astype(np.float32)) if d.is_float else np.ascontiguousarray(arr, d.storage)
        store = np.array(store, dtype=d.storage, copy=True)
    buf = Buffer("hbm", d, store, name, origin=origin)
    return NkiTensor(buf, store)


def _write_back(t: NkiTensor):
    origin = t.buf.origin
    if origin is None or not t.buf.written:
        return
    real = t.dtype.to_real(t.buf.data)
    if _is_torch(origin):
        origin.copy_(_to_torch(real, None).to(origin.dtype).to(origin.device))
    else:
        origin[...] = real.astype(origin.dtype)


def _outputs(res, torch_like, func=None):
    if isinstance(res, NkiTensor):
        if res.kind != "hbm":
            code = getattr(func, "__code__", None)
            raise E.OutputBufferError(
                f"kernel output {res.name!r} lives in {res.kind.upper()}; outputs must be "
                f"allocated in nl.shared_hbm", code and code.co_filename, code and code.co_firstlineno)
        a = res.dtype.to_real(res.v)
        return _to_torch(a, torch_like) if torch_like is not None else a
    if isinstance(res, (tuple, list)):
        return type(res)(_outputs(r, torch_like, func) for r in res)
    if isinstance(res, dict):
        return {k: _outputs(v, torch_like, func) for k, v in res.items()}
    return res


def run(func, args, kwargs, grid=(), target=None, timing=False):
    """Execute func once per grid position; returns (outputs, sim)."""
    sim = context.Sim(target, timing)
    sim.in_run = True
    prev = context.set_current(sim)
    try:
        torch_like = next((a for a in list(args) + list(kwargs.values()) if _is_torch(a)), None)

        def conv(a, i):
            if isinstance(a, np.ndarray) or _is_torch(a):
                return _wrap_input(a, sim, f"in{i}_{new_id()}")
            return a
        wargs = [conv(a, i) for i, a in enumerate(args)]
        wkw = {k: conv(v, k) for k, v in kwargs.items()}
        grid = tuple(grid)
        sim.grid = grid
        result = None
        for k, pid in enumerate(itertools.product(*(range(g) for g in grid)) if grid else [()]):
            sim.pid, sim.shared_i = pid, 0
            if timing:
                sim.tl = sim.timelines[k % len(sim.timelines)]
            try:
                r = func(*wargs, **wkw)
            finally:
                # Queued GEMMs land before outputs are read (or the error propagates).
                tensore.drain()
            if k == 0:
                result = r
        for a in list(wargs) + list(wkw.values()):
            if isinstance(a, NkiTensor):
                _write_back(a)
        return _outputs(result, torch_like, func), sim
    finally:
        context.set_current(prev)


class BenchmarkResult:
    """Modelled cost of one kernel run on the target (latency, engine use, trace)."""

    def __init__(self, name, sim, outputs, wall_s):
        self.kernel_name, self.target, self.outputs = name, sim.target, outputs
        tls = sim.timelines
        self.latency_ns = max((tl.end for tl in tls), default=0.0) + 0.0
        lat = self.latency_ns or 1.0
        keys = ["tensor", "vector", "scalar", "gpsimd", "dma"]
        self.engine_busy_ns = {k: sum(tl.busy[k] for tl in tls) / len(tls) for k in keys}
        self.engine_busy_pct = {k: 100.0 * v / lat for k, v in self.engine_busy_ns.items()}
        self.dma_bytes = sum(tl.dma_bytes for tl in tls)
        self.instruction_count = sim.count
        self.timeline = [e for tl in tls for e in tl.events]
        self._timelines = tls
        self.sim_seconds = wall_s
        self.sbuf_peak_bytes = sim.sbuf.peak
        self.psum_peak_bytes = sim.psum.peak

    @property
    def latency_us(self):
        return self.latency_ns / 1000.0

    def chrome_trace(self) -> dict:
        return trace.chrome_trace(self._timelines, self.kernel_name, self.target)

    def save_trace(self, path):
        trace.save(self.chrome_trace(), path)
        return path

    def summary(self) -> str:
        busy = ", ".join(f"{k} {v:.0f}%" for k, v in self.engine_busy_pct.items())
        return (f"{self.kernel_name} on {self.target}: {self.latency_us:.2f} us modelled, "
                f"{self.instruction_count} instructions, {self.dma_bytes} DMA bytes; busy: {busy}")

    __repr__ = summary


class Kernel:
    """A kernel made by ``nki.jit``: call it (simulated), index it with a grid."""

    def __init__(self, func, grid=(), target=None, **options):
        functools.update_wrapper(self, func)
        self.func, self.grid, self.target, self.options = func, grid, target, options

    def __getitem__(self, grid):
        g = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
        return Kernel(self.func, g, self.target, **self.options)

    def __call__(self, *args, **kwargs):
        out, _ = run(self.func, args, kwargs, self.grid, self.target)
        return out


def _as_kernel(k):
    return k if isinstance(k, Kernel) else Kernel(k)


def jit(func=None, mode=None, platform_target=None, **options):
    """``@nki.jit`` or ``@nki.jit(platform_target="trn2", ...)``."""
    if func is None:
        return lambda f: Kernel(f, target=platform_target, **options)
    return Kernel(func, target=platform_target, **options)


def simulate(kernel, platform_target=None):
    """A callable running the kernel in the simulator on NumPy arrays or torch tensors."""
    k = _as_kernel(kernel)

    def call(*args, **kwargs):
        out, _ = run(k.func, args, kwargs, k.grid, platform_target or k.target)
        return out
    return call


def benchmark(kernel=None, target=None, platform_target=None, **_ignored):
    """A callable that runs the kernel and returns a ``BenchmarkResult`` (modelled timing)."""
    if kernel is None:
        return lambda k: benchmark(k, target, platform_target)
    k = _as_kernel(kernel)
    tgt = target or platform_target or k.target

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        out, sim = run(k.func, args, kwargs, k.grid, tgt, timing=True)
        return BenchmarkResult(k.func.__name__, sim, out, time.perf_counter() - t0)
    return call


def profile(kernel=None, target=None, trace_path=None, **_ignored):
    """Like ``benchmark``; also writes the Perfetto trace to ``trace_path`` if given."""
    if kernel is None:
        return lambda k: profile(k, target, trace_path)
    bench = benchmark(kernel, target)

    def call(*args, **kwargs):
        r = bench(*args, **kwargs)
        if trace_path:
            r.save_trace(trace_path)
        return r
    return call
