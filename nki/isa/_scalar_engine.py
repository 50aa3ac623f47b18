"""ScalarE (activation engine) instructions."""
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
