"""NKI data types and the rounding each one applies.

Float tiles are stored as float32 arrays whose values are already rounded to the tile's
dtype, so every engine computes in float32 (as the hardware does) and numpy stays fast.
Integer and bool tiles are stored in their own numpy dtype.
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

_LITTLE = sys.byteorder == "little"


# While a kernel runs on an accelerator whose runtime rounds stochastically
# (NEURON_RT_STOCHASTIC_ROUNDING_EN on the torch side), the runner sets this to the bridge's
# rounder: ``(dtype name, float32 array) -> float32 array`` of bf16/fp16 values. Every engine
# write that narrows to bf16/fp16 then rounds through it, as the hardware's output stage does.
stochastic_rounder = None
_STOCHASTIC = ("bfloat16", "float16")


class DType:
    """One NKI dtype: a name, a size, how values are stored and how they round."""

    __slots__ = ("name", "itemsize", "storage", "real", "is_float", "is_int", "_round", "packed")

    def __init__(self, name, itemsize, storage, real, is_float, rounder=None, packed=None):
        self.name, self.itemsize = name, itemsize
        self.storage, self.real = np.dtype(storage), real
        self.is_float, self.is_int = is_float, not is_float and name != "bool" and packed is None
        self._round = rounder
        # x4 types: the element dtype four of which one word holds. Their tiles store the raw
        # bits (uint32/uint16), so integer data moves in and out bit for bit.
        self.packed = packed

    def round(self, values: np.ndarray) -> np.ndarray:
        """Values (any numeric array) as this dtype stores them."""
        if self.is_float:
            v = np.asarray(values, dtype=np.float32)
            if stochastic_rounder is not None and self.name in _STOCHASTIC:
                return stochastic_rounder(self.name, v)
            return self._round(v) if self._round is not None else v
        if self.name == "bool":
            return np.asarray(values).astype(np.bool_)
        v = np.asarray(values)
        if v.dtype.kind == "f":
            # Engines convert float results to integers with round-to-nearest-even and
            # saturate at the type's range; NaN becomes 0.
            info = np.iinfo(self.storage)
            v = np.nan_to_num(np.rint(v), nan=0.0, posinf=info.max, neginf=info.min)
            v = np.clip(v, info.min, info.max)
        return v.astype(self.storage, copy=False)

    def to_real(self, stored: np.ndarray) -> np.ndarray:
        """Stored values as a numpy array of the real dtype (bf16 via ml_dtypes, ...)."""
        stored = np.asarray(stored)
        if self.name == "bfloat16" and stored.dtype == np.float32 and stored.flags.c_contiguous:
            # The stored values are bf16-exact, so the upper half of each word is the bf16.
            if _LITTLE:   # the upper halves, in one strided copy
                hi = stored.reshape(-1).view(np.uint16)[1::2]
                return np.ascontiguousarray(hi).reshape(stored.shape).view(ml_dtypes.bfloat16)
            return (stored.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(ml_dtypes.bfloat16)
        return stored.astype(self.real)

    def from_real(self, a: np.ndarray) -> np.ndarray:
        """An array of this dtype (or any numeric array) as the simulator stores it."""
        if self.name == "bfloat16" and a.dtype == ml_dtypes.bfloat16 and a.flags.c_contiguous:
            # bf16 is the upper half of an fp32 word: exact, and far faster than astype.
            return np.left_shift(a.view(np.uint16), np.uint32(16), dtype=np.uint32).view(np.float32)
        if a.dtype == self.real and self.is_float:
            return a.astype(np.float32)      # already representable: no rounding pass
        return self.round(a.astype(np.float32))

    def __eq__(self, other):
        if isinstance(other, DType):
            return self.name == other.name
        try:
            return as_dtype(other).name == self.name
        except (TypeError, ValueError):
            return False

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f"nki.language.{self.name}"

    def __str__(self):
        # the bare name, as numpy's dtypes print: AWS's kernels compare str(dtype) with
        # "bfloat16", "float32", ... (nkilib's resolve_dtype_to_nki, attention_cte)
        return self.name


def _ml_round(t):
    def r(v):
        return v.astype(t).astype(np.float32)
    return r


def _tf32_round(v):
    u = v.view(np.uint32)
    out = ((u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000))
    out = out.view(np.float32)
    return np.where(np.isfinite(v), out, v)


_F = np.float32
float32 = DType("float32", 4, _F, np.float32, True)
tfloat32 = DType("tfloat32", 4, _F, np.float32, True, _tf32_round)
bfloat16 = DType("bfloat16", 2, _F, ml_dtypes.bfloat16, True, _ml_round(ml_dtypes.bfloat16))
float16 = DType("float16", 2, _F, np.float16, True, _ml_round(np.float16))
float8_e4m3 = DType("float8_e4m3", 1, _F, ml_dtypes.float8_e4m3, True, _ml_round(ml_dtypes.float8_e4m3))
float8_e4m3fn = DType("float8_e4m3fn", 1, _F, ml_dtypes.float8_e4m3fn, True,
                      _ml_round(ml_dtypes.float8_e4m3fn))
float8_e5m2 = DType("float8_e5m2", 1, _F, ml_dtypes.float8_e5m2, True, _ml_round(ml_dtypes.float8_e5m2))
float4_e2m1fn = DType("float4_e2m1fn", 1, _F, ml_dtypes.float4_e2m1fn, True,
                      _ml_round(ml_dtypes.float4_e2m1fn))
float8_e8m0fnu = DType("float8_e8m0fnu", 1, _F, ml_dtypes.float8_e8m0fnu, True,
                       _ml_round(ml_dtypes.float8_e8m0fnu))
# MX data (nki.isa.nc_matmul_mx, quantize_mx): four fp8 values in 32 bits or four fp4 values
# in 16 bits, element k of a word in byte k (fp8) or nibble k (fp4), little-endian.
float8_e5m2_x4 = DType("float8_e5m2_x4", 4, np.uint32, np.uint32, False, packed=float8_e5m2)
float8_e4m3fn_x4 = DType("float8_e4m3fn_x4", 4, np.uint32, np.uint32, False, packed=float8_e4m3fn)
float4_e2m1fn_x4 = DType("float4_e2m1fn_x4", 2, np.uint16, np.uint16, False, packed=float4_e2m1fn)
int8 = DType("int8", 1, np.int8, np.int8, False)
int16 = DType("int16", 2, np.int16, np.int16, False)
int32 = DType("int32", 4, np.int32, np.int32, False)
int64 = DType("int64", 8, np.int64, np.int64, False)
uint8 = DType("uint8", 1, np.uint8, np.uint8, False)
uint16 = DType("uint16", 2, np.uint16, np.uint16, False)
uint32 = DType("uint32", 4, np.uint32, np.uint32, False)
uint64 = DType("uint64", 8, np.uint64, np.uint64, False)
bool_ = DType("bool", 1, np.bool_, np.bool_, False)

ALL = [float32, tfloat32, bfloat16, float16, float8_e4m3, float8_e4m3fn, float8_e5m2,
       float4_e2m1fn, float8_e8m0fnu, float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4,
       int8, int16, int32, int64, uint8, uint16, uint32, uint64, bool_]
_BY_NAME = {d.name: d for d in ALL}
_BY_NAME.update({"bool_": bool_, "float64": float32, "fp32": float32, "bf16": bfloat16,
                 "float8_e4m3fn": float8_e4m3fn, "float8e4": float8_e4m3, "float8e5": float8_e5m2})


def as_dtype(x) -> DType:
    """An NKI dtype from an NKI dtype, a numpy dtype/type, an ml_dtypes type, a torch dtype
    or a name. float64 maps to float32: NKI has no 64-bit float."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        key = x.replace("torch.", "")
    elif type(x).__module__ == "torch":           # torch.dtype without importing torch
        key = str(x).replace("torch.", "")
        key = {"float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}.get(key, key)
    else:
        try:
            key = np.dtype(x).name
        except TypeError:
            raise TypeError(f"not an NKI dtype: {x!r}") from None
    if key not in _BY_NAME:
        raise TypeError(f"unsupported NKI dtype {x!r} (NKI supports {', '.join(d.name for d in ALL)})")
    return _BY_NAME[key]
