"""LayerNorm over the hidden dimension: AWS's ``layernorm_tkg``.

    y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta       (population variance)

``input`` is [B, S, H] (or [B*S, H]) in HBM, ``gamma`` and the optional ``beta`` [1, H] (or
[H]). ``output`` may be AWS's [128, B*S, H/128] HBM buffer (its layout: see
``norm_tkg_utils.OutputLayout``; on an LNC launch ``kernel[n]`` the hidden dimension is laid
out as n shards, as AWS's), a tensor of the input's shape (the natural layout), or None
(ours: a new tensor of the input's shape). The kernel writes ``output`` and returns it.
``shard_on_h``, ``use_heap_memory`` and ``sbm`` (AWS's SBUF manager) are accepted and
ignored: on an LNC launch the row tiles are dealt to the cores, which gives the same result.

Per row tile (see ``norm_tkg_utils`` for how rows map to partitions): VectorE's
``bn_stats``/``bn_aggr`` give each partition's mean and variance (a row spread over several
partitions combines its segments with one TensorE matmul), ScalarE normalises
(``activation`` with per-row scale and bias), and gamma and beta are applied by GpSimd and
VectorE on complementary column ranges sized so that neither outruns the other (VectorE
also carries the statistics; ``vector_share``). Short rows packed several to a partition
get their means from a VectorE reduction over [n, k, H], are centred, and get their
variances from the centred values' squares (ScalarE) summed the same way; centring, scale,
gamma and beta are split by rows between GpSimd and VectorE. A single row tile (decode) is
finished on VectorE alone: its time is cross-engine waits, not work. Statistics are two-pass
(segment or centred) throughout, so a mean far larger than the spread costs no accuracy. Row
tiles are software-pipelined across the engines; intermediates stay in the input's dtype.
"""
from __future__ import annotations

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl

from ..utils.pipeline import pipeline as _pipeline
from . import norm_tkg_utils as _u

_FMAX = nl.tile_size.bn_stats_fmax


@nki.jit
def layernorm_tkg(input, gamma, output=None, beta=None, eps=1e-6, shard_on_h=False,
                  use_heap_memory=False, sbm=None):
    x2d, R, H = _u.rows_of(input, "layernorm_tkg")
    g = _u.vector_of(gamma, H, "layernorm_tkg", "gamma")
    b = _u.vector_of(beta, H, "layernorm_tkg", "beta")
    lay = _u.output_layout(output, input, R, H, "layernorm_tkg", shards=nl.num_programs(0))
    rt = _u.RowTiling(R, H, x2d.dtype.itemsize)
    tiles = rt.tiles()
    if tiles:
        n, L = rt.n, rt.L
        cyc = 2 if x2d.dtype.itemsize == 4 else 1
        passes = 1 + (b is not None)
        # VectorE's share of gamma/beta's columns, after bn_stats (one pass). Packed: of the
        # rows' centring (two cycles per element: an fp32 operand), scale, gamma and beta,
        # after two reductions.
        frac = (_u.vector_share(1, 0, passes, cyc) if rt.k == 1 else
                _u.vector_share(2, 0, 2 + (passes + 1) * cyc, 1))
        c = _Cfg(x2d=x2d, lay=lay, rt=rt, eps=float(eps), k=_u.dma_pieces(len(tiles)),
                 g=_u.broadcast_rows(g, rt.nseg, L, n),
                 b=_u.broadcast_rows(b, rt.nseg, L, n) if b is not None else None,
                 # one tile (decode): latency is cross-engine waits, so VectorE does it all
                 fused=len(tiles) == 1, cv=int(L * frac), frac=frac,
                 # a row's segment means (and mean squares) average onto each of its partitions
                 grp=_u.group_matrix(rt.nseg, n, 1.0 / rt.nseg) if rt.nseg > 1 else None)
        _pipeline([(_unit if rt.k == 1 else _packed_unit)(c, t0, r) for t0, r in tiles])
    return lay.out


def _unit(c, t0, r):
    L = c.rt.L
    n = c.rt.parts(r)
    x = nl.ndarray((n, L), dtype=c.x2d.dtype, buffer=nl.sbuf)
    c.rt.load(x, c.x2d, t0, r, c.k)
    yield _u.AHEAD
    nch = (L + _FMAX - 1) // _FMAX
    st = nl.ndarray((n, 6 * nch), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(nch):
        nisa.bn_stats(dst=st[:, 6 * j:6 * j + 6], data=x[:, j * _FMAX:min(L, (j + 1) * _FMAX)])
    mv = nl.ndarray((n, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.bn_aggr(dst=mv, data=st)
    if c.grp is not None:
        mean, var = _combine(c, mv, n)
    else:
        mean, var = mv[:, 0:1], mv[:, 1:2]
    rstd = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=var, op0=nl.add, operand0=c.eps, op1=nl.power, operand1=-0.5)
    nbias = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias, data=mean, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                       operand1=-1.0)
    yield 1
    if c.fused:
        nisa.tensor_scalar(dst=x, data=x, op0=nl.multiply, operand0=rstd, op1=nl.add, operand1=nbias)
        _affine(x, c.g[0:n, :], None if c.b is None else c.b[0:n, :], nisa.vector_engine)
        c.rt.store(c.lay, x, t0, r, c.k)
        return
    nisa.activation(dst=x, op=nl.copy, data=x, scale=rstd, bias=nbias)
    yield 1
    # gamma and beta: GpSimd's columns, then VectorE's after its next tile's statistics
    if c.cv < L:
        _affine(x[:, c.cv:], c.g[0:n, c.cv:], None if c.b is None else c.b[0:n, c.cv:],
                nisa.gpsimd_engine)
    if c.cv:
        yield 1
        _affine(x[:, :c.cv], c.g[0:n, :c.cv], None if c.b is None else c.b[0:n, :c.cv],
                nisa.vector_engine)
    yield _u.BEHIND
    c.rt.store(c.lay, x, t0, r, c.k)


def _packed_unit(c, t0, r):
    """k rows per partition: per-row means by a VectorE reduction over [n, k, H]; the rows
    centred with the fp32 means (by GpSimd and VectorE, each its own rows); the variance from
    the centred values' squares (ScalarE) summed per row; then scale, gamma and beta."""
    rt, L = c.rt, c.rt.L
    n = rt.parts(r)
    x = nl.ndarray((n, rt.W), dtype=c.x2d.dtype, buffer=nl.sbuf)
    rt.load(x, c.x2d, t0, r, c.k)
    yield _u.AHEAD
    mean = nl.ndarray((n, rt.k), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=mean, op=nl.add, data=rt.rows_view(x, n, 0, rt.k), axis=2)
    nisa.tensor_scalar(dst=mean, data=mean, op0=nl.multiply, operand0=1.0 / L)
    yield 1
    parts = rt.split(c.frac)
    for s0, s1, eng in parts:     # in fp32: a rounded mean would not cancel a large offset
        xv = rt.rows_view(x, n, s0, s1)
        nisa.tensor_tensor(dst=xv, data1=xv, data2=rt.per_row(mean, s0, s1), op=nl.subtract, engine=eng)
    yield 1
    rstd = _u.packed_rstd(rt, x, n, 1.0 / L ** 0.5, c.eps)
    yield 1
    for s0, s1, eng in parts:
        xv = rt.rows_view(x, n, s0, s1)
        nisa.tensor_tensor(dst=xv, data1=xv, data2=rt.per_row(rstd, s0, s1), op=nl.multiply, engine=eng)
        _affine(xv, rt.per_column(c.g, n, s0, s1),
                None if c.b is None else rt.per_column(c.b, n, s0, s1), eng)
    yield _u.BEHIND
    rt.store(c.lay, x, t0, r, c.k)


def _affine(xs, g, b, engine):
    nisa.tensor_tensor(dst=xs, data1=xs, data2=g, op=nl.multiply, engine=engine)
    if b is not None:
        nisa.tensor_tensor(dst=xs, data1=xs, data2=b, op=nl.add, engine=engine)


def _combine(c, mv, n):
    """A row's mean and variance from its (equal-sized) segments' on its partitions: the
    average of the segment means, then the average of (segment variance + (segment mean -
    mean)^2). Two small matmuls; E[x^2] - mean^2 would cancel when |mean| >> std."""
    mean = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=mean, stationary=c.grp[0:n, 0:n], moving=mv[:, 0:1])
    d = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=d, data=mv[:, 0:1], op0=nl.subtract, operand0=mean)
    nisa.scalar_tensor_tensor(dst=mv[:, 1:2], data=d, op0=nl.multiply, operand0=d, op1=nl.add,
                              operand1=mv[:, 1:2])
    var = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=var, stationary=c.grp[0:n, 0:n], moving=mv[:, 1:2])
    return mean, var
