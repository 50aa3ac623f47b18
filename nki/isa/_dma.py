"""DMA instructions: copies and transposes between HBM and on-chip memory."""
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
    _ctx.current().dma(I, dst, src)
    v = src.v if src.shape == dst.shape else src.v.reshape(dst.shape)
    if dst_rmw_op is not None:
        _put(dst, dst.v.astype(np.float32) + v.astype(np.float32))
    elif dst.dtype == src.dtype:
        dst.v[...] = v
    else:
        _put(dst, v)


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown,
                  oob_mode=oob_mode.error, name=None):
    """Transpose while copying (2-D: swap axes; 3-D/4-D: permute by axes) with DMA."""
    I = "dma_transpose"
    _T(dst, "dst", I), _T(src, "src", I)
    ax = tuple(axes) if axes is not None else tuple(reversed(range(src.ndim)))
    want = tuple(src.shape[a] for a in ax)
    if tuple(dst.shape) != want:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must be {want} (src {tuple(src.shape)} permuted by {ax})")
    if src.dtype.itemsize != 2:
        _rules.fail(E.DtypeLegalityError, f"{I}: DMA transpose moves 2-byte dtypes, got {src.dtype.name}")
    # Element-granular descriptors: a DMA transpose runs far below the queue's peak.
    _ctx.current().dma(I, dst, src, efficiency=0.25)
    _put(dst, np.transpose(src.v, ax)) if dst.dtype != src.dtype else dst.v.__setitem__(..., np.transpose(src.v, ax))
