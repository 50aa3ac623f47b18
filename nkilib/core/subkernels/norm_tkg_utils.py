"""Helpers shared by ``rmsnorm_tkg`` and ``layernorm_tkg``: argument checks, how rows are laid
over the partitions, the gamma/beta broadcast and the output layouts.

Row tiles (``RowTiling``) hold rows (one token's hidden vector each) in their HBM order, so
every load and store is one contiguous block on the HBM side. A long row, or one of few rows
(decode), is cut into ``nseg`` segments on consecutive partitions, so even one token fills
all 128 lanes; per-row statistics then combine the segments' partial sums with one small
TensorE matmul against a block-diagonal matrix. Short rows go ``k`` to a partition, so a DMA
moves a few KiB per partition rather than a few hundred bytes; per-row statistics then come
from reductions over a [partitions, k, H] view and are broadcast back by access pattern.
"""
from __future__ import annotations

import numpy as np

import nki.isa as nisa
import nki.language as nl
from nki import errors as E

P = 128
# Elements per partition of a row tile: 16 KiB at fp32, so the ~9 tiles in flight (AHEAD +
# BEHIND + 2) fit in SBUF beside gamma and beta.
_LMAX = 4096
_TILE_COST = 512      # a tile's fixed cost (instruction and DMA overheads) in element-steps
# A segmented tile's extra cost: its segments' sums go through TensorE and PSUM, two more
# cross-engine waits (without it, 64 rows of 256 split in two took longer than 128 rows).
_SEG_COST = 2048
_BANK = 512           # fp32 columns of one PSUM bank: one matmul's output
# Ticks (``utils.pipeline``) from a tile's load to its statistics, and from its normalisation
# to its store: loads run well ahead and stores are queued once their data is nearly ready
# (a queued DMA holds its queues while it waits), which keeps about four DMAs in flight.
AHEAD, BEHIND = 4, 3
_DMA_BROADCAST_BYTES = 64 * 1024   # below this a parameter is replicated by DMA, not TensorE
_PACK_BYTES = 2048    # rows shorter than this go several to a partition, up to ~4 KiB
# VectorE's clock over GpSimd's: NeuronCore-v3 0.96 / 1.2 GHz, v4 1.2 / 1.2 GHz.
_VECTOR_OVER_GPSIMD = {3: 0.8, 4: 1.0}


def rows_of(x, kernel):
    """x [B, S, H] or [R, H] in HBM as the 2-D view [R, H]."""
    if x.ndim not in (2, 3):
        raise E.ShapeMismatchError(f"{kernel}: input must be [B, S, H] or [B*S, H], got {tuple(x.shape)}")
    if not x.dtype.is_float:
        raise E.UnsupportedError(f"{kernel}: input dtype {x.dtype.name} is not a float dtype")
    H = x.shape[-1]
    R = int(np.prod(x.shape[:-1]))
    return x.reshape((R, H)), R, H


def vector_of(v, H, kernel, name):
    """A [1, H] (or [H]) parameter as the [1, H] view."""
    if v is None:
        return None
    if tuple(v.shape) not in ((1, H), (H,)):
        raise E.ShapeMismatchError(f"{kernel}: {name} must be [1, {H}], got {tuple(v.shape)}")
    return v.reshape((1, H))


def row_layout(R, H):
    """(nseg, L) for R rows of H: the divisor of H that minimises tiles x (elements per
    partition + fixed costs), with L <= _LMAX when some divisor allows it."""
    divs = [d for d in range(1, min(P, H) + 1) if H % d == 0]
    fit = [d for d in divs if H // d <= _LMAX] or [divs[-1]]
    return min(((-(-R * d // P)) * (H // d + _TILE_COST + (_SEG_COST if d > 1 else 0)), d,
                H // d) for d in fit)[1:]


class RowTiling:
    """R rows of H as row tiles: ``nseg`` partitions per row, or ``k`` rows per partition;
    ``L`` elements per segment (H when whole rows), ``W = k * L`` per partition."""

    def __init__(self, R, H, itemsize):
        self.R, self.H = R, H
        self.nseg, self.L = row_layout(R, H)
        self.k = 1
        if self.nseg == 1 and R > P and H * itemsize < _PACK_BYTES:
            self.k = max(1, min(2 * _PACK_BYTES // (H * itemsize), R // P, _LMAX // H))
        self.W = self.k * self.L
        self.rows_per_tile = P // self.nseg * self.k
        # partitions of the largest tile, alike in every program (shared HBM constants)
        self.n = self.parts(min(R, self.rows_per_tile))

    def tiles(self, sharded=True):
        """(first row, rows) of the tiles this program handles: the tiles are dealt to the
        programs of an LNC launch (``kernel[2]``) in turn."""
        rt = self.rows_per_tile
        tiles = [(t0, min(rt, self.R - t0)) for t0 in range(0, self.R, rt)]
        return tiles[nl.program_id(0)::nl.num_programs(0)] if sharded else tiles

    def parts(self, r):
        return r * self.nseg if self.k == 1 else -(-r // self.k)

    def chunks(self, r, pieces):
        """(first partition, end partition, first row, end row, elements per partition) of
        a tile's r rows in about ``pieces`` DMAs; a packed tile's last partition may be
        partly filled (its other row slots are computed on and never stored)."""
        if self.k == 1:
            return [(a * self.nseg, b * self.nseg, a, b, self.L) for a, b in _pieces(r, pieces)]
        full, rem = divmod(r, self.k)
        out = [(a, b, a * self.k, b * self.k, self.W) for a, b in _pieces(full, pieces)]
        if rem:
            out.append((full, full + 1, full * self.k, r, rem * self.L))
        return out

    def load(self, tile, x2d, t0, r, pieces):
        for p0, p1, a, b, w in self.chunks(r, pieces):
            nisa.dma_copy(dst=tile[p0:p1, 0:w], src=x2d[t0 + a:t0 + b, :])

    def store(self, layout, tile, t0, r, pieces):
        for p0, p1, a, b, w in self.chunks(r, pieces):
            layout.store(tile[p0:p1, 0:w], t0 + a, b - a)

    # A packed tile's work is split between engines by row slots, not columns: each part
    # is then one contiguous byte range per partition, which the dependency tracking (by
    # bounding box) sees as independent of the other part.
    def rows_view(self, t, n, s0, s1):
        """Row slots s0..s1 of tile t [n, W] as an [n, s1 - s0, L] view."""
        return t.reshape((n, self.k, self.L))[:, s0:s1, :]

    def per_row(self, t, s0, s1):
        """Slots s0..s1 of a per-row [n, k] tile t repeated along the row: [n, s1 - s0, L]."""
        return t.ap([[self.k, t.shape[0]], [1, s1 - s0], [0, self.L]], offset=s0)

    def per_column(self, t, n, s0, s1):
        """A broadcast parameter tile t [>= n, L] repeated over row slots s0..s1."""
        return t.ap([[self.L, n], [0, s1 - s0], [1, self.L]])

    def factors(self, t, dtype):
        """Per-row factors [n, k] in the data's dtype when that is 2 bytes: elementwise ops
        on 2-byte operands take one cycle per element, mixed with fp32 two."""
        if dtype.itemsize != 2:
            return t
        c = nl.ndarray(tuple(t.shape), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=c, src=t)
        return c

    def split(self, frac):
        """(first slot, end slot, engine) parts: about ``frac`` of the slots on VectorE, the
        rest on GpSimd, GpSimd's first (VectorE has statistics to do before)."""
        kv = min(self.k, max(0, round(self.k * frac)))
        return [(s0, s1, e) for s0, s1, e in ((kv, self.k, nisa.gpsimd_engine),
                                              (0, kv, nisa.vector_engine)) if s0 < s1]


def packed_rstd(rt, x, n, scale, eps):
    """1 / sqrt(mean(x^2) + eps) of each packed row of x (k rows per partition), as the
    per-row factors ``rt.factors`` lays out; ``scale`` is 1 / sqrt(row length)."""
    sq = nl.ndarray((n, rt.W), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=x, scale=scale)
    ss = nl.ndarray((n, rt.k), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=ss, op=nl.add, data=rt.rows_view(sq, n, 0, rt.k), axis=2)
    del sq
    nisa.tensor_scalar(dst=ss, data=ss, op0=nl.add, operand0=eps, op1=nl.power, operand1=-0.5)
    return rt.factors(ss, x.dtype)


def dma_pieces(n_tiles):
    """DMAs per tile load or store: with few tiles, one DMA per tile would leave most of the
    16 queues idle, so a tile moves in up to four pieces (each costs a fixed ~0.6 us)."""
    return max(1, min(4, -(-8 // max(1, n_tiles))))


def _pieces(r, k):
    if r == 0:
        return []
    step = -(-r // k)
    return [(a, min(r, a + step)) for a in range(0, r, step)]


def vector_share(vector_fixed, gpsimd_fixed, split, cycles):
    """Fraction of ``split`` elementwise passes (``cycles`` per element each: 2 for fp32,
    else 1) to give VectorE so that it and GpSimd finish together, when VectorE also has
    ``vector_fixed`` one-cycle passes (statistics) and GpSimd ``gpsimd_fixed`` of its own."""
    r = _VECTOR_OVER_GPSIMD.get(int(nisa.get_nc_version()), 1.0)
    f = (r * (gpsimd_fixed + split) * cycles - vector_fixed) / (split * cycles * (1 + r))
    return min(1.0, max(0.0, f))


def constant(mask, fp32=True):
    """A 0/1 (or scaled) float matrix as an SBUF tile, from a shared constant. TensorE needs
    both operands fp32 or neither, so 2-byte callers get a bf16 copy (exact for 0/1)."""
    t = nl.ndarray(mask.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=nl.shared_constant(np.asarray(mask, np.float32)))
    if fp32:
        return t
    b = nl.ndarray(mask.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=b, src=t, engine=nisa.gpsimd_engine)
    return b


def group_matrix(nseg, n, value=1.0):
    """[n, n] fp32 with ``value`` where two partitions hold segments of the same row: as a
    matmul's stationary operand it sums each row's per-segment values onto all its partitions."""
    g = np.arange(n) // nseg
    return constant((g[:, None] == g[None, :]) * value)


def broadcast_rows(vec, nseg, L, n):
    """The [1, H] HBM vector as an SBUF tile [n, L] whose partition k holds segment k % nseg,
    the layout of a row tile. Few rows per tile: one DMA reading the vector once per row.
    Otherwise the segments are loaded once and spread over the partitions by TensorE (a 0/1
    selection matrix), which saves re-reading the vector 128 times."""
    rt = n // nseg
    if rt * L * nseg * vec.dtype.itemsize <= _DMA_BROADCAST_BYTES:
        out = nl.ndarray((n, L), dtype=vec.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=out, src=vec.ap([[0, rt], [L, nseg], [1, L]]))
        return out
    fp32 = vec.dtype == nl.float32
    seg = nl.ndarray((nseg, L), dtype=vec.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=seg, src=vec.reshape((nseg, L)))
    sel = constant(np.arange(n)[None, :] % nseg == np.arange(nseg)[:, None], fp32)
    out = nl.ndarray((n, L), dtype=vec.dtype, buffer=nl.sbuf)
    for i, c0 in enumerate(range(0, L, _BANK)):
        w = min(_BANK, L - c0)
        ps = nl.ndarray((n, w), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=sel, moving=seg[:, c0:c0 + w])
        if i % 2:      # PSUM to SBUF on ScalarE and VectorE in turn
            nisa.activation(dst=out[:, c0:c0 + w], op=nl.copy, data=ps)
        else:
            nisa.tensor_copy(dst=out[:, c0:c0 + w], src=ps)
    return out


class OutputLayout:
    """Where a row tile's result goes. ``natural``: the input's [.., H] layout. Otherwise
    AWS's [128, B*S, H/128] layout: with ``shards`` n, row t's hidden column
    c = s*(H/n) + p*(H1/n) + j lands at [p, t, s*(H1/n) + j] (n = the LNC size, 1 on one
    core); with ``tp`` (AWS's hidden_dim_tp) column c = j*128 + p lands at [p, t, j]."""

    def __init__(self, out, natural, R, H, shards=1, tp=False):
        self.out, self.natural, self.R, self.H = out, natural, R, H
        self.shards, self.tp = shards, tp
        self.out2d = out.reshape((R, H)) if natural else None

    def store(self, tile, t0, r):
        """Rows t0..t0+r from a tile view holding them in order, in one DMA. In AWS's layout
        the HBM side is written in runs of H/128/shards elements (single elements with
        ``tp``), as AWS's own kernels load that layout."""
        if self.natural:
            nisa.dma_copy(dst=self.out2d[t0:t0 + r, :], src=tile)
            return
        R, H1 = self.R, self.H // P
        row = R * H1                       # stride of one partition p in the output
        if self.tp:
            pat = [[H1, r], [1, H1], [row, P]]
        else:
            n = self.shards
            pat = [[H1, r], [H1 // n, n], [row, P], [1, H1 // n]]
        nisa.dma_copy(dst=self.out.ap(pat, offset=t0 * H1), src=tile)


def output_layout(output, x, R, H, kernel, shards=1, tp=False):
    """The layout ``output`` asks for: None (a new tensor in the input's layout, returned),
    the input's shape (natural layout), or AWS's (128, B*S, H/128)."""
    if output is None:
        out = nl.ndarray(tuple(x.shape), dtype=x.dtype, buffer=nl.shared_hbm)
        return OutputLayout(out, True, R, H)
    shape = tuple(output.shape)
    if shape in (tuple(x.shape), (R, H)):
        return OutputLayout(output, True, R, H)
    aws = (P, R, H // P)
    if shape != aws or H % P:
        raise E.ShapeMismatchError(
            f"{kernel}: output must be the input's shape {tuple(x.shape)} or AWS's (128, B*S, "
            f"H/128) = {aws if H % P == 0 else '(H a multiple of 128)'}, got {shape}")
    if not tp and (H // P) % shards:
        raise E.ShapeMismatchError(f"{kernel}: H/128 = {H // P} does not split over {shards} "
                                   f"LNC shards of the output layout")
    return OutputLayout(output, False, R, H, shards, tp)
