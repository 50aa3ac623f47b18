"""Cumulative sum along the last axis: AWS's ``cumsum``.

``x`` is an HBM tensor [B, H] or [B, S, H] (any rank >= 1 works: all leading axes are rows);
the result has its shape and dtype, ``out[..., i] = sum(x[..., :i+1])``, accumulated in fp32.
Only the last axis is supported (AWS's rule); float dtypes only.

VectorE's ``tensor_tensor_scan`` runs the sums along each partition: r[i] = m[i] * r[i-1] +
x[i], with the multiplier m one except at the start of a row. Rows keep their HBM order in a
tile, so loads and stores are contiguous. A row is cut into ``nseg`` segments on consecutive
partitions when that fills more lanes (few rows) or keeps a partition's share small (long
rows); each segment then needs the sum of the segments before it, which one TensorE matmul
against a block-diagonal strictly-lower-triangular 0/1 matrix gives for all partitions at
once, and ScalarE adds while converting to the output dtype. Short rows go ``k`` to a
partition (the zeros of m restart the sum at each), so a DMA moves a few KiB per partition.
Row tiles are software-pipelined, so the scan of one tile overlaps the DMAs of others.
"""
from __future__ import annotations

import numpy as np

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..utils.pipeline import pipeline as _pipeline

_P = 128
_LMAX = 2048        # elements per partition of a row tile (an fp32 scan copy rides along)
_TILE_COST = 256    # a tile's fixed cost (instruction and DMA overheads) in scan steps
_PACK_BYTES = 2048  # rows shorter than this go several to a partition, up to ~4 KiB
# ticks from a tile's load to its scan and from its scan to its store (see utils.pipeline)
_AHEAD, _BEHIND = 3, 2


@nki.jit
def cumsum(x, axis=-1):
    rank = len(x.shape)
    ax = axis + rank if axis < 0 else axis
    if rank < 1 or ax != rank - 1:
        raise E.UnsupportedError(f"cumsum: only the last axis is supported, got axis={axis} for "
                                 f"shape {tuple(x.shape)}")
    if not x.dtype.is_float:
        raise E.UnsupportedError(f"cumsum: dtype {x.dtype.name} is not a float dtype")
    H = x.shape[-1]
    R = int(np.prod(x.shape[:-1]))
    out = nl.ndarray(tuple(x.shape), dtype=x.dtype, buffer=nl.shared_hbm)
    if R == 0 or H == 0:
        return out
    nseg, L = _layout(R, H)
    k = 1
    if nseg == 1 and R > _P and H * x.dtype.itemsize < _PACK_BYTES:
        k = max(1, min(2 * _PACK_BYTES // (H * x.dtype.itemsize), R // _P, _LMAX // H))
    rt = _P // nseg * k
    tiles = [(t0, min(rt, R - t0)) for t0 in range(0, R, rt)]
    n = _parts(min(R, rt), nseg, k)
    mult = nl.ndarray((n, k * L), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=mult, value=1.0, engine=nisa.gpsimd_engine)
    if k > 1:
        nisa.memset(dst=mult.reshape((n, k, L))[:, :, 0:1], value=0.0, engine=nisa.gpsimd_engine)
    low = None
    if nseg > 1:
        i = np.arange(n)
        mask = (i[:, None] // nseg == i[None, :] // nseg) & (i[:, None] < i[None, :])
        low = nl.ndarray((n, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=low, src=nl.shared_constant(mask.astype(np.float32)))
    c = _Cfg(x2d=x.reshape((R, H)), o2d=out.reshape((R, H)), nseg=nseg, k=k, L=L, mult=mult,
             low=low, pieces=max(1, min(4, -(-8 // len(tiles)))))
    _pipeline([_unit(c, t0, r) for t0, r in tiles])
    return out


def _layout(R, H):
    """(nseg, L): the divisor of H minimising (tiles x scan length + fixed cost), L <= _LMAX
    when some divisor allows it."""
    divs = [d for d in range(1, min(_P, H) + 1) if H % d == 0]
    fit = [d for d in divs if H // d <= _LMAX] or [divs[-1]]
    return min(((-(-R * d // _P)) * (H // d + _TILE_COST), d, H // d) for d in fit)[1:]


def _parts(r, nseg, k):
    return r * nseg if k == 1 else -(-r // k)


def _chunks(c, r):
    """(first partition, end partition, first row, end row, elements per partition) of a
    tile's r rows in about c.pieces DMAs (with few tiles, one DMA each would leave queues
    idle); a packed tile's last partition may be partly filled."""
    def pieces(m):
        step = -(-m // c.pieces)
        return [(a, min(m, a + step)) for a in range(0, m, step)]
    if c.k == 1:
        return [(a * c.nseg, b * c.nseg, a, b, c.L) for a, b in pieces(r)]
    full, rem = divmod(r, c.k)
    out = [(a, b, a * c.k, b * c.k, c.k * c.L) for a, b in pieces(full)]
    return out + ([(full, full + 1, full * c.k, r, rem * c.L)] if rem else [])


def _unit(c, t0, r):
    n, W = _parts(r, c.nseg, c.k), c.k * c.L
    t = nl.ndarray((n, W), dtype=c.x2d.dtype, buffer=nl.sbuf)
    for p0, p1, a, b, w in _chunks(c, r):
        nisa.dma_copy(dst=t[p0:p1, 0:w], src=c.x2d[t0 + a:t0 + b, :])
    yield _AHEAD
    if c.low is None:      # whole rows on a partition: scan straight into the output dtype
        nisa.tensor_tensor_scan(dst=t, data0=c.mult[0:n, :], data1=t, initial=0.0,
                                op0=nl.multiply, op1=nl.add)
    else:
        L = c.L
        sc = nl.ndarray((n, L), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=sc, data0=c.mult[0:n, :], data1=t, initial=0.0,
                                op0=nl.multiply, op1=nl.add)
        # carry[k] = sum of the totals of the segments before k in its row
        carry = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=carry, stationary=c.low[0:n, 0:n], moving=sc[:, L - 1:L])
        yield 1
        nisa.activation(dst=t, op=nl.copy, data=sc, bias=carry)
    yield _BEHIND
    for p0, p1, a, b, w in _chunks(c, r):
        nisa.dma_copy(dst=c.o2d[t0 + a:t0 + b, :], src=t[p0:p1, 0:w])
