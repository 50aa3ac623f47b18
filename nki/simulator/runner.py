"""Running a kernel: ``nki.jit``, ``nki.simulate``, ``nki.benchmark`` and ``nki.profile``.

Arguments may be NumPy arrays or tensors of a framework that registered a bridge with
``nki.frameworks`` (torch tensors on CPU or the ``neuron`` device, read and written in place
through zero-copy host views). Inputs become HBM tensors; float32 (and integer) data is used
in place, other dtypes are converted and written back if the kernel writes them. On an
accelerator device the kernel's modelled latency is charged to that device through its bridge.
"""
from __future__ import annotations

import functools
import os
import itertools
import time

import numpy as np

from .. import errors as E
from .. import frameworks
from . import context, dtypes, tensore, trace
from .dtypes import as_dtype
from .tensor import Buffer, NkiTensor, new_id


class _Origin:
    """Where an input's data lives (a caller's array, or a framework tensor's host view), so
    the kernel's writes reach it when the simulator worked on a converted copy."""

    __slots__ = ("host", "tensor", "bridge", "in_place")

    def __init__(self, host, tensor=None, bridge=None, in_place=False):
        self.host, self.tensor, self.bridge, self.in_place = host, tensor, bridge, in_place


def _wrap_input(x, name, bridge=None):
    host = bridge.host_view(x) if bridge is not None else x
    d = as_dtype(host.dtype)
    if host.dtype == d.storage and host.flags.c_contiguous and host.flags.writeable:
        store = host                       # used in place: writes land in the caller's memory
    else:
        store = d.from_real(host) if d.is_float else np.ascontiguousarray(host, d.storage)
        if np.may_share_memory(store, host):   # a converted copy is already the kernel's own
            store = np.array(store, dtype=d.storage, copy=True)
    origin = _Origin(host, x if bridge is not None else None, bridge, store is host)
    if bridge is None and origin.in_place:
        origin = None
    return NkiTensor(Buffer("hbm", d, store, name, origin=origin), store)


def _write_back(t: NkiTensor):
    origin = t.buf.origin
    if origin is None or not t.buf.written:
        return
    if not origin.in_place:
        origin.host[...] = t.dtype.to_real(t.buf.data).astype(origin.host.dtype, copy=False)
    if origin.bridge is not None:
        origin.bridge.mark_written(origin.tensor)


def _outputs(res, sim, func=None):
    """Kernel results: NumPy arrays of the real dtype, or the bridge's tensors on its device."""
    if isinstance(res, NkiTensor):
        if res.kind != "hbm":
            code = getattr(func, "__code__", None)
            raise E.OutputBufferError(
                f"kernel output {res.name!r} lives in {res.kind.upper()}; outputs must be "
                f"allocated in nl.shared_hbm", code and code.co_filename, code and code.co_firstlineno)
        own = res.buf.framework_tensor
        if own is not None and res.v.shape == res.buf.data.shape:
            return own                          # the kernel wrote the device tensor directly
        a = res.dtype.to_real(res.v)
        return sim.bridge.from_numpy(a, sim.device) if sim.bridge is not None else a
    if isinstance(res, (tuple, list)):
        return type(res)(_outputs(r, sim, func) for r in res)
    if isinstance(res, dict):
        return {k: _outputs(v, sim, func) for k, v in res.items()}
    return res


def _latency_ns(sim):
    return max((tl.end for tl in sim.timelines), default=0.0)


def run(func, args, kwargs, grid=(), target=None, timing=False, readonly_inputs=False):
    """Execute func once per grid position; returns (outputs, sim). ``readonly_inputs``: a
    write to an input is an error (the caller promised the framework the kernel is functional)."""
    values = list(args) + list(kwargs.values())
    owned = [(v, frameworks.bridge_for(v)) for v in values if not isinstance(v, (np.ndarray, NkiTensor))]
    owned = [(v, b) for v, b in owned if b is not None]
    bridge = owned[0][1] if owned else None
    device = bridge.device(owned[0][0]) if owned else None
    for v, b in owned:
        if b is not bridge or b.device(v) != device:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                               f"devices, {device} and {b.device(v)}! "
                               f"(NKI kernel {getattr(func, '__name__', func)!r})")
    bridged = {id(v): b for v, b in owned}
    on_device = bridge is not None and bridge.on_accelerator(device)
    # On an accelerator the modelled latency is the kernel's cost on the chip, so the
    # timing model always runs there.
    sim = context.Sim(target, timing or on_device)
    sim.in_run = True
    sim.bridge, sim.device = bridge, device
    if on_device:
        sim.device_outputs = True
    prev = context.set_current(sim)
    prev_rounder = dtypes.stochastic_rounder
    if on_device:
        rounding = getattr(bridge, "rounding", None)
        dtypes.stochastic_rounder = rounding(device) if rounding is not None else None
    try:
        def conv(a, i):
            if isinstance(a, np.ndarray) or id(a) in bridged:
                return _wrap_input(a, f"in{i}_{new_id()}", bridged.get(id(a)))
            return a
        wargs = [conv(a, i) for i, a in enumerate(args)]
        wkw = {k: conv(v, k) for k, v in kwargs.items()}
        grid = tuple(grid)
        sim.grid = grid
        programs = list(itertools.product(*(range(g) for g in grid))) if grid else [()]

        def run_program(k):
            sim.k, sim.pid, sim.shared_i = k, programs[k], 0
            if sim.timing:
                sim.tl = sim.timelines[k % len(sim.timelines)]
            try:
                return func(*wargs, **wkw)
            finally:
                # Queued GEMMs land before outputs are read (or the error propagates).
                tensore.drain()
        sim.run_program = run_program
        result = None
        for k in range(len(programs)):
            pair = sim.lnc
            if pair is not None and k == pair.k0 + 1 and pair.thread is not None:
                r = pair.join()             # core 1 started early, at a core-to-core instruction
            else:
                r = run_program(k)
                if sim.lnc is not None and sim.lnc.k0 == k:
                    sim.lnc.done.add(0)
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
        out = _outputs(result, sim, func)
        if on_device:
            bridge.kernel_ran(device, getattr(func, "__name__", "kernel"), _latency_ns(sim))
        return out, sim
    finally:
        if sim.lnc is not None:
            sim.lnc.cancel()
        dtypes.stochastic_rounder = prev_rounder
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


class Kernel:
    """A kernel made by ``nki.jit``: call it (simulated), index it with a grid."""

    def __init__(self, func, grid=(), target=None, **options):
        functools.update_wrapper(self, func)
        self.func, self.grid, self.target, self.options = func, grid, target, options
        self._nki_key = key = func_key(func)       # computed here: a compile trace reads it
        if key not in KERNEL_FUNCS:
            KERNEL_FUNCS[key] = func
            frameworks.load_imported()

    def __getitem__(self, grid):
        g = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
        return Kernel(self.func, g, self.target, **self.options)

    def __call__(self, *args, **kwargs):
        outer = context._current
        if outer is not None and outer.in_run:
            # A kernel called from a running kernel is a sub-kernel: its instructions join
            # the caller's program (one launch, tiles shared), as NKI-lib's fused blocks use.
            return self.func(*args, **kwargs)
        tracer = frameworks.tracing()
        if tracer is not None:
            return tracer.call_compiled(self, args, kwargs)
        out, _ = run(self.func, args, kwargs, self.grid, self.target)
        return out


def _as_kernel(k):
    return k if isinstance(k, Kernel) else Kernel(k)


def jit(func=None, mode=None, platform_target=None, **options):
    """``@nki.jit`` or ``@nki.jit(platform_target="trn2", ...)``."""
    if func is None:
        return lambda f: Kernel(f, target=platform_target, **options)
    return Kernel(func, target=platform_target, **options)


class _CpuLaunch:
    """``nki.cpu_simulate(kernel)``: index it with the logical core count, then call."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, lnc):
        lnc = int(lnc)
        if lnc < 1:
            raise ValueError(f"nki.cpu_simulate: the logical core count must be >= 1, got {lnc}")
        k = self.kernel[lnc] if lnc > 1 else self.kernel
        # AWS's harness names the core generation in NKI_NC_VERSION (gen2/gen3/gen4).
        return simulate(k, platform_target=os.environ.get("NKI_NC_VERSION") or None)

    def __call__(self, *args, **kwargs):
        return self[1](*args, **kwargs)


def cpu_simulate(kernel):
    """AWS's CPU simulation entry as its kernel library's tests call it:
    ``nki.cpu_simulate(kernel)[lnc](**inputs)`` runs the kernel on NumPy inputs as an SPMD
    launch over ``lnc`` logical cores (``nl.program_id(0)`` tells them apart, as
    ``kernel[lnc]`` does); ``NKI_NC_VERSION`` picks the target."""
    return _CpuLaunch(_as_kernel(kernel))


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
