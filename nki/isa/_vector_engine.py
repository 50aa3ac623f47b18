"""VectorE instructions: elementwise, scalar, scan, reduce, copy, memset."""
from __future__ import annotations

import numpy as np

from .. import _ops
from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules
from ..simulator.tensor import NkiTensor
from ._common import _ENG, _PREDICATE, _T, _axes, _f32, _flat, _issue, _mi, _op, _operand, _put
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
    _issue(I, eng, max(_mi(), data.free_size), reads, [dst])
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
    _issue(I, eng, max(_mi(), src.free_size), [src], [dst])
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
    _issue(I, "vector", max(_mi(), src.free_size), reads, [dst] + ([reduce_res] if reduce_res is not None else []))
    with np.errstate(all="ignore"):
        y = np.exp(_f32(src) - mv)
    _put(dst, y)
    if reduce_res is not None:
        _put(reduce_res, y.sum(axis=1, keepdims=True) + np.float32(reduce_init))
