"""OCP microscaling (MX) formats, shared by TensorE's nc_matmul_mx and VectorE's quantize_mx.

A scaling group is 32 values: 8 partitions x the 4 values one x4 word packs. Its E8M0 scale
(a power of two, 2**(code - 127); code 255 is NaN) lives in the SBUF quadrant of its group:
each quadrant of 32 data partitions has 4 groups, whose scales fill 4 consecutive partitions
of the same quadrant, starting 0, 4, 8 or 12 partitions into it (so that up to four tensors'
scales can share one tile). The scale tile has one element per x4 word column.
"""
from __future__ import annotations

import numpy as np

from .. import errors as E
from ..simulator import rules as _rules
from ..simulator.tensor import NkiTensor

GROUP_P = 8                       # partitions per scaling group
DATA = ("float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4")
SCALES = ("float8_e8m0fnu", "uint8")


def require_gen4(instr, sim):
    if sim.profile.nki_target != "gen4":
        _rules.fail(E.NkiRuleError, f"{instr} is available on NeuronCore-v4 (trn3) only; the "
                    f"target is {sim.target} ({sim.profile.nki_target})")


def _lut(elem):
    """float32 value of every bit pattern of an fp8/fp4 element type."""
    n = 16 if elem.name.startswith("float4") else 256
    return np.arange(n, dtype=np.uint8).view(elem.real).astype(np.float32)


_LUTS: dict = {}
_SHIFT = {4: np.array([0, 8, 16, 24], np.uint32), 2: np.array([0, 4, 8, 12], np.uint16)}


def unpack(t: NkiTensor) -> np.ndarray:
    """(P, F, 4) float32 values of an x4 tile (shifts, not byte views: endian-independent)."""
    d = t.dtype
    lut = _LUTS.get(d.name)
    if lut is None:
        lut = _LUTS[d.name] = _lut(d.packed)
    words = t.v.reshape(t.shape[0], -1)
    mask = 0xFF if d.itemsize == 4 else 0xF
    codes = (words[..., None] >> _SHIFT[d.itemsize]) & mask
    return lut[codes]


def pack(values: np.ndarray, dtype) -> np.ndarray:
    """x4 words from (P, F, 4) values, each rounded (RNE) to the element type."""
    bits = values.astype(dtype.packed.real).view(np.uint8).astype(dtype.storage)
    if dtype.itemsize == 2:
        bits &= 0xF
    return np.bitwise_or.reduce(bits << _SHIFT[dtype.itemsize], axis=-1)


def scale_rows(P: int) -> np.ndarray:
    """Partition (relative to the scale view) holding each scaling group's scale."""
    g = np.arange(P // GROUP_P)
    return (g // 4) * 32 + g % 4


def check_scale(instr, scale: NkiTensor, data: NkiTensor, what: str, source: NkiTensor = None):
    """Dtype, buffer, placement and size of the scales of x4 tile ``data`` (whose groups come
    from ``source``'s partitions: data itself, or quantize_mx's src)."""
    source = data if source is None else source
    if scale.dtype.name not in SCALES:
        _rules.fail(E.DtypeLegalityError, f"{instr}: {what} dtype must be float8_e8m0fnu or uint8, "
                    f"got {scale.dtype.name}")
    if scale.kind != "sbuf":
        _rules.fail(E.MemoryLegalityError, f"{instr}: {what} must be in SBUF, {scale.name!r} is in "
                    f"{scale.kind.upper()}")
    off = scale.pstart % 32
    if off not in (0, 4, 8, 12):
        _rules.fail(E.PartitionAlignmentError, f"{instr}: {what} starts at partition {scale.pstart}; "
                    f"MX scales start 0, 4, 8 or 12 partitions into a quadrant")
    if scale.pstart // 32 != source.pstart // 32:
        _rules.fail(E.PartitionAlignmentError, f"{instr}: {what} (partition {scale.pstart}) must sit in "
                    f"the SBUF quadrant of its data (partition {source.pstart})")
    need = int(scale_rows(data.shape[0])[-1]) + 1
    if scale.shape[0] < need:
        _rules.fail(E.ShapeMismatchError, f"{instr}: {what} {tuple(scale.shape)} needs at least {need} "
                    f"partitions for {data.shape[0]}-partition data (4 scale partitions per quadrant)")
    if scale.free_size != data.free_size:
        _rules.fail(E.ShapeMismatchError, f"{instr}: {what} {tuple(scale.shape)} must have one scale per "
                    f"x4 element per partition group: {data.free_size} elements per partition, got "
                    f"{scale.free_size}")


def scale_span(scale: NkiTensor, P: int) -> NkiTensor:
    """The partitions the scales occupy, from their quadrant's start: what the engine reads
    or writes, for access and dependency tracking (the view may start 4, 8 or 12 in)."""
    q0 = scale.pstart - scale.pstart % 32
    q1 = scale.pstart + int(scale_rows(P)[-1]) + 1
    return NkiTensor(scale.buf, scale.buf.data[q0:q1])


def read_scales(scale: NkiTensor, P: int) -> np.ndarray:
    """(groups, F) float32 multipliers 2**(code - 127); code 255 (E8M0 NaN) is NaN."""
    raw = scale.v[scale_rows(P)].reshape(P // GROUP_P, -1)
    if scale.dtype.name == "float8_e8m0fnu":
        return raw.astype(np.float32, copy=False)
    code = raw.astype(np.int32)
    return np.where(code == 255, np.float32(np.nan), np.ldexp(np.float32(1), code - 127)).astype(np.float32)


def write_scales(scale: NkiTensor, P: int, exps: np.ndarray, nan: np.ndarray):
    """Store 2**exps (NaN where nan) as E8M0 values or uint8 codes."""
    rows = scale_rows(P)
    if scale.dtype.name == "uint8":
        vals = np.where(nan, 255, exps + 127).astype(np.uint8)
    else:
        vals = scale.dtype.round(np.where(nan, np.float32(np.nan), np.ldexp(np.float32(1), exps)))
    scale.v[rows] = vals.reshape((len(rows),) + tuple(scale.shape[1:]))


def dequantize(data: NkiTensor, scale: NkiTensor) -> np.ndarray:
    """(4*P, F) float32: every value times its group's scale, the 4 packed values of a word
    as 4 contraction rows."""
    P = data.shape[0]
    vals = unpack(data) * np.repeat(read_scales(scale, P), GROUP_P, axis=0)[:, :, None]
    return vals.transpose(0, 2, 1).reshape(4 * P, -1)
