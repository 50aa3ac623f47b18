"""RMSNorm over the hidden dimension: AWS's ``rmsnorm_tkg``.

    y = x / sqrt(sum(x^2) / hidden_actual + eps) * gamma       (hidden_actual defaults to H)

``input`` is [B, S, H] (or [B*S, H]) in HBM, ``gamma`` [1, H] (or [H]). ``output`` may be AWS's
[128, B*S, H/128] HBM buffer (its layout: see ``norm_tkg_utils.OutputLayout``; with
``hidden_dim_tp=True`` the transposed variant; on an LNC launch ``kernel[n]`` the hidden
halves are laid out as n shards unless ``single_core_forced``), a tensor of the input's
shape (the natural layout), or None (ours: a new tensor of the input's shape). The kernel
writes ``output`` and returns it. ``shard_on_h``, ``use_heap_memory`` and ``sbm`` (AWS's
SBUF manager) are accepted and ignored: on an LNC launch the row tiles are dealt to the
cores, which gives the same result as AWS's hidden-dimension split.

Per row tile (see ``norm_tkg_utils`` for how rows map to partitions): ScalarE squares with
the 1/hidden scale folded in and sums each partition (``activation`` with ``reduce_res``),
TensorE adds a row's segments when a row spans several partitions, and VectorE takes the
reciprocal square root and applies it and gamma in one pass. Short rows packed several to a
partition are summed per row by a VectorE reduction instead, and the per-row factor and
gamma are applied by GpSimd and VectorE on complementary sets of rows. Row tiles are
software-pipelined, so DMA and the engines work on different tiles at once; large inputs
are bound by HBM traffic.
"""
from __future__ import annotations

import math

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl

from ..utils.pipeline import pipeline as _pipeline
from . import norm_tkg_utils as _u


@nki.jit
def rmsnorm_tkg(input, gamma, output=None, eps=1e-6, hidden_actual=None, hidden_dim_tp=False,
                single_core_forced=False, shard_on_h=False, use_heap_memory=False, sbm=None):
    x2d, R, H = _u.rows_of(input, "rmsnorm_tkg")
    g = _u.vector_of(gamma, H, "rmsnorm_tkg", "gamma")
    n_prog = 1 if single_core_forced else nl.num_programs(0)
    lay = _u.output_layout(output, input, R, H, "rmsnorm_tkg", shards=1 if hidden_dim_tp else n_prog,
                           tp=hidden_dim_tp)
    if hidden_actual is not None and not 0 < hidden_actual <= H:
        raise nki.errors.ShapeMismatchError(f"rmsnorm_tkg: hidden_actual {hidden_actual} must be in "
                                            f"(0, {H}]")
    rt = _u.RowTiling(R, H, x2d.dtype.itemsize)
    tiles = rt.tiles(sharded=not single_core_forced)
    if tiles:
        n, L = rt.n, rt.L
        c = _Cfg(x2d=x2d, lay=lay, rt=rt, eps=float(eps), k=_u.dma_pieces(len(tiles)),
                 scale=1.0 / math.sqrt(hidden_actual or H), g=_u.broadcast_rows(g, rt.nseg, L, n),
                 grp=_u.group_matrix(rt.nseg, n) if rt.nseg > 1 else None,
                 # packed rows: VectorE's share of the scaling, after its reduction
                 frac=_u.vector_share(1, 0, 2, 2 if x2d.dtype.itemsize == 4 else 1),
                 # ScalarE's squares are only summed: one scratch tile serves every row tile
                 junk=nl.ndarray((n, rt.W), dtype=nl.bfloat16, buffer=nl.sbuf) if rt.k == 1 else None)
        _pipeline([(_unit if rt.k == 1 else _packed_unit)(c, t0, r) for t0, r in tiles])
    return lay.out


def _unit(c, t0, r):
    n = c.rt.parts(r)
    x = nl.ndarray((n, c.rt.W), dtype=c.x2d.dtype, buffer=nl.sbuf)
    c.rt.load(x, c.x2d, t0, r, c.k)
    yield _u.AHEAD
    ss = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=c.junk[0:n, :], op=nl.square, data=x, scale=c.scale, reduce_op=nl.add,
                    reduce_res=ss)
    if c.grp is not None:      # a row's segments: their sums onto each of its partitions
        tot = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=tot, stationary=c.grp[0:n, 0:n], moving=ss)
        ss = tot
    yield 1
    # on VectorE, which applies it next: one cross-engine wait fewer than ScalarE's rsqrt
    rstd = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=ss, op0=nl.add, operand0=c.eps, op1=nl.power, operand1=-0.5)
    nisa.scalar_tensor_tensor(dst=x, data=x, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                              operand1=c.g[0:n, :])
    yield _u.BEHIND
    c.rt.store(c.lay, x, t0, r, c.k)


def _packed_unit(c, t0, r):
    """k rows per partition: per-row sums by a VectorE reduction over [n, k, H]."""
    rt = c.rt
    n = rt.parts(r)
    x = nl.ndarray((n, rt.W), dtype=c.x2d.dtype, buffer=nl.sbuf)
    rt.load(x, c.x2d, t0, r, c.k)
    yield _u.AHEAD
    ss = _u.packed_rstd(rt, x, n, c.scale, c.eps)
    yield 1
    # GpSimd and VectorE each scale and apply gamma to their own rows: no waits between them
    for s0, s1, eng in rt.split(c.frac):
        xv = rt.rows_view(x, n, s0, s1)
        nisa.tensor_tensor(dst=xv, data1=xv, data2=rt.per_row(ss, s0, s1), op=nl.multiply,
                           engine=eng)
        nisa.tensor_tensor(dst=xv, data1=xv, data2=rt.per_column(c.g, n, s0, s1),
                           op=nl.multiply, engine=eng)
    yield _u.BEHIND
    rt.store(c.lay, x, t0, r, c.k)
