"""Modelled Trainium time of the work the device executed: a roofline per op.

The runtime (C++) counts every executed op by (name, device, dtype, input shapes, bytes,
stream, timeline epoch); this module turns those counts into time on the selected chip from
the hardware profile:

- TensorE ops (matmul, convolution, attention): systolic-array cycles. One ``nc_matmul``
  instruction takes a <=128x128 stationary tile and streams a <=512-wide moving tile, costing
  max(64, N) cycles (x4 for fp32, scaled by the profile's TFLOPS ratio for fp8; scaled
  matmuls at the chip's FP8 or MX rate, ``scaled_matmul_seconds``).
- Other ops: elements over the vector (or, for transcendentals, scalar) engine's lanes.
- Every op: HBM bytes over the logical core's bandwidth; time = launch + max(compute, HBM).
- Host copies: bytes over the host link.
- Streams overlap, as the chip's queues do: within one timeline epoch (the work between two
  cross-stream waits or host synchronizations of a device) the device takes as long as its
  busiest stream; epochs follow each other. Per-op and per-engine totals are busy time, so
  with several streams they can add up to more than the timeline.
Execution never reads this module: it is accounting, computed when asked.
"""
from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from . import _C, _state

_TENSORE = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "dot", "vdot", "mv", "addmv", "_scaled_mm",
            "_int_mm", "_grouped_mm", "convolution", "convolution_backward",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward"}
_SCALAR_ENGINE = {"exp", "exp_", "log", "log_", "tanh", "tanh_", "sigmoid", "sigmoid_", "gelu",
                  "gelu_backward", "silu", "silu_", "silu_backward", "_softmax",
                  "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "erf",
                  "rsqrt", "sqrt", "sin", "cos", "pow", "log1p", "expm1", "softplus",
                  "tanh_backward", "sigmoid_backward", "_foreach_sqrt", "_foreach_exp"}
_DTYPES = {getattr(torch, n): n for n in ("float32", "bfloat16", "float16", "float64",
                                           "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                           "float8_e5m2fnuz", "int8", "int32", "int64", "bool",
                                           "uint8", "int16")}


def _dtype_from_code(code: int) -> torch.dtype:
    # ScalarType enum values, as torch exposes them through an empty tensor's dtype.
    return _SCALAR_TYPES[code] if code < len(_SCALAR_TYPES) else torch.float32


_SCALAR_TYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
                 torch.bool, torch.qint8, torch.quint8, torch.qint32, torch.bfloat16,
                 torch.quint4x2, torch.quint2x4, torch.bits1x8, torch.bits2x4, torch.bits4x2,
                 torch.bits8, torch.bits16, torch.float8_e5m2, torch.float8_e4m3fn,
                 torch.float8_e5m2fnuz, torch.float8_e4m3fnuz]


def _shapes(sig) -> list:
    out, i = [], 0
    while i < len(sig) and sig[i] >= 0:
        nd = sig[i]
        out.append(tuple(sig[i + 1:i + 1 + nd]))
        i += 1 + nd
    return out


def _flags(sig) -> int:
    """The cost flags the runtime appends for attention ops (bit 0 causal, bit 1 a mask,
    bit 2 dropout), or 0."""
    i = 0
    while i < len(sig) and sig[i] >= 0:
        i += 1 + sig[i]
    return int(sig[i + 1]) if i + 1 < len(sig) and sig[i] == -1 else 0


# Ops whose time is a kernel library's modelled time rather than the roofline: op name ->
# callable(profile, lnc, shapes, dtype, flags) returning seconds, or None when that kernel
# does not cover the call. torch_neuronx.kernels.nkilib_routes registers them.
KERNEL_COSTS: dict = {}


def _matmul_dims(name: str, shapes: list):
    """(batch, M, K, N) of a TensorE op, or None when the shapes don't say."""
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        shapes = shapes[1:]
    if len(shapes) < 2:
        return None
    a, b = shapes[0], shapes[1]
    if name in ("mm", "addmm", "_scaled_mm", "_int_mm") and len(a) == 2 and len(b) == 2:
        return 1, a[0], a[1], b[1]
    if name in ("bmm", "baddbmm") and len(a) == 3 and len(b) == 3:
        return a[0], a[1], a[2], b[2]
    if name == "addbmm" and len(a) == 3 and len(b) == 3:
        return a[0], a[1], a[2], b[2]
    if name in ("mv", "addmv") and len(a) == 2:
        return 1, a[0], a[1], 1
    if name in ("dot", "vdot") and len(a) == 1:
        return 1, 1, a[0], 1
    if name == "_grouped_mm":
        # 2-D x 3-D (rows grouped), 2-D x 2-D (K grouped), 3-D x 3-D (batched), 3-D x 2-D
        # (N grouped): every form multiplies each row of A once, by one group's columns.
        if len(a) == 2 and len(b) == 3:
            return 1, a[0], a[1], b[2]
        if len(a) == 2 and len(b) == 2:
            return 1, a[0], a[1], b[1]
        if len(a) == 3 and len(b) == 3:
            return a[0], a[1], a[2], b[2]
        if len(a) == 3 and len(b) == 2:
            return 1, a[1], a[2], b[1]
        return None
    if name.startswith("_scaled_dot_product_flash_attention") and len(a) == 4 and len(b) == 4:
        bsz, heads, lq, d = a
        lk = b[2]
        mult = 2 if name.endswith("backward") else 1
        # QK^T and PV: two matmuls of (lq x d) by (d x lk) per head.
        return 2 * mult * bsz * heads, lq, d, lk
    if name.startswith("convolution") and len(a) >= 3 and len(b) >= 3:
        # implicit GEMM: M = out channels, K = in_ch/groups * kernel, N = batch * output pixels
        if name == "convolution" and len(shapes) >= 3:
            out = shapes[2]
            n_pix = out[0] * math.prod(out[2:])
            return 1, b[0], math.prod(b[1:]), n_pix
        if name == "convolution_backward":
            go, w = shapes[0], shapes[2] if len(shapes) > 2 else b
            n_pix = go[0] * math.prod(go[2:])
            return 2, w[0], math.prod(w[1:]), n_pix
    return None


def kernel_latency_ns(p) -> float:
    """The latency every kernel pays on the chip beyond its launch, however small its data:
    a DMA brings its input to SBUF, an engine waits on that DMA's semaphore, the store DMA
    waits on the engine's. Compiled graphs pay the same per kernel on the engine timeline
    (``compile/program.py``), so eager and compiled times compare."""
    return 2 * p.dma_fixed_ns + 2 * p.semaphore_ns


def _tensore_seconds(p, dims, dtype: torch.dtype, lnc: int) -> float:
    name = _DTYPES.get(dtype, "float32")
    key = "float8" if name.startswith("float8") else name
    return _systolic_seconds(p, dims, p.core_tflops.get(key, p.core_tflops["float32"]), lnc)


def _systolic_seconds(p, dims, tflops: float, lnc: int) -> float:
    """TensorE time of a (batch, M, K, N) matmul at a dtype's dense rate (``tflops`` per
    physical core): the instruction count is the BF16 tiling, each instruction shortened by
    the rate's ratio to BF16's."""
    batch, m, k, n = dims
    per_instr = max(p.min_ii_cycles, min(n, p.gemm_moving_fmax))
    instrs = math.ceil(k / p.pe_rows) * math.ceil(m / p.pe_cols) * math.ceil(n / p.gemm_moving_fmax)
    cycles = batch * instrs * per_instr * p.core_tflops["bfloat16"] / tflops
    return cycles / p.tensor_clock / lnc


# Chips already warned that they have no MX matmul path (warned once per process and chip).
_mx_warned: set = set()


def scaled_matmul_rate(p, kind: str) -> float:
    """Dense TFLOPS per physical core that a scaled matmul runs at: ``kind`` "float8"
    (tensorwise, rowwise or blockwise FP8 scales: the chip's FP8 rate) or "mx" (MXFP8/MXFP4
    with E8M0 block scales: the chip's MX rate). A chip without MX matmuls (Trainium1/2)
    dequantizes MX operands to BF16 first: charged at the BF16 rate, with a one-time warning."""
    if kind == "float8":
        return p.core_tflops["float8"]
    if kind != "mx":
        raise ValueError(f"scaled_matmul_rate: kind must be 'float8' or 'mx', got {kind!r}")
    rate = p.core_tflops.get("mx")
    if rate is not None:
        return rate
    if p.name not in _mx_warned:
        _mx_warned.add(p.name)
        warnings.warn(f"{p.chip} ({p.name}) has no MX matmul path (MXFP8/MXFP4 matmuls are "
                      f"Trainium3's): the cost model charges MX scaled matmuls at the BF16 rate "
                      f"({p.core_tflops['bfloat16']:g} TFLOPS per core); results are unchanged",
                      stacklevel=3)
    return p.core_tflops["bfloat16"]


def scaled_matmul_seconds(p, lnc: int, dims, kind: str, hbm_bytes: int) -> tuple:
    """(seconds, flops) of one scaled-matmul launch of (batch, M, K, N) ``dims``: launch and
    kernel latency, then the longer of the TensorE work at ``scaled_matmul_rate`` and the HBM
    traffic (operands, scales, bias and result)."""
    compute = _systolic_seconds(p, dims, scaled_matmul_rate(p, kind), lnc)
    hbm = hbm_bytes / p.core_hbm_bandwidth(lnc)
    seconds = (p.launch_overhead_ns + kernel_latency_ns(p)) * 1e-9 + max(compute, hbm)
    return seconds, 2.0 * math.prod(dims)


@dataclass
class ModelledTime:
    """Modelled time on the chip of the work executed since the last reset."""
    platform: str
    device: int
    seconds: float = 0.0
    launches: int = 0
    flops: float = 0.0
    hbm_bytes: int = 0
    host_bytes: int = 0
    link_bytes: int = 0           # bytes moved by collectives over NeuronLink/EFA
    by_op: dict = field(default_factory=lambda: defaultdict(float))
    by_engine: dict = field(default_factory=lambda: defaultdict(float))

    def top(self, n: int = 10) -> list:
        return sorted(self.by_op.items(), key=lambda kv: -kv[1])[:n]

    def __str__(self):
        ops = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.top(5))
        return (f"modelled {self.platform} time on neuron:{self.device}: {self.seconds * 1e3:.3f} ms "
                f"over {self.launches} launches ({self.flops / 1e9:.2f} GFLOP, "
                f"{self.hbm_bytes / 1e6:.1f} MB HBM); top: {ops}")


_totals: dict = {}
# Profilers (torch_neuronx.profiling) append callables here; each gets one
# (device, stream, name, engine, seconds, launches) tuple per modelled interval.
_listeners: list = []
# Callables told of every modelled interval with what was charged for it, as one ``OpCharge``
# each: plan.trace keeps them per op so a what-if can re-price an op for sharded shapes
# (kept apart from ``_listeners``, whose 6-tuples the profilers unpack).
_op_listeners: list = []
# Callables told of the work ``_add_time`` adds (the op records' work is not here), as one
# ``OpCharge`` each: the Kineto plugin records it as device events of its own.
_added_listeners: list = []


@dataclass(frozen=True)
class OpCharge:
    """What the cost model charged for ``count`` launches of one op signature on a device:
    ``shapes`` (input shapes), ``dtype``, ``bytes_in``/``bytes_out`` and ``flags`` are what
    ``op_seconds`` priced (None/0 for work added by ``_add_time``: collectives, fused and
    NKI kernels)."""
    device: int
    stream: int
    name: str
    engine: str
    seconds: float
    count: int
    flops: float
    hbm_bytes: int
    shapes: tuple | None = None
    dtype: torch.dtype | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    flags: int = 0
    epoch: int = -1   # the runtime's timeline epoch (cost_model._timeline); -1 for _add_time
    # a collective's bytes over the interconnect, its group's ranks and the nodes they span
    link_bytes: int = 0
    group_size: int = 0
    nodes: int = 0


_lock = threading.Lock()  # compiled graphs and collectives add from other threads


def op_seconds(p, lnc, op, shapes, dtype, bytes_in, bytes_out, count=1, flags=0) -> tuple:
    """(seconds, engine, flops) of ``count`` launches of a device op (not a copy) on the
    chip: its launch and kernel latency, then the longer of its engine work and its HBM
    traffic, or the modelled time of the library kernel it is routed to (KERNEL_COSTS).
    Eager ops are charged by it, and compiled graphs' library calls estimated."""
    hbm = (bytes_in + bytes_out) / p.core_hbm_bandwidth(lnc)
    dims = _matmul_dims(op, shapes) if op in _TENSORE else None
    flops = 0.0
    routed = KERNEL_COSTS.get(op)
    kernel = routed(p, lnc, shapes, dtype, flags) if routed is not None else None
    if kernel is not None:
        if dims is not None:
            flops = count * 2.0 * math.prod(dims) * (0.5 if flags & 1 else 1.0)
        # the library's norm kernels have no matmul: VectorE bounds them
        return (count * (p.launch_overhead_ns * 1e-9 + kernel),
                "tensor" if dims is not None else "vector", flops)
    if dims is not None:
        compute = count * _tensore_seconds(p, dims, dtype, lnc)
        flops = count * 2.0 * math.prod(dims)
        engine = "tensor"
    elif op == "fused_pointwise":  # Adaptive Eager: n ops on VectorE, one HBM round trip
        numel, n_ops = shapes[0]
        compute = count * numel * n_ops / (p.vector_lanes * p.vector_clock * lnc)
        engine = "vector"
    else:
        elems = max(bytes_in, bytes_out) / dtype.itemsize
        base = op.rstrip("_")
        scalar = op in _SCALAR_ENGINE or base in _SCALAR_ENGINE
        clock = p.scalar_clock if scalar else p.vector_clock
        compute = elems / (p.vector_lanes * clock * lnc)
        engine = "scalar" if scalar else "vector"
    seconds = count * (p.launch_overhead_ns + kernel_latency_ns(p)) * 1e-9 + max(compute, hbm)
    return seconds, engine, flops


def recast_bytes(shapes, count: int, bytes_in: int, bytes_out: int, orig: torch.dtype,
                 new: torch.dtype) -> tuple:
    """(bytes_in, bytes_out) of ``count`` launches of an op recorded in ``orig`` as they would
    be with its floating-point tensors in ``new``. The record keeps one dtype and at most
    three input shapes, so int64 inputs (indices, targets) are told by the bytes they add and
    kept; when no single split explains the bytes, all are scaled."""
    scale = new.itemsize / orig.itemsize
    out = round(bytes_out * scale)
    numels = [math.prod(s) for s in shapes or ()]
    total = sum(numels)
    if not count or not total:
        return round(bytes_in * scale), out
    per_launch = bytes_in / count
    if per_launch == total * orig.itemsize:
        return count * total * new.itemsize, out
    found = set()
    for mask in range(1, 1 << len(numels)):
        ints = sum(x for i, x in enumerate(numels) if mask >> i & 1)
        if (total - ints) * orig.itemsize + ints * 8 == per_launch:
            found.add(count * ((total - ints) * new.itemsize + ints * 8))
    return (found.pop() if len(found) == 1 else round(bytes_in * scale)), out


# ``price_as``: (traced dtype, priced dtype) while a what-if prices one dtype as another.
_price_as: tuple | None = None


@contextlib.contextmanager
def price_as(dtype: torch.dtype, source: torch.dtype = torch.float32):
    """Charge the work executed inside the block as if its ``source`` tensors were
    ``dtype``: eager ops, fused kernels and copies recorded in ``source`` have their
    floating-point bytes scaled by the itemsizes (``recast_bytes``) and TensorE ops the
    rate of ``dtype``; compiled graphs' buffers and library calls in ``source`` likewise.
    For a host that runs ``dtype`` slowly (a BF16 matmul without BF16 instructions): run
    the step in fp32, read the bf16 step's modelled time. Calls charged as library kernels
    (grouped and scaled matmuls, RMSNorm, FlexAttention) are priced in ``dtype`` too
    (scaled matmuls' fp32 scales alike);
    collectives and NKI kernels are charged as executed. Execution is unchanged. The
    pricing is process-wide: work other threads run meanwhile is priced alike."""
    global _price_as
    for d in (dtype, source):
        if not d.is_floating_point:
            raise TypeError(f"price_as: {d} is not a floating-point dtype")
    _settle()
    previous, _price_as = _price_as, (source, dtype)
    try:
        yield
    finally:
        try:
            _settle()   # an asynchronous error surfacing here must not leave the pricing on
        finally:
            _price_as = previous


def priced_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the cost model prices ``dtype`` as (``price_as`` in force or not), for work
    priced from its tensors rather than from the runtime's records."""
    return _price_as[1] if _price_as is not None and dtype == _price_as[0] else dtype


def priced_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` as the cost model prices them (``price_as`` in force or not), for work
    charged from its tensors rather than from the runtime's records."""
    if _price_as is not None and t.dtype == _price_as[0]:
        return t.numel() * _price_as[1].itemsize
    return t.nbytes


def _settle() -> None:
    """Account every launch so far: Adaptive Eager windows are flushed and their records
    drained under the pricing in force when they ran."""
    from .neuron import device_count, synchronize
    for i in range(device_count()):
        synchronize(i)
    _drain()


def copy_seconds(p, lnc, op: str, nbytes: int, count: int = 1) -> float:
    """Seconds of ``count`` DMA copies (``copy_d2d`` within HBM, ``copy_h2d``/``copy_d2h``
    over the host link) moving ``nbytes`` in all."""
    link = p.core_hbm_bandwidth(lnc) if op == "copy_d2d" else p.host_link_bandwidth
    return count * p.dma_fixed_ns * 1e-9 + nbytes / link


def _account(record) -> tuple:
    """Accounts one record's busy time and returns (seconds, engine, flops, hbm_bytes,
    (dtype, bytes_in, bytes_out) as priced); the timeline is the caller's."""
    name, device, dtype_code, sig, count, bytes_in, bytes_out = record[:7]
    cfg = _state.config()
    p, lnc = cfg.profile, cfg.lnc
    t = _total(device)
    op = name.split("::", 1)[-1]
    dtype = _dtype_from_code(dtype_code)
    if _price_as is not None and dtype == _price_as[0]:
        # copies move only bytes_out; list ops and fused kernels have more operands than the
        # record's shapes: all their tensors are taken to be in the traced dtype
        whole = op.startswith(("copy_", "_foreach_", "_fused_")) or op == "fused_pointwise"
        bytes_in, bytes_out = recast_bytes(None if whole else _shapes(sig), count, bytes_in,
                                           bytes_out, dtype, _price_as[1])
        dtype = _price_as[1]
    if op.startswith("copy_"):
        seconds = copy_seconds(p, lnc, op, bytes_out, count)
        t.host_bytes += 0 if op == "copy_d2d" else bytes_out
        engine = "dma"
        flops, hbm = 0.0, 0
    else:
        seconds, engine, flops = op_seconds(p, lnc, op, _shapes(sig), dtype, bytes_in,
                                            bytes_out, count, _flags(sig))
        hbm = bytes_in + bytes_out
        t.flops += flops
        t.hbm_bytes += hbm
    t.launches += count
    t.by_op[op] += seconds
    t.by_engine[engine] += seconds
    return seconds, engine, flops, hbm, (dtype, bytes_in, bytes_out)


# Per device: the newest epoch seen and its busy seconds per stream, since later records may
# still fall into it.
_open: dict = {}


def _timeline(device: int, epoch: int, busy: dict) -> None:
    t = _total(device)
    last = _open.get(device)
    if last is not None and last[0] == epoch:
        t.seconds -= max(last[1].values())
        for stream, sec in busy.items():
            last[1][stream] = last[1].get(stream, 0.0) + sec
        busy = last[1]
    elif last is not None and last[0] > epoch:  # a straggler of a closed epoch: no overlap
        t.seconds += sum(busy.values())
        return
    t.seconds += max(busy.values())
    _open[device] = (epoch, busy)


def _total(device: int) -> ModelledTime:
    t = _totals.get(device)
    if t is None:
        t = _totals[device] = ModelledTime(platform=_state.config().profile.name, device=device)
    return t


def _drain() -> None:
    records = _C._drain_op_records()
    with _lock:
        epochs: dict = defaultdict(lambda: defaultdict(float))
        for record in records:
            seconds, engine, flops, hbm, priced = _account(record)
            device, stream, epoch = record[1], record[7], record[8]
            op = record[0].split("::", 1)[-1]
            for listen in _listeners:
                listen((device, stream, op, engine, seconds, record[4]))
            if _op_listeners:
                sig = record[3]
                charge = OpCharge(device, stream, op, engine, seconds, record[4], flops, hbm,
                                  tuple(_shapes(sig)), *priced, _flags(sig), epoch)
                for listen in _op_listeners:
                    listen(charge)
            epochs[(device, epoch)][stream] += seconds
        for (device, epoch), busy in sorted(epochs.items()):
            _timeline(device, epoch, busy)


def _close_windows() -> None:
    """Launches every device's Adaptive Eager window now, without waiting for it: its ops are
    recorded when it closes, so ops issued before a reading or a reset belong to it."""
    from .neuron import device_count
    for i in range(device_count()):
        _C._close_window(i)


def modelled_time(device=None, reset: bool = False) -> ModelledTime:
    """Modelled Trainium time of everything executed on ``device`` since the last reset."""
    from .neuron import _index
    _close_windows()
    _drain()
    idx = _index(device)
    with _lock:
        t = _totals.pop(idx, None) if reset else _totals.get(idx)
        if reset:
            _open.pop(idx, None)
    return t or ModelledTime(platform=_state.config().profile.name, device=idx)


def reset_modelled_time(device=None) -> None:
    """Forget accumulated modelled time (of one device, or of all when ``device`` is None)."""
    from .neuron import _index
    _close_windows()
    _drain()
    with _lock:
        if device is None:
            _totals.clear()
            _open.clear()
        else:
            _totals.pop(_index(device), None)
            _open.pop(_index(device), None)


def _add_time(device: int, name: str, seconds: float, *, engine: str, launches: int = 1,
              hbm_bytes: int = 0, link_bytes: int = 0, flops: float = 0.0, shapes=None,
              dtype=None, bytes_in: int = 0, bytes_out: int = 0, flags: int = 0,
              group_size: int = 0, nodes: int = 0) -> None:
    """Add work that the op records cannot see: fused kernels of compiled graphs (engine
    "fused"), NKI kernels ("nki", from the simulator's engine timeline), collectives
    ("collective", ``link_bytes`` over the interconnect among ``group_size`` ranks on
    ``nodes`` nodes) and calls charged as a library kernel (``shapes``, ``dtype``,
    ``bytes_in``/``bytes_out``, ``flags``: what ``op_seconds`` priced, if it did). Nothing is
    added on a thread whose op records are off."""
    if not _C._op_records():
        # inside a scope that charges its body as one kernel (charged_as): its Python
        # kernels' own charges are that kernel's too
        return
    if type(device) is not int:
        from .neuron import _index
        device = _index(device)
    with _lock:
        t = _total(device)
        t.seconds += seconds
        t.launches += launches
        t.flops += flops
        t.hbm_bytes += hbm_bytes
        t.link_bytes += link_bytes
        t.by_op[name] += seconds
        t.by_engine[engine] += seconds
        for listen in _listeners:
            listen((device, 0, name, engine, seconds, launches))
        if _op_listeners or _added_listeners:
            charge = OpCharge(device, 0, name, engine, seconds, launches, flops, hbm_bytes,
                              shapes, dtype, bytes_in, bytes_out, flags,
                              link_bytes=link_bytes, group_size=group_size, nodes=nodes)
            for listen in _op_listeners:
                listen(charge)
            for listen in _added_listeners:
                listen(charge)
