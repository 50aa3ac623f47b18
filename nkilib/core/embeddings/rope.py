"""Rotary position embedding: AWS's ``RoPE``.

``x_in`` [d_head, B, n_heads, S], ``cos`` and ``sin`` [d_head // 2, B, S], all in HBM; the
result has ``x_in``'s shape and dtype. Pairs (a, b) of the head dimension rotate by their
frequency's angle: ``a' = a cos - b sin``, ``b' = b cos + a sin``. With
``contiguous_layout=True`` (the default) pair i is (i, i + d_head/2), HF's ``rotate_half``;
with False it is (2i, 2i + 1), the interleaved layout. ``lnc_shard=True`` deals the work to
the programs of an LNC launch (``kernel[2]``). ``relayout_in_sbuf`` is accepted: both
layouts run the same instructions here (see below), so it changes nothing.

The head dimension sits on partitions. Per block of up to 2048 (batch, head, position)
columns: GpSimd forms x * cos and VectorE x * sin (cos and sin laid out per partition's
pair and broadcast over heads by the access pattern); TensorE adds x * cos to the partner
rows of x * sin, signed, in one PSUM accumulation (an identity matmul and a signed pair-swap
permutation matmul), and ScalarE moves the result to SBUF in the output dtype. For fp32,
whose matmuls run at a quarter of the rate, every other block has VectorE add x * cos to the
permuted x * sin as it reads it from PSUM instead. The layout only changes which partition
is whose partner (the permutation matrix and where the cos/sin rows land), so interleaved
inputs need neither strided DMA nor a relayout pass. Blocks are software-pipelined across
DMA, GpSimd, VectorE, TensorE and ScalarE.

Beyond AWS's limits (d_head 64 or 128, B <= 64, n_heads <= 16, S <= 512) this takes any
even d_head <= 128 and any B, n_heads and S.
"""
from __future__ import annotations

import numpy as np

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..utils.pipeline import pipeline as _pipeline

_COLS = 2048     # (batch, head, position) columns per block: 4 KiB DMA rows at bf16
_BANK = 512      # fp32 columns of one PSUM bank: one matmul's output


@nki.jit
def RoPE(x_in, cos, sin, lnc_shard=False, contiguous_layout=True, relayout_in_sbuf=False):
    _validate(x_in, cos, sin)
    d, B, H, S = x_in.shape
    out = nl.ndarray(tuple(x_in.shape), dtype=x_in.dtype, buffer=nl.shared_hbm)
    fp32 = x_in.dtype == nl.float32
    c = _Cfg(x=x_in, cos=cos, sin=sin, out=out, d=d, contiguous=contiguous_layout, tables={},
             ident=_matrix(np.eye(d), fp32), swap=_matrix(_pair_swap(d, contiguous_layout), fp32))
    blocks = _blocks(B, H, S)
    if lnc_shard:
        blocks = blocks[nl.program_id(0)::nl.num_programs(0)]
    # fp32 matmuls run at a quarter of the bf16 rate: every other fp32 block leaves the add of
    # x * cos to VectorE (reading PSUM), which balances TensorE against VectorE
    _pipeline([_unit(c, *blk, tensor_add=not fp32 or i % 2 == 0) for i, blk in enumerate(blocks)])
    return out


def _validate(x, cos, sin):
    if x.ndim != 4:
        raise E.ShapeMismatchError(f"RoPE: x_in must be [d_head, B, n_heads, S], got {tuple(x.shape)}")
    d, B, H, S = x.shape
    if d % 2 or not 2 <= d <= nl.tile_size.pmax:
        raise E.ShapeMismatchError(f"RoPE: d_head must be even and at most {nl.tile_size.pmax}, "
                                   f"got {d} (x_in {tuple(x.shape)})")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (d // 2, B, S):
            raise E.ShapeMismatchError(f"RoPE: {name} must be [d_head // 2, B, S] = {(d // 2, B, S)} "
                                       f"for x_in {tuple(x.shape)}, got {tuple(t.shape)}")
    if cos.dtype != sin.dtype:
        raise E.ShapeMismatchError(f"RoPE: cos ({cos.dtype.name}) and sin ({sin.dtype.name}) must "
                                   f"share a dtype")
    if not (x.dtype.is_float and cos.dtype.is_float):
        raise E.UnsupportedError(f"RoPE: float inputs only, got x_in {x.dtype.name}, cos {cos.dtype.name}")


def _pair_swap(d, contiguous):
    """[d, d] with m[k, j] = -1 / +1 where row k is the partner of output row j, so that
    (m.T @ (x * sin))[j] = -b sin for the first element a of a pair and +a sin for b."""
    m = np.zeros((d, d), np.float32)
    first = np.arange(d // 2) if contiguous else np.arange(0, d, 2)
    second = first + (d // 2 if contiguous else 1)
    m[second, first] = -1.0
    m[first, second] = 1.0
    return m


def _matrix(a, fp32):
    """A constant matrix in SBUF, bf16 unless fp32 (TensorE needs both operands fp32 or
    neither; 0 and +-1 are exact in bf16)."""
    t = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=nl.shared_constant(np.asarray(a, np.float32)))
    if fp32:
        return t
    b = nl.ndarray(a.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=b, src=t, engine=nisa.gpsimd_engine)
    return b


def _blocks(B, H, S):
    """(b0, nb, h0, nh, s0, w) blocks of at most _COLS columns, heads innermost so a block's
    cos/sin rows are reused by the next."""
    w = min(S, _COLS)
    nh = min(H, _COLS // w) if w == S else 1
    nb = min(B, _COLS // (H * S)) if nh == H else 1
    return [(b0, min(nb, B - b0), h0, min(nh, H - h0), s0, min(w, S - s0))
            for b0 in range(0, B, nb) for s0 in range(0, S, w) for h0 in range(0, H, nh)]


def _table(c, t, b0, nb, s0, w):
    """cos or sin of a block as [d, nb * w]: each partition gets its pair's frequency."""
    d, half = c.d, c.d // 2
    tile = nl.ndarray((d, nb * w), dtype=t.dtype, buffer=nl.sbuf)
    rows = (tile[0:half], tile[half:d]) if c.contiguous else (tile[0::2], tile[1::2])
    for dst in rows:
        nisa.dma_copy(dst=dst, src=t[:, b0:b0 + nb, s0:s0 + w])
    return tile


def _bcast(tab, d, nb, nh, w):
    """A [d, nb * w] table as a [d, nb, nh, w] view repeating it over the heads."""
    return tab.ap([[nb * w, d], [w, nb], [0, nh], [1, w]])


def _unit(c, b0, nb, h0, nh, s0, w, tensor_add=True):
    d = c.d
    cols = nb * nh * w
    x = nl.ndarray((d, cols), dtype=c.x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x.reshape((d, nb, nh, w)), src=c.x[:, b0:b0 + nb, h0:h0 + nh, s0:s0 + w])
    key = (b0, s0)
    if key not in c.tables:     # the heads of one (batch, positions) block share their tables
        c.tables = {key: (_table(c, c.cos, b0, nb, s0, w), _table(c, c.sin, b0, nb, s0, w))}
    cos_t, sin_t = c.tables[key]
    yield 2
    xc = nl.ndarray((d, cols), dtype=c.x.dtype, buffer=nl.sbuf)
    xs = nl.ndarray((d, cols), dtype=c.x.dtype, buffer=nl.sbuf)
    x4 = x.reshape((d, nb, nh, w))
    nisa.tensor_tensor(dst=xc.reshape((d, nb, nh, w)), data1=x4, data2=_bcast(cos_t, d, nb, nh, w),
                       op=nl.multiply, engine=nisa.gpsimd_engine)
    nisa.tensor_tensor(dst=xs.reshape((d, nb, nh, w)), data1=x4, data2=_bcast(sin_t, d, nb, nh, w),
                       op=nl.multiply)
    yield 1
    acc = []
    for c0 in range(0, cols, _BANK):
        cw = min(_BANK, cols - c0)
        ps = nl.ndarray((d, cw), dtype=nl.float32, buffer=nl.psum)
        if tensor_add:
            nisa.nc_matmul(dst=ps, stationary=c.ident, moving=xc[:, c0:c0 + cw])
        nisa.nc_matmul(dst=ps, stationary=c.swap, moving=xs[:, c0:c0 + cw], accumulate=tensor_add)
        acc.append((c0, cw, ps))
    yield 1
    for c0, cw, ps in acc:      # x is free again: the result goes there
        if tensor_add:
            nisa.activation(dst=x[:, c0:c0 + cw], op=nl.copy, data=ps)
        else:
            nisa.tensor_tensor(dst=x[:, c0:c0 + cw], data1=ps, data2=xc[:, c0:c0 + cw], op=nl.add)
    del acc, ps                 # the PSUM banks, for the next block's matmuls
    yield 2
    nisa.dma_copy(dst=c.out[:, b0:b0 + nb, h0:h0 + nh, s0:s0 + w], src=x.reshape((d, nb, nh, w)))
