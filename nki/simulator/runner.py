"""Running a kernel: ``nki.jit``, ``nki.simulate``, ``nki.benchmark`` and ``nki.profile``.

Arguments may be NumPy arrays or torch tensors (CPU, or on the ``neuron`` device, read and
written in place through zero-copy host views; see ``torch_io``). Inputs become HBM tensors;
float32 (and integer) data is used in place, other dtypes are converted and written back if
the kernel writes them. On the neuron device the kernel's modelled latency is added to the
device's modelled time (``torch_neuronx.modelled_time``).
"""
from __future__ import annotations

import functools
import itertools
import sys
import time

import numpy as np

from .. import errors as E
from . import context, tensore, torch_io, trace
from .dtypes import as_dtype
from .tensor import Buffer, NkiTensor, new_id


def _wrap_input(x, sim, name):
    if torch_io.is_torch(x):
        store, origin = torch_io.wrap(x)
        d = as_dtype(origin.host.dtype)
    else:
        d = as_dtype(x.dtype)
        if x.dtype == d.storage and x.flags.c_contiguous and x.flags.writeable:
            store, origin = x, None        # used in place: writes land in the caller's array
        else:
            store = d.round(x.astype(np.float32)) if d.is_float else np.ascontiguousarray(x, d.storage)
            store, origin = np.array(store, dtype=d.storage, copy=True), x
    return NkiTensor(Buffer("hbm", d, store, name, origin=origin), store)


def _write_back(t: NkiTensor):
    origin = t.buf.origin
    if origin is None or not t.buf.written:
        return
    if isinstance(origin, torch_io.Origin):
        torch_io.write_back(origin, t.dtype, t.buf.data)
    else:
        origin[...] = t.dtype.to_real(t.buf.data).astype(origin.dtype)


def _outputs(res, device, func=None):
    """Kernel results: NumPy arrays of the real dtype, or torch tensors on ``device``."""
    if isinstance(res, NkiTensor):
        if res.kind != "hbm":
            code = getattr(func, "__code__", None)
            raise E.OutputBufferError(
                f"kernel output {res.name!r} lives in {res.kind.upper()}; outputs must be "
                f"allocated in nl.shared_hbm", code and code.co_filename, code and code.co_firstlineno)
        own = res.buf.torch
        if own is not None and res.v.shape == res.buf.data.shape:
            return own                          # the kernel wrote the device tensor directly
        a = res.dtype.to_real(res.v)
        return torch_io.to_torch(a, device) if device is not None else a
    if isinstance(res, (tuple, list)):
        return type(res)(_outputs(r, device, func) for r in res)
    if isinstance(res, dict):
        return {k: _outputs(v, device, func) for k, v in res.items()}
    return res


def _latency_ns(sim):
    return max((tl.end for tl in sim.timelines), default=0.0)


def run(func, args, kwargs, grid=(), target=None, timing=False, readonly_inputs=False):
    """Execute func once per grid position; returns (outputs, sim). ``readonly_inputs``: a
    write to an input is an error (the caller promised PyTorch the kernel is functional)."""
    tensors = [a for a in list(args) + list(kwargs.values()) if torch_io.is_torch(a)]
    device = tensors[0].device if tensors else None
    if any(t.device != device for t in tensors):
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                           f"devices, {device} and {next(t.device for t in tensors if t.device != device)}! "
                           f"(NKI kernel {getattr(func, '__name__', func)!r})")
    on_device = device is not None and device.type == "neuron"
    # On the neuron device the modelled latency is the kernel's cost on the chip, so the
    # timing model always runs there.
    sim = context.Sim(target, timing or on_device)
    sim.in_run = True
    if on_device:
        sim.torch_device = device
    prev = context.set_current(sim)
    try:
        def conv(a, i):
            if isinstance(a, np.ndarray) or torch_io.is_torch(a):
                return _wrap_input(a, sim, f"in{i}_{new_id()}")
            return a
        wargs = [conv(a, i) for i, a in enumerate(args)]
        wkw = {k: conv(v, k) for k, v in kwargs.items()}
        grid = tuple(grid)
        sim.grid = grid
        result = None
        for k, pid in enumerate(itertools.product(*(range(g) for g in grid)) if grid else [()]):
            sim.pid, sim.shared_i = pid, 0
            if sim.timing:
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
                if readonly_inputs and a.buf.written:
                    raise E.NkiError(
                        f"NKI kernel {getattr(func, '__name__', func)!r} wrote its input "
                        f"{a.name!r} inside torch.compile; declare the mutation with "
                        f"torch_neuronx.nki_op(name, kernel, mutates_args=...)")
                _write_back(a)
        out = _outputs(result, device, func)
        if on_device:
            from torch_neuronx import cost_model
            cost_model._add_time(device, f"nki:{getattr(func, '__name__', 'kernel')}",
                                 _latency_ns(sim) * 1e-9, engine="nki")
        return out, sim
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


# Kernel functions by key, so a torch.compile graph node (nki_jit::call) can name its kernel.
KERNEL_FUNCS: dict = {}


def func_key(func) -> str:
    return f"{func.__module__}.{func.__qualname__}#{id(func)}"


def _torch_compiling() -> bool:
    t = sys.modules.get("torch")
    return t is not None and t.compiler.is_compiling()


class Kernel:
    """A kernel made by ``nki.jit``: call it (simulated), index it with a grid."""

    def __init__(self, func, grid=(), target=None, **options):
        functools.update_wrapper(self, func)
        self.func, self.grid, self.target, self.options = func, grid, target, options
        self._nki_key = key = func_key(func)       # computed here: a compile trace reads it
        if key not in KERNEL_FUNCS:
            KERNEL_FUNCS[key] = func
            if "torch" in sys.modules:
                # Register the nki_jit::call op now: a torch.compile trace must not import it.
                from . import torch_op  # noqa: F401

    def __getitem__(self, grid):
        g = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
        return Kernel(self.func, g, self.target, **self.options)

    def __call__(self, *args, **kwargs):
        if _torch_compiling():
            from . import torch_op
            return torch_op.call(self, args, kwargs)
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
