"""``nki.isa``: one function per NeuronCore instruction, destination first (NKI 0.7).

Each instruction checks the rules AWS documents for it, computes its result as a vectorized
numpy operation on whole tiles (float32 math, then rounding to the destination dtype), and
reports its engine and cost to the simulator. Costs are AWS's published formulas in engine
cycles; clocks and fixed latencies come from the hardware profile.
"""
from __future__ import annotations

import enum

import numpy as np

from . import _ops
from . import errors as E
from .simulator import context as _ctx
from .simulator import rules as _rules
from .simulator import tensore as _tensore
from .simulator.tensor import NkiTensor


class engine(enum.Enum):
    unknown = 0
    tensor = 1
    vector = 2
    scalar = 3
    gpsimd = 4
    sync = 5
    activation = 3


tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor, engine.vector, engine.scalar, engine.gpsimd, engine.unknown)


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3


class dge_mode(enum.Enum):
    unknown = 0
    none = 1
    swdge = 2
    hwdge = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):
    none = 0
    double_row = 1


class dma_engine(enum.Enum):
    dma = 0
    gpsimd_dma = 1


class nc_version(enum.IntEnum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version():
    return nc_version[_ctx.current().profile.nki_target]


_ENG = {engine.tensor: "tensor", engine.vector: "vector", engine.scalar: "scalar",
        engine.gpsimd: "gpsimd"}
_FP_MM = {"float8_e4m3", "float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32"}
_PREDICATE = {"uint8", "uint16", "uint32"}


def _mi():
    return _ctx.current().profile.min_ii_cycles


def _T(x, what, instr):
    if not isinstance(x, NkiTensor):
        _rules.fail(E.ShapeMismatchError, f"{instr}: {what} must be a tensor, got {type(x).__name__}")
    return x


def _flat(t: NkiTensor) -> np.ndarray:
    return t.v.reshape(t.shape[0], -1) if t.shape else t.v.reshape(1, 1)


def _f32(t: NkiTensor) -> np.ndarray:
    v = _flat(t)
    return v if v.dtype == np.float32 else v.astype(np.float32)


def _put(dst: NkiTensor, vals):
    vals = np.asarray(vals)
    if vals.shape != dst.shape:
        vals = vals.reshape(dst.shape)
    if dst.buf.dtype.name == "float32" and vals.dtype == np.float32:
        dst.v[...] = vals
    else:
        dst.v[...] = dst.buf.dtype.round(vals)


def _operand(x, data: NkiTensor, instr, what):
    """A scalar, or a (P, 1) vector broadcast along the free dimension."""
    if isinstance(x, NkiTensor):
        if x.shape[0] != data.shape[0] or x.free_size != 1:
            _rules.fail(E.ShapeMismatchError,
                        f"{instr}: {what} must be a scalar or a ({data.shape[0]}, 1) tile, got {tuple(x.shape)}")
        return _f32(x).reshape(-1, 1)
    if x is None:
        return None
    return np.float32(x)


def _op(op, instr, kinds=None):
    if isinstance(op, str):
        op = _ops.ALL.get(op)
    if not isinstance(op, _ops.Op):
        _rules.fail(E.NkiRuleError, f"{instr}: op must be an nki.language operator (e.g. nl.add), got {op!r}")
    if kinds and op.kind not in kinds:
        _rules.fail(E.NkiRuleError, f"{instr}: operator {op.name} is not allowed here (needs {'/'.join(kinds)})")
    return op


def _close_groups(t: NkiTensor):
    """A non-matmul access ends the PSUM accumulation groups it touches."""
    g = t.buf.groups
    if g:
        b = t.box()[1]
        g[:] = [x for x in g if x[0] >= b[1] or b[0] >= x[1] or x[2] >= b[3] or b[2] >= x[3]]


def _issue(name, eng, cycles, reads, writes):
    sim = _ctx.current()
    sim.compute(name, eng, cycles, reads, writes)
    if eng != "tensor":
        for t in reads + writes:
            if t.buf.groups:
                _close_groups(t)


# ----------------------------------------------------------------------------- TensorE
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None):
    """dst = stationary.T @ moving on TensorE; fp32 accumulation in PSUM."""
    I = "nc_matmul"
    sim = _ctx.current()
    p = sim.profile
    _T(dst, "dst", I), _T(stationary, "stationary", I), _T(moving, "moving", I)
    K, M, N = stationary.shape[0], stationary.free_size, moving.free_size
    if moving.shape[0] != K:
        _rules.fail(E.MatmulTileError, f"{I}: stationary {tuple(stationary.shape)} and moving "
                    f"{tuple(moving.shape)} must share the contraction (partition) size")
    if K > p.pe_rows:
        _rules.fail(E.MatmulTileError, f"{I}: contraction (partition) size {K} > {p.pe_rows}")
    if M > p.pe_cols:
        _rules.fail(E.MatmulTileError, f"{I}: stationary free size {M} > {p.pe_cols} "
                    f"(nl.tile_size.gemm_stationary_fmax)")
    if N > p.gemm_moving_fmax:
        _rules.fail(E.MatmulTileError, f"{I}: moving free size {N} > {p.gemm_moving_fmax} "
                    f"(nl.tile_size.gemm_moving_fmax)")
    if dst.shape[0] != M or dst.free_size != N:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must be ({M}, {N}) for "
                    f"stationary {tuple(stationary.shape)} and moving {tuple(moving.shape)}")
    for t, w in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype.name not in _FP_MM:
            _rules.fail(E.DtypeLegalityError, f"{I}: {w} dtype {t.dtype.name} is not supported "
                        f"(float8_e4m3/float8_e5m2/bfloat16/float16/tfloat32/float32)")
    if (stationary.dtype.name == "float32") != (moving.dtype.name == "float32"):
        _rules.fail(E.DtypeLegalityError, f"{I}: fp32 matmul needs both inputs fp32, got "
                    f"{stationary.dtype.name} and {moving.dtype.name}")
    if is_transpose:
        if dst.dtype != stationary.dtype:
            _rules.fail(E.DtypeLegalityError, f"{I}: a transpose (is_transpose=True) writes the input "
                        f"dtype {stationary.dtype.name}, dst is {dst.dtype.name}")
    elif dst.dtype.name not in ("float32", "bfloat16"):
        _rules.fail(E.DtypeLegalityError, f"{I}: matmul results are float32 in PSUM; dst dtype "
                    f"{dst.dtype.name} is not allowed")
    if dst.kind == "psum":
        b = dst.box()[1]
        bank = p.psum_bank_bytes
        if b[3] - b[2] > bank or b[2] // bank != (b[3] - 1) // bank:
            _rules.fail(E.PsumBankError, f"{I}: output {tuple(dst.shape)} occupies PSUM bytes "
                        f"[{b[2]}, {b[3]}) per partition; a matmul writes within one "
                        f"{bank}-byte PSUM bank")
    if perf_mode == matmul_perf_mode.double_row and sim.profile.nki_target == "gen2":
        _rules.fail(E.NkiRuleError, f"{I}: perf_mode double_row is not supported on NeuronCore-v2")
    cycles = max(min(64, M), N)
    if stationary.dtype.name == "float32":
        cycles *= 4
    elif perf_mode == matmul_perf_mode.double_row:
        cycles = cycles / 2
    sim.compute(I, "tensor", cycles, [stationary, moving], [dst])
    # Accumulation groups: the first matmul into a PSUM region overwrites it, later ones add.
    acc = False
    groups = dst.buf.groups
    if groups is not None:
        b = dst.box()[1]
        open_ = b in groups
        if accumulate is None:
            acc = open_
        elif accumulate:
            if not open_ and sim.profile.nki_target != "gen2":
                _rules.fail(E.PsumAccumulateError,
                            f"{I}: accumulate=True onto PSUM {dst.name!r} that no matmul of an open "
                            f"accumulation group wrote; the first matmul into a PSUM location must "
                            f"use accumulate=False (accumulating onto PSUM initialised by another "
                            f"instruction is undefined on NeuronCore-v3+)")
            acc = True
        if not open_:
            _close_groups(dst)
            groups.append(b)
    elif accumulate:
        acc = True
    a = stationary.v if stationary.v.ndim == 2 else _flat(stationary)
    m = moving.v if moving.v.ndim == 2 else _flat(moving)
    out = dst.v
    if out.ndim == 2 and dst.dtype.name == "float32":
        if acc:
            def work():
                tmp = _tensore.pool().tmp(out.shape)
                np.matmul(a.T, m, out=tmp)
                np.add(out, tmp, out=out)
        else:
            def work():
                np.matmul(a.T, m, out=out)
    else:
        def work():
            r = a.T @ m
            _put(dst, r + _f32(dst) if acc else r)
    key = dst.box()[1][2] // p.psum_bank_bytes if dst.kind == "psum" else 0
    # Outside a kernel run (interactive use) nothing would drain the queue: run inline.
    _tensore.pool().submit(key, K * M * N if sim.in_run else 0, work)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst = data.T (partition <-> free) on TensorE (to PSUM) or VectorE (32x32 blocks)."""
    I = "nc_transpose"
    _T(dst, "dst", I), _T(data, "data", I)
    P, F = data.shape[0], data.free_size
    if dst.shape[0] != F or dst.free_size != P:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must be ({F}, {P}) for data {tuple(data.shape)}")
    eng = _ENG.get(engine) or ("tensor" if dst.kind == "psum" else "vector")
    if eng == "vector":
        if P > 32 or F > 32:
            _rules.fail(E.ShapeMismatchError, f"{I}: VectorE transposes at most 32x32, got {P}x{F}")
        cycles = max(_mi(), F)
    else:
        p = _ctx.current().profile
        if P > p.pe_rows or F > p.pe_cols:
            _rules.fail(E.MatmulTileError, f"{I}: TensorE transposes at most {p.pe_rows}x{p.pe_cols}, got {P}x{F}")
        if dst.dtype != data.dtype:
            _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}")
        cycles = max(min(64, F), P) * (4 if data.dtype.name == "float32" else 1)
    _issue(I, eng, cycles, [data], [dst])
    if dst.buf.groups is not None and eng == "tensor":
        _close_groups(dst)
    _put(dst, _flat(data).T.copy())


# ----------------------------------------------------------------------------- ScalarE
def _reduce_regs(sim, attr, P, cmd, partial, op=np.add):
    regs = getattr(sim, attr)
    if regs is None or regs.shape[0] != P:
        regs = np.zeros((P, 1), np.float32)
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs = np.zeros((P, 1), np.float32)
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce) and partial is not None:
        regs = partial.astype(np.float32) if cmd == reduce_cmd.reset_reduce else op(regs, partial)
    setattr(sim, attr, regs)
    return regs


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, engine=engine.scalar, name=None):
    """dst = op(data * scale + bias) on ScalarE, optionally summing each partition."""
    I = "activation"
    _T(dst, "dst", I), _T(data, "data", I)
    _rules.same_elems(I, dst, data)
    f = _op(op, I, ("act", "arith"))
    sim = _ctx.current()
    sc = _operand(scale, data, I, "scale")
    bi = _operand(bias, data, I, "bias")
    reads = [data] + [t for t in (scale, bias) if isinstance(t, NkiTensor)]
    writes = [dst] + ([reduce_res] if reduce_res is not None else [])
    eng = _ENG.get(engine, "scalar")
    if eng == "gpsimd" and sim.profile.nki_target != "gen4":
        _rules.fail(E.NkiRuleError, f"{I}: GpSimd activation needs NeuronCore-v4 (trn3)")
    if reduce_res is not None and reduce_op is not None and getattr(reduce_op, "name", "") != "add":
        _rules.fail(E.NkiRuleError, f"{I}: reduce_op must be nl.add (ScalarE reduce registers only sum)")
    N = data.free_size
    _issue(I, eng, max(_mi(), N) + (_mi() if reduce_res is not None else 0), reads, writes)
    with np.errstate(all="ignore"):
        x = _f32(data)
        if sc is not None and not (np.ndim(sc) == 0 and sc == 1.0):
            x = x * sc
        if bi is not None:
            x = x + bi
        y = _ops.apply_unary(f, x) if f.kind == "act" else _ops.apply_binary(f, x, np.float32(0))
    if reduce_res is not None and reduce_cmd == reduce_cmd.idle:
        reduce_cmd = type(reduce_cmd).reset_reduce
    if reduce_cmd != type(reduce_cmd).idle:
        part = y.sum(axis=1, keepdims=True, dtype=np.float32)
        regs = _reduce_regs(sim, "scalar_regs", data.shape[0], reduce_cmd, part)
        if reduce_res is not None:
            _put(reduce_res, regs)
    _put(dst, y)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    return activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op,
                      reduce_res=reduce_res, reduce_cmd=reduce_cmd.reset_reduce)


# ----------------------------------------------------------------------------- VectorE
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


def _axes(axis, ndim, I):
    ax = tuple(int(a) for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
    ax = tuple(a + ndim if a < 0 else a for a in ax)
    if 0 in ax:
        _rules.fail(E.NkiRuleError, f"{I}: the partition axis (0) cannot be reduced here")
    if sorted(ax) != list(range(ndim - len(ax), ndim)):
        _rules.fail(E.NkiRuleError, f"{I}: reduction axes {ax} must be the last contiguous free axes "
                    f"of a rank-{ndim} tile")
    return ax


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


# ----------------------------------------------------------------------------- GpSimd
def _pattern_values(dst, pattern, offset, channel_multiplier, I):
    pat = [list(p) for p in pattern]
    if len(pat) > 4:
        _rules.fail(E.NkiRuleError, f"{I}: pattern has at most 4 [step, num] pairs")
    steps = np.array([p[0] for p in pat], np.int64)
    nums = [int(p[1]) for p in pat]
    if int(np.prod(nums)) != dst.free_size:
        _rules.fail(E.ShapeMismatchError, f"{I}: pattern generates {int(np.prod(nums))} elements per "
                    f"partition, dst has {dst.free_size}")
    free = np.zeros(1, np.int64)
    for s, n in zip(steps, nums):
        free = (free[:, None] + s * np.arange(n, dtype=np.int64)[None, :]).reshape(-1)
    ch = np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
    return int(offset) + ch + free[None, :]


def iota(dst, pattern, offset, channel_multiplier=0, name=None):
    """dst[p, ...] = offset + p*channel_multiplier + sum(step_i * idx_i) on GpSimd."""
    I = "iota"
    _T(dst, "dst", I)
    vals = _pattern_values(dst, pattern, offset, channel_multiplier, I)
    _issue(I, "gpsimd", 150 + dst.free_size, [], [dst])
    _put(dst, vals.astype(np.float32) if dst.dtype.is_float else vals)


def affine_select(dst, pattern, offset, channel_multiplier, on_true_tile, on_false_value,
                  cmp_op=None, name=None):
    """dst = on_true where cmp_op(affine(p, i), 0) else on_false_value, on GpSimd."""
    I = "affine_select"
    _T(dst, "dst", I), _T(on_true_tile, "on_true_tile", I)
    _rules.same_elems(I, dst, on_true_tile)
    f = _op(cmp_op if cmp_op is not None else _ops.BINARY["equal"], I, ("compare",))
    vals = _pattern_values(dst, pattern, offset, channel_multiplier, I)
    _issue(I, "gpsimd", 150 + dst.free_size, [on_true_tile], [dst])
    pred = f.fn(vals.astype(np.float64), 0.0) != 0
    _put(dst, np.where(pred, _f32(on_true_tile), np.float32(on_false_value)))


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=None, reverse_pred=False, name=None):
    """dst = where(predicate, on_true, on_false) on VectorE, optionally max-reducing each
    partition into reduce_res (through the VectorE accumulator registers)."""
    I = "select_reduce"
    _T(dst, "dst", I), _T(predicate, "predicate", I), _T(on_true, "on_true", I)
    _rules.same_elems(I, dst, on_true), _rules.same_elems(I, predicate, on_true)
    if on_true.dtype.name in ("tfloat32", "int32", "uint32"):
        _rules.fail(E.DtypeLegalityError, f"{I}: on_true dtype {on_true.dtype.name} is not supported "
                    f"(any dtype except tfloat32, int32, uint32)")
    if predicate.dtype.name not in ("int8", "uint8", "int16", "uint16"):
        _rules.fail(E.DtypeLegalityError, f"{I}: predicate dtype must be int8/uint8/int16/uint16, "
                    f"got {predicate.dtype.name}")
    if on_true.kind == "psum" and predicate.kind == "psum":
        _rules.fail(E.MemoryLegalityError, f"{I}: on_true and predicate cannot both be in PSUM")
    if reduce_op is not None and getattr(reduce_op, "name", None) not in ("maximum", "max"):
        _rules.fail(E.NkiRuleError, f"{I}: reduce_op supports only nl.maximum")
    if reduce_res is not None:
        if reduce_res.shape[0] != on_true.shape[0] or reduce_res.free_size != 1:
            _rules.fail(E.ShapeMismatchError, f"{I}: reduce_res must be ({on_true.shape[0]}, 1), "
                        f"got {tuple(reduce_res.shape)}")
        if not reduce_res.dtype.is_float:
            _rules.fail(E.DtypeLegalityError, f"{I}: reduce_res must be a float tile, got {reduce_res.dtype.name}")
    off = _operand(on_false, on_true, I, "on_false")
    reads = [predicate, on_true] + ([on_false] if isinstance(on_false, NkiTensor) else [])
    writes = [dst] + ([reduce_res] if reduce_res is not None else [])
    _issue(I, "vector", max(_mi(), on_true.free_size), reads, writes)
    pred = _flat(predicate) != 0
    if reverse_pred:
        pred = ~pred
    y = np.where(pred, _f32(on_true), off)
    _put(dst, y)
    if reduce_res is not None or reduce_cmd != type(reduce_cmd).idle:
        sim = _ctx.current()
        cmd = reduce_cmd if reduce_cmd != type(reduce_cmd).idle else type(reduce_cmd).reset_reduce
        regs = _reduce_regs(sim, "vector_regs", y.shape[0], cmd, y.max(axis=1, keepdims=True), np.maximum)
        if reduce_res is not None:
            _put(reduce_res, regs)


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=None, range_start=0, on_false_value=-3.4028235e38, name=None):
    """Keep elements whose free index + range_start satisfies both bound comparisons; max-reduce."""
    I = "range_select"
    sim = _ctx.current()
    if sim.profile.nki_target == "gen2":
        _rules.fail(E.NkiRuleError, f"{I} is available on NeuronCore-v3 and newer only")
    _T(dst, "dst", I), _T(on_true_tile, "on_true_tile", I)
    _rules.same_elems(I, dst, on_true_tile)
    c0, c1 = _op(comp_op0, I, ("compare",)), _op(comp_op1, I, ("compare",))
    b0, b1 = _operand(bound0, on_true_tile, I, "bound0"), _operand(bound1, on_true_tile, I, "bound1")
    reads = [on_true_tile] + [t for t in (bound0, bound1) if isinstance(t, NkiTensor)]
    _issue(I, "vector", max(_mi(), dst.free_size), reads, [dst] + ([reduce_res] if reduce_res is not None else []))
    idx = np.arange(on_true_tile.free_size, dtype=np.float32)[None, :] + np.float32(range_start)
    keep = (c0.fn(idx, b0) != 0) & (c1.fn(idx, b1) != 0)
    y = np.where(keep, _f32(on_true_tile), np.float32(on_false_value))
    _put(dst, y)
    if reduce_res is not None or reduce_cmd != type(reduce_cmd).idle:
        regs = _reduce_regs(sim, "vector_regs", y.shape[0], reduce_cmd, y.max(axis=1, keepdims=True), np.maximum)
        if reduce_res is not None:
            _put(reduce_res, regs)


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """GpSimd gather within each group of 16 partitions.

    Each core flattens its 16-partition slice of index partition-first and uses the indices
    to pick runs of num_elem_per_idx elements from its 16-partition slice of src_buffer
    (flattened the same way); the gathered runs fill dst's 16 partitions partition-first."""
    I = "local_gather"
    _T(dst, "dst", I), _T(src_buffer, "src_buffer", I), _T(index, "index", I)
    if not index.dtype.is_int:
        _rules.fail(E.DtypeLegalityError, f"{I}: index must be an integer tile, got {index.dtype.name}")
    P = src_buffer.shape[0]
    if P % 16 or index.shape[0] != P or dst.shape[0] != P:
        _rules.fail(E.ShapeMismatchError, f"{I}: src_buffer, index and dst must span the same multiple of 16 partitions")
    _issue(I, "gpsimd", 150 + dst.free_size, [src_buffer, index], [dst])
    k = int(num_elem_per_idx)
    src, idx, out = _flat(src_buffer), _flat(index), _flat(dst).copy()
    for c in range(P // 16):
        s = src[c * 16:(c + 1) * 16].T.reshape(-1, k) if (src.shape[1] % k == 0) else None
        if s is None:
            _rules.fail(E.ShapeMismatchError, f"{I}: elements per partition must be a multiple of num_elem_per_idx")
        ii = idx[c * 16:(c + 1) * 16].T.reshape(-1).astype(np.int64)
        if num_valid_indices is not None:
            ii = ii[:int(num_valid_indices)]
        if ii.size and (ii.min() < 0 or ii.max() >= s.shape[0]):
            _rules.fail(E.IndexOutOfBoundsError, f"{I}: gather index out of range [0, {s.shape[0]})")
        g = s[ii].reshape(-1)
        block = out[c * 16:(c + 1) * 16].T.reshape(-1)
        n = min(g.size, block.size)
        block[:n] = g[:n]
        out[c * 16:(c + 1) * 16] = block.reshape(out.shape[1], 16).T
    _put(dst, out)


def _rng(sim):
    if getattr(sim, "_rng", None) is None:
        sim._rng = np.random.default_rng(0)
    return sim._rng


def dropout(dst, data, prob, name=None):
    """Zero each element with probability prob (scalar or (P, 1) tile) on VectorE."""
    I = "dropout"
    _T(dst, "dst", I), _T(data, "data", I)
    _rules.same_elems(I, dst, data)
    if dst.dtype != data.dtype:
        _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype must equal data dtype")
    pr = _operand(prob, data, I, "prob")
    _issue(I, "vector", max(_mi(), data.free_size), [data] + ([prob] if isinstance(prob, NkiTensor) else []), [dst])
    keep = _rng(_ctx.current()).random(_flat(data).shape, dtype=np.float32) >= pr
    _put(dst, np.where(keep, _flat(data), 0))


def rng(dst, engine=engine.unknown, name=None):
    """Random bits (integer dst) or uniform [0, 1) values (float dst)."""
    I = "rng"
    _T(dst, "dst", I)
    _issue(I, _ENG.get(engine, "vector"), max(_mi(), dst.free_size), [], [dst])
    g = _rng(_ctx.current())
    if dst.dtype.is_float:
        _put(dst, g.random(dst.shape, dtype=np.float32))
    else:
        info = np.iinfo(dst.dtype.storage)
        dst.v[...] = g.integers(info.min, info.max, size=dst.shape, dtype=dst.dtype.storage, endpoint=True)


def set_rng_seed(src, name=None):
    sim = _ctx.current()
    _tensore.drain()
    seed = int(np.asarray(src.v).reshape(-1)[0]) if isinstance(src, NkiTensor) else int(src)
    sim._rng = np.random.default_rng(seed)


# ----------------------------------------------------------------------------- statistics
def bn_stats(dst, data, name=None):
    """(count, mean, var*count) of even and of odd elements per partition (6 values)."""
    I = "bn_stats"
    _T(dst, "dst", I), _T(data, "data", I)
    if data.free_size > 512:
        _rules.fail(E.ShapeMismatchError, f"{I}: at most 512 elements per partition "
                    f"(nl.tile_size.bn_stats_fmax), got {data.free_size}")
    if dst.shape[0] != data.shape[0] or dst.free_size != 6:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst must be ({data.shape[0]}, 6), got {tuple(dst.shape)}")
    _issue(I, "vector", max(_mi(), data.free_size), [data], [dst])
    x = _f32(data)
    out = []
    for half in (x[:, 0::2], x[:, 1::2]):
        n = half.shape[1]
        m = half.mean(axis=1, dtype=np.float32) if n else np.zeros(x.shape[0], np.float32)
        m2 = ((half - m[:, None]) ** 2).sum(axis=1, dtype=np.float32) if n else m * 0
        out += [np.full(x.shape[0], n, np.float32), m, m2]
    _put(dst, np.stack(out, axis=1))


def bn_aggr(dst, data, name=None):
    """Mean and variance per partition from bn_stats (count, mean, var*count) triples."""
    I = "bn_aggr"
    _T(dst, "dst", I), _T(data, "data", I)
    if data.free_size % 3:
        _rules.fail(E.ShapeMismatchError, f"{I}: data must hold (count, mean, var*count) triples")
    if dst.shape[0] != data.shape[0] or dst.free_size != 2:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst must be ({data.shape[0]}, 2), got {tuple(dst.shape)}")
    _issue(I, "vector", max(_mi(), 13 * data.free_size // 3), [data], [dst])
    t = _f32(data).reshape(data.shape[0], -1, 3).astype(np.float64)
    c, m, m2 = t[..., 0], t[..., 1], t[..., 2]
    n = c.sum(axis=1)
    with np.errstate(all="ignore"):
        mean = np.where(n > 0, (c * m).sum(axis=1) / n, 0.0)
        var = np.where(n > 0, (m2 + c * (m - mean[:, None]) ** 2).sum(axis=1) / n, 0.0)
    _put(dst, np.stack([mean, var], axis=1).astype(np.float32))


def max8(dst, src, name=None):
    """The 8 largest values of each partition, descending, on VectorE."""
    I = "max8"
    _T(dst, "dst", I), _T(src, "src", I)
    if not 8 <= src.free_size <= 16384:
        _rules.fail(E.ShapeMismatchError, f"{I}: src must have 8..16384 elements per partition, got {src.free_size}")
    if dst.shape[0] != src.shape[0] or dst.free_size != 8:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst must be ({src.shape[0]}, 8), got {tuple(dst.shape)}")
    _issue(I, "vector", max(_mi(), src.free_size), [src], [dst])
    x = _f32(src)
    top = -np.sort(-np.partition(x, x.shape[1] - 8, axis=1)[:, -8:], axis=1)
    _put(dst, top)


def nc_find_index8(dst, data, vals, name=None):
    """Index (per partition) of the first element of data equal to each of the 8 vals."""
    I = "nc_find_index8"
    _T(dst, "dst", I), _T(data, "data", I), _T(vals, "vals", I)
    if vals.free_size != 8 or dst.free_size != 8:
        _rules.fail(E.ShapeMismatchError, f"{I}: vals and dst must hold 8 elements per partition")
    if not dst.dtype.is_int:
        _rules.fail(E.DtypeLegalityError, f"{I}: dst must be an integer tile (uint32), got {dst.dtype.name}")
    _issue(I, "vector", max(_mi(), data.free_size), [data, vals], [dst])
    x, v = _f32(data), _f32(vals)
    eq = x[:, None, :] == v[:, :, None]
    idx = np.where(eq.any(axis=2), eq.argmax(axis=2), np.iinfo(np.uint32).max)
    _put(dst, idx)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """Copy data with the first occurrence of each of the 8 vals replaced by imm."""
    I = "nc_match_replace8"
    _T(dst, "dst", I), _T(data, "data", I), _T(vals, "vals", I)
    _rules.same_elems(I, dst, data)
    writes = [dst] + ([dst_idx] if dst_idx is not None else [])
    _issue(I, "vector", max(_mi(), data.free_size), [data, vals], writes)
    x, v = _f32(data).copy(), _f32(vals)
    rows = np.arange(x.shape[0])
    idxs = []
    for j in range(v.shape[1]):
        eq = x == v[:, j:j + 1]
        hit = eq.any(axis=1)
        i = eq.argmax(axis=1)
        x[rows[hit], i[hit]] = np.float32(imm)
        idxs.append(np.where(hit, i, np.iinfo(np.uint32).max))
    _put(dst, x)
    if dst_idx is not None:
        _put(dst_idx, np.stack(idxs, axis=1))


# ----------------------------------------------------------------------------- DMA
def dma_copy(dst, src, dst_rmw_op=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None, unique_indices=True):
    """Copy src to dst (HBM or SBUF; DMA cannot reach PSUM); dst_rmw_op=nl.add accumulates."""
    I = "dma_copy"
    _T(dst, "dst", I), _T(src, "src", I)
    if dst.size != src.size:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} and src {tuple(src.shape)} hold "
                    f"different numbers of elements")
    if dst_rmw_op is not None and getattr(dst_rmw_op, "name", None) != "add":
        _rules.fail(E.NkiRuleError, f"{I}: dst_rmw_op supports only nl.add")
    _ctx.current().dma(I, dst, src)
    v = src.v if src.shape == dst.shape else src.v.reshape(dst.shape)
    if dst_rmw_op is not None:
        _put(dst, dst.v.astype(np.float32) + v.astype(np.float32))
    elif dst.dtype == src.dtype:
        dst.v[...] = v
    else:
        _put(dst, v)


def dma_transpose(dst, src, axes=None, dge_mode=dge_mode.unknown, name=None):
    """Transpose while copying (2-D: swap axes; 3-D/4-D: permute by axes) with DMA."""
    I = "dma_transpose"
    _T(dst, "dst", I), _T(src, "src", I)
    ax = tuple(axes) if axes is not None else tuple(reversed(range(src.ndim)))
    want = tuple(src.shape[a] for a in ax)
    if tuple(dst.shape) != want:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must be {want} (src {tuple(src.shape)} permuted by {ax})")
    if src.dtype.itemsize != 2:
        _rules.fail(E.DtypeLegalityError, f"{I}: DMA transpose moves 2-byte dtypes, got {src.dtype.name}")
    # Element-granular descriptors: a DMA transpose runs far below the queue's peak.
    _ctx.current().dma(I, dst, src, efficiency=0.25)
    _put(dst, np.transpose(src.v, ax)) if dst.dtype != src.dtype else dst.v.__setitem__(..., np.transpose(src.v, ax))


# ----------------------------------------------------------------------------- registers
class VirtualRegister:
    """A scalar register (loop bounds and conditions of fori_loop / while_loop)."""

    __slots__ = ("value",)

    def __init__(self, value=0):
        self.value = int(value)

    def __index__(self):
        return self.value

    __int__ = __index__

    def __repr__(self):
        return f"VirtualRegister({self.value})"


def register_alloc(x=0):
    return VirtualRegister(x.value if isinstance(x, VirtualRegister) else x)


def register_load(dst, src):
    _tensore.drain()
    dst.value = int(np.asarray(src.v).reshape(-1)[0])


def register_store(dst, src):
    dst.v[...] = dst.dtype.round(np.float64(src.value))


def register_move(dst, src):
    dst.value = src.value if isinstance(src, VirtualRegister) else int(src)


_MISSING = {"nc_matmul_mx", "quantize_mx", "sequence_bounds", "nc_n_gather",
            "dma_compute", "nc_stream_shuffle", "core_barrier", "sendrecv", "rand2",
            "rand_set_state", "rand_get_state", "nonzero_with_count", "tensor_scalar_cumulative",
            "activate2", "tensor_copy_dynamic_src", "tensor_copy_dynamic_dst"}


def __getattr__(name):
    if name in _MISSING:
        raise E.UnsupportedError(f"nki.isa.{name} is not implemented in this NKI simulator")
    raise AttributeError(f"module 'nki.isa' has no attribute {name!r}")
