"""Causal and sliding-window masks as tiles that TensorE or VectorE adds into attention
scores, and the identity that lets TensorE add one into PSUM."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

NEG = -3.0e38


def mask_tile(cache: dict, q0, s0, w, rows, causal, window, dtype):
    """The 0/-inf tile (128, w) of the causal and window masks for queries q0.. (``rows``
    of them) against keys s0..s0+w-1, or None where neither cuts through; made once per
    (offset, width) on GpSimd (a mask depends only on where the keys sit relative to the
    queries) and kept in ``cache``, in the dtype its consumer adds it in."""
    cut_causal = bool(causal and s0 + w - 1 > q0)
    cut_window = bool(window and s0 < q0 + rows - window)
    if not (cut_causal or cut_window):
        return None
    key = (q0 - s0, w, cut_causal, cut_window, dtype.name)
    tile = cache.get(key)
    if tile is None:
        P = nl.tile_size.pmax
        tile = nl.ndarray((P, w), dtype=dtype, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=0.0, engine=nisa.gpsimd_engine)
        if cut_causal:     # keep key s0+j for query q0+p when (q0+p) - (s0+j) >= 0
            nisa.affine_select(dst=tile, pattern=[[-1, w]], channel_multiplier=1, offset=q0 - s0,
                               on_true_tile=tile, on_false_value=NEG, cmp_op=nl.greater_equal)
        if cut_window:     # and when (s0+j) - (q0+p) + window - 1 >= 0
            nisa.affine_select(dst=tile, pattern=[[1, w]], channel_multiplier=-1,
                               offset=s0 - q0 + window - 1, on_true_tile=tile,
                               on_false_value=NEG, cmp_op=nl.greater_equal)
        cache[key] = tile
    return tile


def identity(cache: dict, dtype):
    """A (128, 128) identity in ``dtype`` (kept in ``cache``), the stationary operand with
    which TensorE adds a mask tile into the scores' PSUM (exact in the fp32 accumulation)."""
    key = ("identity", dtype.name)
    if key not in cache:
        P = nl.tile_size.pmax
        t = cache[key] = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.0, engine=nisa.gpsimd_engine)
        nisa.affine_select(dst=t, pattern=[[-1, P]], channel_multiplier=1, offset=0,
                           on_true_tile=t, on_false_value=0.0, cmp_op=nl.equal)
    return cache[key]
