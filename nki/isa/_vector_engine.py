"""VectorE instructions: elementwise, scalar, scan, reduce, copy, memset, shuffle, MX quantize."""
from __future__ import annotations

import numpy as np

from .. import _ops
from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules
from ..simulator.tensor import NkiTensor
from . import _mx
from ._common import (_ENG, _PREDICATE, _T, _axes, _f32, _flat, _issue, _mi, _op, _operand, _put,
                      _reduce_regs)
from .constants import engine, reduce_cmd


def _binary_engine(op, engine_, tensors):
    e = _ENG.get(engine_)
    if e:
        return e
    if op.name == "power":
        return "gpsimd"
    if all(t.dtype.name in ("int32", "uint32") for t in tensors) and not any(t.kind == "psum" for t in tensors):
        return "gpsimd"
    return "vector"


def _tt_cycles(N, tensors):
    if any(t.kind == "psum" for t in tensors) or all(t.dtype.itemsize == 2 and t.dtype.is_float for t in tensors):
        return max(_mi(), N)
    return max(_mi(), 2 * N)


def _perf_cycles(eng, N, src, dst):
    """Copy and tensor-scalar cycles with the engines' performance modes (AWS's Trainium2 and
    Trainium3 architecture guides): from NeuronCore-v3, VectorE runs them 4x when input and
    output are 16-bit floats in SBUF with a contiguous innermost dim, 2x when the dim is not
    contiguous or one side is in PSUM; NeuronCore-v4's ScalarE runs 16-bit ones 2x."""
    half = all(t.dtype.itemsize == 2 and t.dtype.is_float for t in (src, dst))
    target = _ctx.current().profile.nki_target
    k = 1
    if half and eng == "vector" and target != "gen2":
        contig = all(t.v.ndim == 0 or t.v.strides[-1] == t.v.itemsize for t in (src, dst))
        psum = sum(t.kind == "psum" for t in (src, dst))
        k = 4 if contig and not psum else 2 if (psum == 1 and contig) or (not psum) else 1
    elif half and eng == "scalar" and target == "gen4":
        k = 2
    return max(_mi(), -(-N // k))


def _check_bitvec(I, op, tensors):
    if op.kind == "bitvec" and not all(t.dtype.is_int for t in tensors):
        _rules.fail(E.DtypeLegalityError, f"{I}: bitvec operator {op.name} needs integer dtypes, got "
                    f"{', '.join(t.dtype.name for t in tensors)}")


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = op(data1, data2) elementwise on VectorE (or GpSimd)."""
    I = "tensor_tensor"
    _T(dst, "dst", I), _T(data1, "data1", I), _T(data2, "data2", I)
    _rules.same_elems(I, data1, data2), _rules.same_elems(I, dst, data1)
    f = _op(op, I, ("arith", "bitvec", "compare", "logical"))
    _check_bitvec(I, f, [dst, data1, data2])
    if data1.kind == "psum" and data2.kind == "psum":
        _rules.fail(E.MemoryLegalityError, f"{I}: data1 and data2 cannot both be in PSUM")
    eng = _binary_engine(f, engine, [dst, data1, data2])
    _issue(I, eng, _tt_cycles(data1.free_size, [data1, data2]), [data1, data2], [dst])
    if f.kind == "bitvec" or (eng == "gpsimd" and all(t.dtype.is_int for t in (dst, data1, data2))):
        r = f.fn(_flat(data1).astype(np.int64), _flat(data2).astype(np.int64))
    else:
        r = _ops.apply_binary(f, _f32(data1), _f32(data2))
    _put(dst, r)


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition: r[i] = op1(op0(data0[i], r[i-1]), data1[i]) with r[-1] = initial."""
    I = "tensor_tensor_scan"
    _T(dst, "dst", I), _T(data0, "data0", I), _T(data1, "data1", I)
    _rules.same_elems(I, data0, data1), _rules.same_elems(I, dst, data0)
    f0, f1 = _op(op0, I, ("arith",)), _op(op1, I, ("arith",))
    if data0.kind == "psum" and data1.kind == "psum":
        _rules.fail(E.MemoryLegalityError, f"{I}: data0 and data1 cannot both be in PSUM")
    init = _operand(initial, data0, I, "initial")
    reads = [data0, data1] + ([initial] if isinstance(initial, NkiTensor) else [])
    _issue(I, "vector", max(_mi(), 2 * data0.free_size), reads, [dst])
    a, b = _f32(data0), _f32(data1)
    out = np.empty_like(a)
    prev = np.broadcast_to(np.asarray(init, np.float32).reshape(-1), (a.shape[0],)).astype(np.float32)
    with np.errstate(all="ignore"):
        for i in range(a.shape[1]):
            t = f0.fn(prev, a[:, i]) if reverse0 else f0.fn(a[:, i], prev)
            prev = (f1.fn(b[:, i], t) if reverse1 else f1.fn(t, b[:, i])).astype(np.float32)
            out[:, i] = prev
    _put(dst, out)


def _ts(x, op, operand, reverse):
    if op is None:
        return x
    return _ops.apply_binary(op, operand, x) if reverse else _ops.apply_binary(op, x, operand)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """dst = (data op0 operand0) op1 operand1, operands scalars or (P, 1) vectors."""
    I = "tensor_scalar"
    _T(dst, "dst", I), _T(data, "data", I)
    _rules.same_elems(I, dst, data)
    f0 = _op(op0, I)
    f1 = _op(op1, I) if op1 is not None else None
    if f1 is not None and (f0.kind == "bitvec") != (f1.kind == "bitvec"):
        _rules.fail(E.NkiRuleError, f"{I}: op0 and op1 must both be bitvec or both arithmetic")
    if (op1 is None) != (operand1 is None):
        _rules.fail(E.NkiRuleError, f"{I}: op1 and operand1 must be given together")
    _check_bitvec(I, f0, [dst, data])
    eng = _ENG.get(engine, "vector")
    if f0.kind == "bitvec" and eng != "vector":
        _rules.fail(E.NkiRuleError, f"{I}: bitvec operators run on VectorE only")
    o0, o1 = _operand(operand0, data, I, "operand0"), _operand(operand1, data, I, "operand1")
    reads = [data] + [t for t in (operand0, operand1) if isinstance(t, NkiTensor)]
    cycles = max(_mi(), data.free_size) if f0.kind == "bitvec" else _perf_cycles(eng, data.free_size, data, dst)
    _issue(I, eng, cycles, reads, [dst])
    if f0.kind == "bitvec":
        x = _flat(data).astype(np.int64)
        o0 = np.asarray(o0).astype(np.int64)
        r = f0.fn(o0, x) if reverse0 else f0.fn(x, o0)
        if f1 is not None:
            o1 = np.asarray(o1).astype(np.int64)
            r = f1.fn(o1, r) if reverse1 else f1.fn(r, o1)
    else:
        r = _ts(_ts(_f32(data), f0, o0, reverse0), f1, o1, reverse1)
    _put(dst, r)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None,
                         **_ignored):
    """dst = (data op0 operand0) op1 operand1 with operand1 a full tile, on VectorE."""
    I = "scalar_tensor_tensor"
    _T(dst, "dst", I), _T(data, "data", I), _T(operand1, "operand1", I)
    _rules.same_elems(I, dst, data), _rules.same_elems(I, data, operand1)
    f0, f1 = _op(op0, I, ("arith", "compare")), _op(op1, I, ("arith", "compare"))
    if data.kind == "psum" and operand1.kind == "psum":
        _rules.fail(E.MemoryLegalityError, f"{I}: data and operand1 cannot both be in PSUM")
    o0 = _operand(operand0, data, I, "operand0")
    reads = [data, operand1] + ([operand0] if isinstance(operand0, NkiTensor) else [])
    _issue(I, "vector", _tt_cycles(data.free_size, [data, operand1]), reads, [dst])
    t = _ts(_f32(data), f0, o0, reverse0)
    _put(dst, _ts(t, f1, _f32(operand1), reverse1))


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """tensor_scalar with one operator, plus a free-axis reduction into reduce_res."""
    I = "tensor_scalar_reduce"
    _T(dst, "dst", I), _T(data, "data", I)
    _rules.same_elems(I, dst, data)
    f0, fr = _op(op0, I, ("arith",)), _op(reduce_op, I, ("arith",))
    if fr.reduce is None:
        _rules.fail(E.NkiRuleError, f"{I}: reduce_op {fr.name} cannot reduce (use add, multiply, max, min)")
    o0 = _operand(operand0, data, I, "operand0")
    reads = [data] + ([operand0] if isinstance(operand0, NkiTensor) else [])
    _issue(I, "vector", max(_mi(), data.free_size) + _mi(), reads, [dst] + ([reduce_res] if reduce_res is not None else []))
    r = _ts(_f32(data), f0, o0, reverse0)
    _put(dst, r)
    if reduce_res is not None:
        red = fr.reduce(r, axis=1, keepdims=True).astype(np.float32)
        if reduce_init is not None:
            red = fr.fn(red, _operand(reduce_init, data, I, "reduce_init"))
        _put(reduce_res, -red if reduce_res_negate else red)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce free axes of data with op on VectorE."""
    I = "tensor_reduce"
    _T(dst, "dst", I), _T(data, "data", I)
    f = _op(op, I, ("arith", "bitvec"))
    if f.reduce is None:
        _rules.fail(E.NkiRuleError, f"{I}: operator {f.name} cannot reduce")
    _check_bitvec(I, f, [dst, data])
    ax = _axes(axis, data.ndim, I)
    keep = int(np.prod([data.shape[i] for i in range(data.ndim) if i not in ax]))
    if dst.size != keep:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must hold {keep} elements "
                    f"(data {tuple(data.shape)} reduced over axes {ax})")
    _issue(I, "vector", max(_mi(), data.free_size), [data], [dst])
    x = data.v if f.kind == "bitvec" else data.v.astype(np.float32, copy=False)
    r = f.reduce(x, axis=ax)
    _put(dst, -r if negate else r)


def tensor_partition_reduce(dst, op, data, name=None):
    """Reduce across partitions on GpSimd: dst has one partition."""
    I = "tensor_partition_reduce"
    _T(dst, "dst", I), _T(data, "data", I)
    f = _op(op, I, ("arith", "bitvec"))
    if dst.shape[0] != 1 or dst.free_size != data.free_size:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst must be (1, {data.free_size}), got {tuple(dst.shape)}")
    _issue(I, "gpsimd", 150 + data.free_size * data.shape[0] // 16, [data], [dst])
    _put(dst, f.reduce(_f32(data), axis=0, keepdims=True))


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """Copy on VectorE/ScalarE/GpSimd: bit-exact for equal dtypes, else via float32."""
    I = "tensor_copy"
    _T(dst, "dst", I), _T(src, "src", I)
    _rules.same_elems(I, dst, src)
    eng = _ENG.get(engine, "vector")
    if eng == "scalar" and _ctx.current().profile.nki_target == "gen2":
        _rules.fail(E.NkiRuleError, f"{I}: ScalarE tensor_copy is not supported on NeuronCore-v2 "
                    f"(use nisa.activation with op=nl.copy)")
    _issue(I, eng, _perf_cycles(eng, src.free_size, src, dst), [src], [dst])
    if dst.dtype == src.dtype:
        v = src.v
        dst.v[...] = v if v.shape == dst.shape else v.reshape(dst.shape)
    else:
        _put(dst, _flat(src) if src.dtype.is_int and dst.dtype.is_int else _f32(src))


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """Copy src (tile or scalar) into dst where predicate is nonzero, on VectorE."""
    I = "tensor_copy_predicated"
    _T(dst, "dst", I), _T(predicate, "predicate", I)
    _rules.same_elems(I, dst, predicate)
    if predicate.dtype.name not in _PREDICATE:
        _rules.fail(E.DtypeLegalityError, f"{I}: predicate dtype must be uint8/uint16/uint32, got {predicate.dtype.name}")
    reads = [predicate]
    if isinstance(src, NkiTensor):
        _rules.same_elems(I, dst, src)
        if src.dtype != dst.dtype:
            _rules.fail(E.DtypeLegalityError, f"{I}: src ({src.dtype.name}) and dst ({dst.dtype.name}) must share a dtype")
        if src.kind == "psum" and predicate.kind == "psum":
            _rules.fail(E.MemoryLegalityError, f"{I}: src and predicate cannot both be in PSUM")
        if reverse_pred:
            _rules.fail(E.NkiRuleError, f"{I}: reverse_pred=True needs a scalar src")
        reads.append(src)
    both_sbuf = all(t.kind == "sbuf" for t in reads)
    _issue(I, "vector", max(_mi(), (2 if both_sbuf else 1) * dst.free_size), reads, [dst])
    mask = _flat(predicate) != 0
    if reverse_pred:
        mask = ~mask
    cur = _flat(dst).copy()
    val = _flat(src) if isinstance(src, NkiTensor) else np.asarray(dst.dtype.round(np.float32(src)))
    _put(dst, np.where(mask, val, cur))


def memset(dst, value, engine=engine.unknown, name=None):
    I = "memset"
    _T(dst, "dst", I)
    eng = _ENG.get(engine, "vector")
    _issue(I, eng, max(_mi(), dst.free_size), [], [dst])
    dst.v[...] = dst.dtype.round(np.full((), value, np.float32 if dst.dtype.is_float else np.float64))


def reciprocal(dst, data, name=None):
    I = "reciprocal"
    _T(dst, "dst", I), _T(data, "data", I)
    _rules.same_elems(I, dst, data)
    _issue(I, "vector", max(_mi(), 8 * data.free_size), [data], [dst])
    with np.errstate(all="ignore"):
        _put(dst, np.float32(1.0) / _f32(data))


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle, reduce_init=0.0, name=None):
    """dst = exp(src - max_value), optional sum into reduce_res."""
    I = "exponential"
    _T(dst, "dst", I), _T(src, "src", I)
    mv = _operand(max_value, src, I, "max_value")
    reads = [src] + ([max_value] if isinstance(max_value, NkiTensor) else [])
    # 4x the throughput of ScalarE's activation(exp) (Trainium3 architecture guide, "Fast
    # Exponential Evaluation"): N/4 ScalarE cycles, in VectorE cycles.
    p = _ctx.current().profile
    cycles = max(_mi(), -(-src.free_size // 4) * p.vector_clock / p.scalar_clock)
    _issue(I, "vector", cycles, reads, [dst] + ([reduce_res] if reduce_res is not None else []))
    with np.errstate(all="ignore"):
        y = np.exp(_f32(src) - mv)
    _put(dst, y)
    if reduce_res is not None:
        _put(reduce_res, y.sum(axis=1, keepdims=True) + np.float32(reduce_init))


# op1 of tensor_scalar_cumulative: the operator and the register value reset_reduce loads.
_CUMULATIVE = {"add": (np.add, 0.0), "subtract": (np.subtract, 0.0), "multiply": (np.multiply, 1.0),
               "maximum": (np.maximum, -np.inf), "max": (np.maximum, -np.inf),
               "minimum": (np.minimum, np.inf), "min": (np.minimum, np.inf)}
_CUMULATIVE_DTYPES = {"bfloat16", "float16", "float32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2",
                      "uint8", "uint16", "int8", "int16"}


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=reduce_cmd.reset_reduce,
                             name=None):
    """Per partition: reg = op1(op0(src[i], imm0), reg); dst[i] = reg, on VectorE. The
    register starts at op1's identity (reset_reduce), at imm1 (load_reduce) or where the last
    VectorE accumulation left it (reduce), and keeps the final value."""
    I = "tensor_scalar_cumulative"
    _T(dst, "dst", I), _T(src, "src", I)
    _rules.same_elems(I, dst, src)
    f0, f1 = _op(op0, I, ("arith",)), _op(op1, I, ("arith",))
    if f1.name not in _CUMULATIVE:
        _rules.fail(E.NkiRuleError, f"{I}: op1 must be add, subtract, multiply, maximum or minimum, got {f1.name}")
    for t, w in ((dst, "dst"), (src, "src")):
        if t.dtype.name not in _CUMULATIVE_DTYPES:
            _rules.fail(E.DtypeLegalityError, f"{I}: {w} dtype {t.dtype.name} is not supported (bf16, fp16, "
                        f"fp32, fp8, uint8, uint16, int8, int16; no 32-bit integers)")
    for x, w in ((imm0, "imm0"), (imm1, "imm1")):
        if isinstance(x, NkiTensor) and x.dtype.name != "float32":
            _rules.fail(E.DtypeLegalityError, f"{I}: {w} must be float32, got {x.dtype.name}")
    cmd = type(reduce_cmd)
    if reduce_cmd not in (cmd.reset_reduce, cmd.reduce, cmd.load_reduce):
        _rules.fail(E.NkiRuleError, f"{I}: reduce_cmd must be reset_reduce, reduce or load_reduce, "
                    f"got {reduce_cmd}")
    if reduce_cmd == cmd.load_reduce and imm1 is None:
        _rules.fail(E.NkiRuleError, f"{I}: reduce_cmd=load_reduce loads the register from imm1, which is None")
    i0, i1 = _operand(imm0, src, I, "imm0"), _operand(imm1, src, I, "imm1")
    reads = [src] + [t for t in (imm0, imm1) if isinstance(t, NkiTensor)]
    _issue(I, "vector", max(_mi(), src.free_size), reads, [dst])
    sim = _ctx.current()
    fn, identity = _CUMULATIVE[f1.name]
    P = src.shape[0]
    if reduce_cmd == cmd.load_reduce:
        reg = np.broadcast_to(np.asarray(i1, np.float32).reshape(-1, 1), (P, 1))
    elif reduce_cmd == cmd.reduce:
        reg = _reduce_regs(sim, "vector_regs", P, reduce_cmd, None)
    else:
        reg = np.full((P, 1), identity, np.float32)
    x = _ts(_f32(src), f0, i0, False)
    with np.errstate(all="ignore"):
        if fn is np.subtract:           # reg = x - reg: not associative, so step by step
            out = np.empty_like(x)
            r = reg[:, 0].astype(np.float32)
            for i in range(x.shape[1]):
                r = x[:, i] - r
                out[:, i] = r
        else:                           # op1(x, reg) == op1(reg, x): a running reduction
            out = fn.accumulate(np.concatenate([reg.astype(np.float32), x], axis=1), axis=1)[:, 1:]
    sim.vector_regs = out[:, -1:].copy()
    _put(dst, out)


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within every 32-partition quadrant, dst partition i = src partition shuffle_mask[i]
    (255: leave dst partition i as is), on VectorE; in place allowed."""
    I = "nc_stream_shuffle"
    _T(dst, "dst", I), _T(src, "src", I)
    if dst.dtype != src.dtype:
        _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype {dst.dtype.name} must equal src dtype {src.dtype.name}")
    if dst.free_size != src.free_size:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} and src {tuple(src.shape)} must have "
                    f"the same number of elements per partition")
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        _rules.fail(E.NkiRuleError, f"{I}: shuffle_mask must be 32 source partitions in [0, 32) or 255, "
                    f"got {mask}")
    sp, dp = src.shape[0], dst.shape[0]
    active = -(-max(sp, dp) // 32) * 32
    starts = {32: (0, 32, 64, 96), 64: (0, 64)}.get(active, (0,))
    for t, w in ((src, "src"), (dst, "dst")):
        if t.pstart not in starts:
            _rules.fail(E.PartitionAlignmentError, f"{I}: {w} starts at partition {t.pstart}; with {active} "
                        f"active partitions it must start at {'/'.join(map(str, starts))}")
    m = np.array(mask)
    keep = np.flatnonzero(m != 255)
    d_rows = (np.arange(0, active, 32)[:, None] + keep[None, :]).reshape(-1)
    s_rows = (np.arange(0, active, 32)[:, None] + m[keep][None, :]).reshape(-1)
    sel = d_rows < dp
    d_rows, s_rows = d_rows[sel], s_rows[sel]
    if s_rows.size and s_rows.max() >= sp:
        _rules.fail(E.IndexOutOfBoundsError, f"{I}: shuffle_mask reads src partition {int(s_rows.max())}, but "
                    f"src {tuple(src.shape)} has {sp}")
    _issue(I, "vector", max(_mi(), src.free_size), [src], [dst])
    s = _flat(src)[s_rows].copy()
    out = _flat(dst).copy()
    out[d_rows] = s
    dst.v[...] = out.reshape(dst.shape)


def quantize_mx(dst, src, dst_scale, name=None):
    """MXFP8 data and E8M0 scales from an fp16/bf16 tile on VectorE (trn3 only).

    Per group of 32 values (8 partitions x 4 consecutive elements, which become one x4 word
    of dst): X = 2**(floor(log2(max |v|)) - (Emax - 1)), Emax 8 (e4m3fn) or 15 (e5m2) --
    twice the OCP reference scale, so rounding the largest value never saturates; an all-zero
    group gets 2**-127. dst = v / X rounded to nearest even."""
    I = "quantize_mx"
    sim = _ctx.current()
    _mx.require_gen4(I, sim)
    _T(dst, "dst", I), _T(src, "src", I), _T(dst_scale, "dst_scale", I)
    if src.dtype.name not in ("float16", "bfloat16"):
        _rules.fail(E.DtypeLegalityError, f"{I}: src dtype must be float16 or bfloat16, got {src.dtype.name}")
    if dst.dtype.name not in ("float8_e5m2_x4", "float8_e4m3fn_x4"):
        _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype must be float8_e5m2_x4 or float8_e4m3fn_x4, got "
                    f"{dst.dtype.name}")
    for t, w in ((dst, "dst"), (src, "src")):
        if t.kind != "sbuf":
            _rules.fail(E.MemoryLegalityError, f"{I}: {w} must be in SBUF, {t.name!r} is in {t.kind.upper()}")
    P, F4 = src.shape[0], src.free_size
    if P % 32:
        _rules.fail(E.ShapeMismatchError, f"{I}: src spans {P} partitions; it must be a multiple of 32")
    if F4 % 4 or dst.shape[0] != P or dst.free_size * 4 != F4:
        _rules.fail(E.ShapeMismatchError, f"{I}: src {tuple(src.shape)} needs a multiple of 4 elements per "
                    f"partition and dst of {P} partitions x a quarter of them, got dst {tuple(dst.shape)}")
    _mx.check_scale(I, dst_scale, dst, "dst_scale", source=src)
    # Four input elements per partition per cycle (AWS trn3 arch guide, 4x mode).
    _issue(I, "vector", max(_mi(), -(-F4 // 4)), [src], [dst, _mx.scale_span(dst_scale, P)])
    F = F4 // 4
    x = _f32(src).reshape(P // 8, 8, F, 4)
    amax = np.abs(x).max(axis=(1, 3))
    bad = ~np.isfinite(amax)
    emax = 8 if dst.dtype.name == "float8_e4m3fn_x4" else 15
    e = np.frexp(np.where(bad, 1, amax))[1]            # amax = m * 2**e, 0.5 <= m < 1
    exps = np.where(amax == 0, -127, np.clip(e - emax, -127, 127)).astype(np.int32)
    exps[bad] = 0
    with np.errstate(all="ignore"):
        q = np.ldexp(x, -exps[:, None, :, None])
    q[np.broadcast_to(bad[:, None, :, None], q.shape)] = np.nan
    dst.v[...] = _mx.pack(q.reshape(P, F, 4), dst.dtype).reshape(dst.shape)
    _mx.write_scales(dst_scale, P, exps, bad)
