"""VectorE statistics instructions: batch-norm statistics, top-8 values and their indices."""
from __future__ import annotations

import numpy as np

from .. import errors as E
from ..simulator import rules as _rules
from ._common import _T, _f32, _issue, _mi, _put


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
