"""The math operators NKI instructions accept (``op=nl.add``, ``op=nl.exp``, ...).

Each operator is also a callable ``nki.language`` function (``nl.add(x, y)``,
``nl.exp(x)``); ``nki.language`` installs those calls. Arithmetic runs in float32 on the
stored values, as the engines do.
"""
from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float32])


def _erf_np(x):
    # Abramowitz-Stegun 7.1.26 is too coarse; use the exact scalar erf on float64.
    return _erf(x.astype(np.float64)).astype(np.float32)


def _gelu(x):
    return (0.5 * x * (1.0 + _erf_np(x / np.float32(math.sqrt(2.0))))).astype(np.float32)


def _gelu_tanh(x):
    c = np.float32(math.sqrt(2.0 / math.pi))
    return (0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))).astype(np.float32)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def _softplus(x):
    return np.logaddexp(np.float32(0), x).astype(np.float32)


class Op:
    """An NKI operator. ``kind``: arith, bitvec, compare, logical (binary); act (unary)."""

    __slots__ = ("name", "kind", "fn", "reduce", "_call")

    def __init__(self, name, kind, fn, reduce=None):
        self.name, self.kind, self.fn, self.reduce = name, kind, fn, reduce
        self._call = None

    def __call__(self, *args, **kwargs):
        return self._call(self, *args, **kwargs)

    def __repr__(self):
        return f"nki.language.{self.name}"


def _cmp(f):
    return lambda a, b: f(a, b).astype(np.float32)


def _int(f):
    return lambda a, b: f(a.astype(np.int64), b.astype(np.int64))


BINARY = {
    "add": Op("add", "arith", np.add, np.add.reduce),
    "subtract": Op("subtract", "arith", np.subtract, np.subtract.reduce),
    "multiply": Op("multiply", "arith", np.multiply, np.multiply.reduce),
    "divide": Op("divide", "arith", np.divide),
    "maximum": Op("maximum", "arith", np.maximum, np.max),
    "minimum": Op("minimum", "arith", np.minimum, np.min),
    "power": Op("power", "arith", np.power),
    "mod": Op("mod", "arith", np.mod),
    "fmod": Op("fmod", "arith", np.fmod),
    "equal": Op("equal", "compare", _cmp(np.equal)),
    "not_equal": Op("not_equal", "compare", _cmp(np.not_equal)),
    "greater": Op("greater", "compare", _cmp(np.greater)),
    "greater_equal": Op("greater_equal", "compare", _cmp(np.greater_equal)),
    "less": Op("less", "compare", _cmp(np.less)),
    "less_equal": Op("less_equal", "compare", _cmp(np.less_equal)),
    "logical_and": Op("logical_and", "logical", _cmp(np.logical_and)),
    "logical_or": Op("logical_or", "logical", _cmp(np.logical_or)),
    "logical_xor": Op("logical_xor", "logical", _cmp(np.logical_xor)),
    "bitwise_and": Op("bitwise_and", "bitvec", np.bitwise_and, np.bitwise_and.reduce),
    "bitwise_or": Op("bitwise_or", "bitvec", np.bitwise_or, np.bitwise_or.reduce),
    "bitwise_xor": Op("bitwise_xor", "bitvec", np.bitwise_xor, np.bitwise_xor.reduce),
    "left_shift": Op("left_shift", "bitvec", np.left_shift),
    "right_shift": Op("right_shift", "bitvec", np.right_shift),
}
# Reductions reuse the binary operators' identities (nl.max reduces with maximum).
BINARY["max"] = Op("max", "arith", np.maximum, np.max)
BINARY["min"] = Op("min", "arith", np.minimum, np.min)

_f32 = np.float32
UNARY = {
    "copy": Op("copy", "act", lambda x: x),
    "identity": Op("identity", "act", lambda x: x),
    "bypass": Op("bypass", "act", lambda x: x),
    "exp": Op("exp", "act", np.exp),
    "log": Op("log", "act", np.log),
    "tanh": Op("tanh", "act", np.tanh),
    "sigmoid": Op("sigmoid", "act", _sigmoid),
    "relu": Op("relu", "act", lambda x: np.maximum(x, _f32(0))),
    "gelu": Op("gelu", "act", _gelu),
    "gelu_apprx_tanh": Op("gelu_apprx_tanh", "act", _gelu_tanh),
    "gelu_apprx_sigmoid": Op("gelu_apprx_sigmoid", "act", lambda x: x * _sigmoid(_f32(1.702) * x)),
    "silu": Op("silu", "act", lambda x: x * _sigmoid(x)),
    "softplus": Op("softplus", "act", _softplus),
    "mish": Op("mish", "act", lambda x: x * np.tanh(_softplus(x))),
    "sqrt": Op("sqrt", "act", np.sqrt),
    "rsqrt": Op("rsqrt", "act", lambda x: _f32(1) / np.sqrt(x)),
    "reciprocal": Op("reciprocal", "act", lambda x: _f32(1) / x),
    "square": Op("square", "act", np.square),
    "abs": Op("abs", "act", np.abs),
    "negative": Op("negative", "act", np.negative),
    "sign": Op("sign", "act", np.sign),
    "sin": Op("sin", "act", np.sin),
    "cos": Op("cos", "act", np.cos),
    "tan": Op("tan", "act", np.tan),
    "arctan": Op("arctan", "act", np.arctan),
    "erf": Op("erf", "act", _erf_np),
    "erf_dx": Op("erf_dx", "act", lambda x: _f32(2 / math.sqrt(math.pi)) * np.exp(-x * x)),
    "ceil": Op("ceil", "act", np.ceil),
    "floor": Op("floor", "act", np.floor),
    "trunc": Op("trunc", "act", np.trunc),
    "logical_not": Op("logical_not", "act", lambda x: (x == 0).astype(np.float32)),
    "invert": Op("invert", "bitvec1", np.invert),
}
# Parametric ReLU: its negative slope is the instruction's relu_param (activate2), so it is an
# operator of the activation instructions, not a function of one tile.
PRELU = Op("prelu", "act", lambda x, alpha: np.where(x >= 0, x, np.float32(alpha) * x))
ALL = {**BINARY, **UNARY, "prelu": PRELU}
# AWS's table of arithmetic operators for the engines' ALUs (tensor_scalar, tensor_tensor,
# reductions, ...) also lists these unary functions: in an operator slot they act on the
# data and ignore the operand (AWS's rmsnorm_quant takes |x| as op0=nl.abs, operand0=0.0);
# bypass passes the data through (activate2's unused stage).
ALU_UNARY = {n: Op(n, "arith", (lambda f: lambda a, b: f(a))(UNARY[n].fn))
             for n in ("abs", "reciprocal", "rsqrt", "logical_not", "bypass")}


def apply_binary(op: Op, a, b):
    with np.errstate(all="ignore"):
        if op.kind == "bitvec":
            return op.fn(np.asarray(a), np.asarray(b))
        return op.fn(np.asarray(a, np.float32), np.asarray(b, np.float32)).astype(np.float32, copy=False)


def apply_unary(op: Op, x):
    with np.errstate(all="ignore"):
        if op.kind == "bitvec1":
            return op.fn(x)
        return np.asarray(op.fn(np.asarray(x, np.float32)), np.float32)
