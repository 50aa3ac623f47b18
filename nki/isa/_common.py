"""Helpers every instruction uses: operand checks, tile views, rounding into the
destination, and issuing to an engine (which also ends PSUM accumulation groups)."""
from __future__ import annotations

import numpy as np

from .. import _ops
from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules
from ..simulator.tensor import NkiTensor
from .constants import engine, reduce_cmd

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
    if op.kind == "act" and (kinds is None or ("arith" in kinds and "act" not in kinds)):
        if op.name not in _ops.ALU_UNARY:
            _rules.fail(E.NkiRuleError, f"{instr}: {op.name} is an activation function, not an "
                                        f"ALU operator (nisa.activation applies it)")
        op = _ops.ALU_UNARY[op.name]
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


def _axes(axis, ndim, I):
    ax = tuple(int(a) for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
    ax = tuple(a + ndim if a < 0 else a for a in ax)
    if 0 in ax:
        _rules.fail(E.NkiRuleError, f"{I}: the partition axis (0) cannot be reduced here")
    if sorted(ax) != list(range(ndim - len(ax), ndim)):
        _rules.fail(E.NkiRuleError, f"{I}: reduction axes {ax} must be the last contiguous free axes "
                    f"of a rank-{ndim} tile")
    return ax
