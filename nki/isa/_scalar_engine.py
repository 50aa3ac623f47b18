"""ScalarE (activation engine) instructions: activation and trn3's Activation2."""
from __future__ import annotations

import numpy as np

from .. import _ops
from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules
from ..simulator.tensor import NkiTensor
from ._common import _ENG, _T, _f32, _issue, _mi, _op, _operand, _put, _reduce_regs
from .constants import engine, reduce_cmd


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, engine=engine.scalar, name=None):
    """dst = op(data * scale + bias) on ScalarE, optionally summing each partition."""
    I = "activation"
    _T(dst, "dst", I), _T(data, "data", I)
    _rules.same_elems(I, dst, data)
    f = _op(op, I, ("act", "arith"))
    if f.name == "prelu":
        _rules.fail(E.NkiRuleError, f"{I}: nl.prelu takes its slope from relu_param, which "
                    f"activation has not: use nisa.activate2 (NeuronCore-v4)")
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


# (op0, op1) pairs Activation2's tensor-scalar stage supports; None counts as bypass.
_A2_PAIRS = {("multiply", "add"), ("multiply", "subtract"), ("multiply", "bypass"), ("add", "bypass"),
             ("subtract", "bypass"), ("bypass", "bypass")}


def _abs_pick(larger):
    def pick(a, b):
        return np.where(np.abs(a) > np.abs(b) if larger else np.abs(a) < np.abs(b), a, b)
    return pick


def _abs_reduce(larger):
    def red(y, axis, keepdims):
        i = (np.abs(y).argmax if larger else np.abs(y).argmin)(axis=axis)
        return np.take_along_axis(y, np.expand_dims(i, axis), axis=axis)
    return red


# reduce_op of activate2: (combine two values, reduce the free axis, register reset value).
_A2_REDUCE = {
    "add": (np.add, lambda y, axis, keepdims: y.sum(axis=axis, keepdims=True, dtype=np.float32), 0.0),
    "maximum": (np.maximum, np.max, -np.inf), "max": (np.maximum, np.max, -np.inf),
    "minimum": (np.minimum, np.min, np.inf), "min": (np.minimum, np.min, np.inf),
    "abs_max": (_abs_pick(True), _abs_reduce(True), 0.0),
    "abs_min": (_abs_pick(False), _abs_reduce(False), np.inf),
}


def _name(op):
    return "bypass" if op is None else getattr(op, "name", getattr(op, "__name__", str(op)))


def activate2(dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False,
              reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None):
    """dst = op((data op0 imm0) op1 imm1) on ScalarE (trn3 only), with an optional free-axis
    reduction (add/max/min/abs_max/abs_min) through the ScalarE registers activation uses."""
    I = "activate2"
    sim = _ctx.current()
    if sim.profile.nki_target != "gen4":
        _rules.fail(E.NkiRuleError, f"{I} is available on NeuronCore-v4 (trn3) only; the target is "
                    f"{sim.target} ({sim.profile.nki_target})")
    _T(dst, "dst", I), _T(data, "data", I)
    _rules.same_elems(I, dst, data)
    f = _op(op, I, ("act", "arith"))
    n0, n1 = _name(op0), _name(op1)
    if (n0, n1) not in _A2_PAIRS:
        _rules.fail(E.NkiRuleError, f"{I}: (op0, op1) = ({n0}, {n1}) is not supported; use (multiply, add), "
                    f"(multiply, subtract), (multiply, bypass), (add, bypass), (subtract, bypass) or "
                    f"(bypass, bypass)")
    if (reverse0 and n0 == "bypass") or (reverse1 and n1 == "bypass"):
        _rules.fail(E.NkiRuleError, f"{I}: reverse0/reverse1 need op0/op1 to be set (not bypass)")
    if all(isinstance(t, NkiTensor) for t in (imm0, imm1)) and imm0.dtype != imm1.dtype:
        _rules.fail(E.DtypeLegalityError, f"{I}: tensor imm0 ({imm0.dtype.name}) and imm1 ({imm1.dtype.name}) "
                    f"must share a dtype")
    i0, i1 = _operand(imm0, data, I, "imm0"), _operand(imm1, data, I, "imm1")
    alpha = _operand(relu_param, data, I, "relu_param")     # only prelu reads it
    cmd = type(reduce_cmd)
    reducing = reduce_cmd in (cmd.reduce, cmd.reset_reduce)
    rn = _name(reduce_op) if reduce_op is not None else None
    if (reducing or reduce_cmd == cmd.reset) and rn not in _A2_REDUCE:
        _rules.fail(E.NkiRuleError, f"{I}: reduce_op must be add, maximum, minimum, abs_max or abs_min "
                    f"to reduce, got {reduce_op!r}")
    if reduce_res is not None and (reduce_res.shape[0] != data.shape[0] or reduce_res.free_size != 1):
        _rules.fail(E.ShapeMismatchError, f"{I}: reduce_res must be ({data.shape[0]}, 1), got "
                    f"{tuple(reduce_res.shape)}")
    reads = [data] + [t for t in (imm0, imm1, relu_param) if isinstance(t, NkiTensor)]
    writes = [dst] + ([reduce_res] if reduce_res is not None else [])
    # As activation: one element per partition per cycle, plus the register read-out.
    _issue(I, "scalar", max(_mi(), data.free_size) + (_mi() if reduce_res is not None else 0), reads, writes)
    with np.errstate(all="ignore"):
        x = _f32(data)
        if n0 != "bypass":
            x = _ops.apply_binary(_op(op0, I), *((i0, x) if reverse0 else (x, i0)))
        if n1 != "bypass":
            x = _ops.apply_binary(_op(op1, I), *((i1, x) if reverse1 else (x, i1)))
        if f.name == "prelu":
            y = f.fn(x, alpha).astype(np.float32)
        else:
            y = _ops.apply_unary(f, x) if f.kind == "act" else _ops.apply_binary(f, x, np.float32(0))
        regs = _a2_registers(sim, rn, reduce_cmd, y)
    if reduce_res is not None:
        _put(reduce_res, regs if regs is not None else np.zeros((data.shape[0], 1), np.float32))
    _put(dst, y)


def _a2_registers(sim, rn, reduce_cmd, y):
    """The ScalarE reduce registers after reduce_cmd: reset loads reduce_op's identity."""
    cmd, P = type(reduce_cmd), y.shape[0]
    regs = sim.scalar_regs
    if rn is not None and (regs is None or regs.shape[0] != P or reduce_cmd in (cmd.reset, cmd.reset_reduce)):
        regs = np.full((P, 1), _A2_REDUCE[rn][2], np.float32)
    if reduce_cmd in (cmd.reduce, cmd.reset_reduce):
        combine, reduce, _ = _A2_REDUCE[rn]
        regs = combine(regs, reduce(y, axis=1, keepdims=True)).astype(np.float32)
    sim.scalar_regs = regs
    return regs
