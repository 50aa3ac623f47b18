"""DMA instructions: copies, transposes and summing copies between HBM and on-chip memory."""
from __future__ import annotations

import numpy as np

from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules
from ._common import _T, _put
from .constants import dge_mode, engine, oob_mode


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None, unique_indices=True, dst_rmw_op=None):
    """Copy src to dst (HBM or SBUF; DMA cannot reach PSUM); dst_rmw_op=nl.add accumulates."""
    I = "dma_copy"
    _T(dst, "dst", I), _T(src, "src", I)
    if dst.size != src.size:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} and src {tuple(src.shape)} hold "
                    f"different numbers of elements")
    if dst_rmw_op is not None and getattr(dst_rmw_op, "name", None) != "add":
        _rules.fail(E.NkiRuleError, f"{I}: dst_rmw_op supports only nl.add")
    src_ind, dst_ind = getattr(src, "_indirect", None), getattr(dst, "_indirect", None)
    for ind, what in ((src_ind, "src"), (dst_ind, "dst")):
        if ind is not None and ind[2].any() and oob_mode == type(oob_mode).error:
            bad = ind[1][ind[2]].reshape(-1)[0]
            _rules.fail(E.IndexOutOfBoundsError, f"{I}: indirect {what} offset reaches element "
                        f"{bad} of an HBM tensor of {ind[0].size} (oob_mode=error; oob_mode.skip "
                        f"skips such rows)")
    _ctx.current().dma(I, dst, src)
    v = src.v if src.shape == dst.shape else src.v.reshape(dst.shape)
    keep = dst.v.copy() if src_ind is not None and src_ind[2].any() else None
    if dst_rmw_op is not None:
        _put(dst, dst.v.astype(np.float32) + v.astype(np.float32))
    elif dst.dtype == src.dtype:
        dst.v[...] = v
    else:
        _put(dst, v)
    if keep is not None:          # skipped (out-of-range) rows leave dst as it was
        skip = src_ind[2].reshape(dst.shape)
        dst.v[skip] = keep[skip]
    if dst_ind is not None:       # scatter: the addressed elements of the HBM tensor
        base, flat, oob = dst_ind
        base[flat[~oob]] = dst.v[~oob]


# AWS's reference: the permutations the DMA engines perform (the second and third axes of
# a 4-D tile stay in place; only the outer two swap).
_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown,
                  oob_mode=oob_mode.error, name=None):
    """Transpose while copying with DMA: dst axis i is src axis ``axes[i]``; AWS's permutations
    (1, 0), (2, 1, 0) and (3, 1, 2, 0), the default for 2-D, 3-D and 4-D sources."""
    I = "dma_transpose"
    _T(dst, "dst", I), _T(src, "src", I)
    if src.ndim not in _DMA_TRANSPOSE_AXES:
        _rules.fail(E.ShapeMismatchError, f"{I}: src {tuple(src.shape)} has {src.ndim} dims; "
                                          f"DMA transposes 2-D, 3-D and 4-D tiles")
    ax = tuple(axes) if axes is not None else _DMA_TRANSPOSE_AXES[src.ndim]
    if ax != _DMA_TRANSPOSE_AXES[src.ndim]:
        _rules.fail(E.NkiRuleError, f"{I}: axes {ax} for a {src.ndim}-D src; the DMA engines "
                                    f"support {_DMA_TRANSPOSE_AXES[src.ndim]}")
    want = tuple(src.shape[a] for a in ax)
    if tuple(dst.shape) != want:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must be {want} (src {tuple(src.shape)} permuted by {ax})")
    if src.dtype.itemsize != 2:
        _rules.fail(E.DtypeLegalityError, f"{I}: DMA transpose moves 2-byte dtypes, got {src.dtype.name}")
    # AWS's Trainium2 architecture guide ("DMA Transpose"): up to 90% of the DMA throughput
    # from HBM into SBUF, 50% from SBUF to SBUF, with 128-partition, 16-element output tiles.
    _ctx.current().dma(I, dst, src, efficiency=0.9 if src.kind == "hbm" else 0.5,
                        transpose=True)
    _put(dst, np.transpose(src.v, ax)) if dst.dtype != src.dtype else dst.v.__setitem__(..., np.transpose(src.v, ax))


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None):
    """dst = srcs[0] + srcs[1] + ... computed in float32 by the DMA engines (HBM or SBUF)."""
    I = "dma_compute"
    _T(dst, "dst", I)
    srcs = list(srcs)
    if not 1 <= len(srcs) <= 16:
        _rules.fail(E.NkiRuleError, f"{I}: srcs holds 1 to 16 tensors, got {len(srcs)}")
    for k, s in enumerate(srcs):
        _T(s, f"srcs[{k}]", I)
        if s.size != dst.size:
            _rules.fail(E.ShapeMismatchError, f"{I}: srcs[{k}] {tuple(s.shape)} and dst {tuple(dst.shape)} hold "
                        f"different numbers of elements")
    if getattr(reduce_op, "name", None) != "add":
        _rules.fail(E.NkiRuleError, f"{I}: reduce_op supports only nl.add, got {reduce_op!r}")
    if scales is not None and (len(scales) != len(srcs) or any(float(x) != 1.0 for x in scales)):
        _rules.fail(E.NkiRuleError, f"{I}: scales must be None or one 1.0 per source, got {list(scales)}")
    # Charged as one transfer per source into dst: each source's bytes cross the queue once.
    sim = _ctx.current()
    for s in srcs:
        sim.dma(I, dst, s)
    acc = np.zeros(dst.shape, np.float32)
    for s in srcs:                      # every source is read before dst (maybe one) is written
        acc += (s.v if s.shape == dst.shape else s.v.reshape(dst.shape)).astype(np.float32)
    _put(dst, acc)
