"""The expert MLP's gate/up epilogue, shared by the MoE kernels: act(gate) * up from PSUM,
with optional per-I biases and clamps."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ..utils.common_types import ActFnType

_ACT = {ActFnType.SiLU: nl.silu, ActFnType.GELU: nl.gelu,
        ActFnType.GELU_Tanh_Approx: nl.gelu_apprx_tanh, ActFnType.Swish: nl.gelu_apprx_sigmoid}


def act_fn(activation_function):
    """ScalarE's function for an ``ActFnType`` (or a member of any enum with its names), or
    None."""
    return _ACT.get(activation_function) or next(
        (f for k, f in _ACT.items() if k.name == getattr(activation_function, "name", None)), None)


def combine(c, gp, up, dst, bias):
    """act(gate) on ScalarE straight from PSUM, times up on VectorE; clamps on VectorE."""
    rows, cols = gp.shape
    src, b = gp, None if bias is None else bias[:, 0:1]
    lo, hi = c.gclamp
    if lo is not None or hi is not None:
        src = clamp(gp, b, lo, hi)
        b = None
    a = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=a, op=c.act, data=src, bias=b)
    u, ub = up, None if bias is None else bias[:, 1:2]
    lo, hi = c.uclamp
    if lo is not None or hi is not None:
        u, ub = clamp(up, ub, lo, hi), None
    if ub is not None:
        nisa.scalar_tensor_tensor(dst=dst, data=u, op0=nl.add, operand0=ub, op1=nl.multiply,
                                  operand1=a)
    else:
        nisa.tensor_tensor(dst=dst, data1=u, data2=a, op=nl.multiply)


def clamp(src, bias, lo, hi):
    rows, cols = src.shape
    t = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
    if bias is not None:
        nisa.tensor_scalar(dst=t, data=src, op0=nl.add, operand0=bias)
        src = t
    ops = [(nl.maximum, float(lo))] if lo is not None else []
    ops += [(nl.minimum, float(hi))] if hi is not None else []
    if len(ops) == 2:
        nisa.tensor_scalar(dst=t, data=src, op0=ops[0][0], operand0=ops[0][1], op1=ops[1][0],
                           operand1=ops[1][1])
    else:
        nisa.tensor_scalar(dst=t, data=src, op0=ops[0][0], operand0=ops[0][1])
    return t
