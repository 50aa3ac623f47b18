"""Cross-entropy loss over large vocabularies: AWS's experimental ``cross_entropy_forward``
and ``cross_entropy_backward``.

Layouts (AWS's): logits (num_positions, V) in HBM, bf16 or fp32; targets (num_positions,)
integer class indices in [0, V) (AWS asks for int32; any integer dtype is read); the forward
returns the per-position loss and log-sum-exp, each (num_positions,) in ``dtype``; the backward
takes that lse and returns dlogits (num_positions, V) in ``dtype``, written over the logits
when ``inplace=True``. Positions are split contiguously over an LNC launch (``kernel[2]``),
the last program taking the remainder, then processed ``positions_per_batch`` rows (the
partitions) at a time against tiles of at most ``chunk_size`` vocabulary columns and 16 KiB
per partition (so several tiles are in flight; AWS's larger chunks are split). Neither
kernel has ignore_index or label smoothing (AWS's has neither); a target outside [0, V)
gives an undefined loss.

Forward, per vocabulary tile: VectorE picks the target's logit with ``range_select`` (keep
the column whose index equals the row's target; float32 indices, so V < 2**24); GpSimd folds
the tile in halves (elementwise max) and VectorE's max of what is left updates the row's
running maximum m; ScalarE adds sum(exp(x - m)) to its running sum, rescaled by
exp(m_old - m) when m grows. lse = m + log(sum), loss = lse - x_target, both on ScalarE. The
only per-tile chains stay within one engine, so tiles stream through all four.

Backward: grad = g * (softmax - onehot(target)) with g = 1/num_positions ('mean') or 1
('sum'). ScalarE computes g * softmax as exp(x - lse + log g) in one pass; GpSimd builds
-g * onehot by comparing a column-index tile with the row's target; VectorE adds the two.
"""
from __future__ import annotations

import math

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ...core.utils.pipeline import pipeline as _pipeline

_NEG = -3.0e38            # a select's "not here": below any logit, finite in fp32 and bf16
_TILE_BYTES = 16 * 1024   # one vocabulary tile per partition: several stay in flight in SBUF


@nki.jit
def cross_entropy_forward(logits_hbm, targets_hbm, positions_per_batch=32, chunk_size=32768,
                          dtype=nl.bfloat16):
    """Per-position cross-entropy loss and log-sum-exp of logits (num_positions, V):
    returns (loss_hbm, lse_state_hbm), each (num_positions,) in ``dtype``."""
    name = "cross_entropy_forward"
    N, V, w, dtype = _check(name, logits_hbm, targets_hbm, positions_per_batch, chunk_size, dtype)
    loss_hbm = nl.ndarray((N,), dtype=dtype, buffer=nl.shared_hbm)
    lse_hbm = nl.ndarray((N,), dtype=dtype, buffer=nl.shared_hbm)
    B = positions_per_batch
    # Write-only scratch, one per engine writing it, so reusing it never waits on another engine.
    sel = nl.ndarray((B, w), dtype=nl.bfloat16, buffer=nl.sbuf)
    ex = nl.ndarray((B, w), dtype=nl.bfloat16, buffer=nl.sbuf)
    tiles = [(c0, min(w, V - c0)) for c0 in range(0, V, w)]
    units = []
    for b0, r in _batches(N, B):
        bt = _State(b0=b0, r=r, n=len(tiles))
        units += [_fwd_unit(logits_hbm, targets_hbm, bt, j, c0, cw, sel, ex, loss_hbm, lse_hbm, dtype)
                  for j, (c0, cw) in enumerate(tiles)]
    _pipeline(units)
    return loss_hbm, lse_hbm


@nki.jit
def cross_entropy_backward(logits_hbm, targets_hbm, lse_state_hbm, reduction="mean",
                           positions_per_batch=32, chunk_size=32768, dtype=nl.bfloat16,
                           inplace=True):
    """dlogits of the summed ('sum') or averaged ('mean') cross-entropy, from the forward's
    lse: (num_positions, V) in ``dtype``; with ``inplace=True`` written over logits_hbm."""
    name = "cross_entropy_backward"
    N, V, w, dtype = _check(name, logits_hbm, targets_hbm, positions_per_batch, chunk_size, dtype)
    if reduction not in ("mean", "sum"):
        raise E.UnsupportedError(f"{name}: reduction must be 'mean' or 'sum', got {reduction!r}")
    if tuple(lse_state_hbm.shape) != (N,):
        raise E.ShapeMismatchError(f"{name}: lse_state_hbm must be ({N},) for logits "
                                   f"{tuple(logits_hbm.shape)}, got {tuple(lse_state_hbm.shape)}")
    g = 1.0 / N if reduction == "mean" else 1.0
    grad = logits_hbm if inplace else nl.ndarray((N, V), dtype=dtype, buffer=nl.shared_hbm)
    B = positions_per_batch
    tiles = [(c0, min(w, V - c0)) for c0 in range(0, V, w)]
    # Constants: each tile's column index, and -c0 of every tile (the target's offset in it).
    cols = nl.ndarray((B, w), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=cols, pattern=[[1, w]], offset=0, channel_multiplier=0)
    starts = nl.ndarray((B, len(tiles)), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=starts, pattern=[[-w, len(tiles)]], offset=0, channel_multiplier=0)
    c = _State(x=logits_hbm, t=targets_hbm, lse=lse_state_hbm, grad=grad, g=g, dtype=dtype,
             cols=cols, starts=starts)
    units = []
    for b0, r in _batches(N, B):
        bt = _State(b0=b0, r=r, n=len(tiles))
        units += [_bwd_unit(c, bt, j, c0, cw) for j, (c0, cw) in enumerate(tiles)]
    _pipeline(units)
    return grad


class _State:
    """Attributes by keyword: a batch of rows with its per-tile statistics, or a kernel's
    operands shared by its units."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _check(name, logits, targets, B, chunk_size, dtype):
    if logits.ndim != 2:
        raise E.ShapeMismatchError(f"{name}: logits_hbm must be 2-D (num_positions, V), got "
                                   f"{tuple(logits.shape)}")
    N, V = logits.shape
    if tuple(targets.shape) != (N,):
        raise E.ShapeMismatchError(f"{name}: targets_hbm must be ({N},) for logits {tuple(logits.shape)}, "
                                   f"got {tuple(targets.shape)}")
    if N == 0 or V == 0:
        raise E.ShapeMismatchError(f"{name}: empty logits {tuple(logits.shape)}")
    if logits.dtype not in (nl.float32, nl.bfloat16) or dtype not in (nl.float32, nl.bfloat16):
        raise E.UnsupportedError(f"{name}: logits and dtype must be float32 or bfloat16, got "
                                 f"{logits.dtype.name} and {dtype}")
    if not targets.dtype.is_int:
        raise E.UnsupportedError(f"{name}: targets_hbm must hold integer class indices, got "
                                 f"{targets.dtype.name}")
    if not 0 < B <= nl.tile_size.pmax:
        raise E.ShapeMismatchError(f"{name}: positions_per_batch must be in (0, {nl.tile_size.pmax}], "
                                   f"got {B}")
    if chunk_size <= 0:
        raise E.ShapeMismatchError(f"{name}: chunk_size must be positive, got {chunk_size}")
    dtype = nl.float32 if nl.float32 == dtype else nl.bfloat16
    # AWS asks chunk_size <= V; a larger one simply covers the vocabulary in one tile. The
    # backward holds tiles of dtype as well as of the logits.
    item = max(logits.itemsize, dtype.itemsize if name.endswith("backward") else 0)
    return N, V, min(chunk_size, V, _TILE_BYTES // item), dtype


def _batches(N, B):
    """This program's contiguous share of the rows (the last program takes the remainder),
    in batches of B."""
    n_prog, pid = nl.num_programs(0), nl.program_id(0)
    share = N // n_prog
    lo = pid * share
    hi = N if pid == n_prog - 1 else lo + share
    return [(b0, min(B, hi - b0)) for b0 in range(lo, hi, B)]


def _load_targets(targets, bt):
    ti = nl.ndarray((bt.r, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ti, src=targets[bt.b0:bt.b0 + bt.r])
    t = nl.ndarray((bt.r, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=t, src=ti, engine=nisa.gpsimd_engine)   # VectorE is the busy one
    return t


def _dma(dst, src):
    """A tile's copy as up to four column pieces: one DMA spreads over 4 of the 16 queues, so
    pieces let a single tile use them all (the first tile arrives, and the last leaves,
    sooner); pieces keep rows of >= 4 KiB, near the queues' peak."""
    cw = dst.shape[1]
    n = max(1, min(4, cw * dst.itemsize // 4096))
    step = -(-cw // n)
    for a in range(0, cw, step):
        b = min(cw, a + step)
        nisa.dma_copy(dst=dst[:, a:b], src=src[:, a:b])


def _fwd_unit(x_hbm, t_hbm, bt, j, c0, cw, sel, ex, loss_hbm, lse_hbm, dtype):
    """Vocabulary tile j of one batch, as stages separated by ``yield``. VectorE keeps the
    running maximum m_j of tiles 0..j (negated, a column of bt.nm per tile); ScalarE keeps
    acc = sum exp(x - m_j) over them, rescaled by exp(m_{j-1} - m_j) as the maximum grows, so
    the batch's lse needs no VectorE work after the last tile."""
    r, last = bt.r, j == bt.n - 1
    f32 = nl.float32
    if j == 0:
        bt.t = _load_targets(t_hbm, bt)
        bt.nm = nl.ndarray((r, bt.n), dtype=f32, buffer=nl.sbuf)   # -(running max) per tile
        bt.tl = nl.ndarray((r, bt.n), dtype=f32, buffer=nl.sbuf)   # target logit, or _NEG
        bt.acc = nl.ndarray((r, 1), dtype=f32, buffer=nl.sbuf)
    x = nl.ndarray((r, cw), dtype=x_hbm.dtype, buffer=nl.sbuf)
    _dma(x, x_hbm[bt.b0:bt.b0 + r, c0:c0 + cw])
    yield 1
    nisa.range_select(dst=sel[0:r, 0:cw], on_true_tile=x, comp_op0=nl.greater_equal,
                      comp_op1=nl.less_equal, bound0=bt.t, bound1=bt.t, reduce_res=bt.tl[:, j:j + 1],
                      reduce_op=nl.maximum, range_start=c0, on_false_value=_NEG)
    if last:
        bt.tgt = nl.ndarray((r, 1), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=bt.tgt, op=nl.maximum, data=bt.tl, axis=1)
    # GpSimd folds the tile in halves (elementwise max) so VectorE's max reads a fraction of it
    folded, u = x, cw
    for level in range(_fold_levels(cw, x.itemsize)):
        src, u = folded, u // 2
        if level == 0:
            folded = nl.ndarray((r, u), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=folded[:, 0:u], data1=src[:, 0:u], data2=src[:, u:2 * u],
                           op=nl.maximum, engine=nisa.gpsimd_engine)
    yield 2
    nm = bt.nm[:, j:j + 1]
    tile_nm = nl.ndarray((r, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=tile_nm, op=nl.maximum, data=folded[:, 0:u], axis=1, negate=True)
    if j == 0:   # finite even for a tile of -inf logits, so exp(x - m) stays 0, not NaN
        nisa.tensor_scalar(dst=nm, data=tile_nm, op0=nl.minimum, operand0=-_NEG)
    else:
        nisa.tensor_tensor(dst=nm, data1=tile_nm, data2=bt.nm[:, j - 1:j], op=nl.minimum)
    yield 1
    s = bt.acc if j == 0 else nl.ndarray((r, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=ex[0:r, 0:cw], op=nl.exp, data=x, bias=nm, reduce_op=nl.add, reduce_res=s)
    if j > 0:
        corr = nl.ndarray((r, 1), dtype=f32, buffer=nl.sbuf)     # exp(m_{j-1} - m_j)
        nisa.activation(dst=corr, op=nl.exp, data=bt.nm[:, j - 1:j], scale=-1.0, bias=nm)
        nisa.activation(dst=bt.acc, op=nl.identity, data=bt.acc, scale=corr, bias=s)
    if last:
        _fwd_finish(bt, loss_hbm, lse_hbm, dtype)


def _fwd_finish(bt, loss_hbm, lse_hbm, dtype):
    """lse = m + log(acc); loss = lse - x_target. All on ScalarE."""
    r = bt.r
    f32 = nl.float32
    log_acc = nl.ndarray((r, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=log_acc, op=nl.log, data=bt.acc)
    lse = nl.ndarray((r, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=lse, op=nl.identity, data=bt.nm[:, bt.n - 1:bt.n], scale=-1.0, bias=log_acc)
    loss = nl.ndarray((r, 1), dtype=dtype, buffer=nl.sbuf)
    nisa.activation(dst=loss, op=nl.identity, data=bt.tgt, scale=-1.0, bias=lse)
    if dtype != f32:
        lse_o = nl.ndarray((r, 1), dtype=dtype, buffer=nl.sbuf)
        nisa.activation(dst=lse_o, op=nl.copy, data=lse)
        lse = lse_o
    nisa.dma_copy(dst=loss_hbm[bt.b0:bt.b0 + r], src=loss)
    nisa.dma_copy(dst=lse_hbm[bt.b0:bt.b0 + r], src=lse)


def _fold_levels(width, itemsize):
    """How many times GpSimd halves a tile before VectorE reduces it: while GpSimd's work
    stays below VectorE's (its target select plus the reduce of what is left; VectorE runs
    at 0.8x GpSimd's clock on trn2). An elementwise max of fp32 costs two cycles per output,
    of bf16 one."""
    g, u, n = 0, width, 0
    per = 1 if itemsize == 2 else 2
    while u % 2 == 0 and u >= 256:
        cost = u // 2 * per
        if g + cost > 1.25 * (width + u // 2):
            break
        g, u, n = g + cost, u // 2, n + 1
    return n


def _bwd_unit(c, bt, j, c0, cw):
    """Vocabulary tile j of one batch of the backward, as stages separated by ``yield``."""
    r = bt.r
    if j == 0:
        t = _load_targets(c.t, bt)
        lse = nl.ndarray((r, 1), dtype=c.lse.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=lse, src=c.lse[bt.b0:bt.b0 + r])
        bt.bias = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)   # log g - lse
        nisa.activation(dst=bt.bias, op=nl.identity, data=lse, scale=-1.0, bias=math.log(c.g))
        bt.tt = nl.ndarray((r, bt.n), dtype=nl.float32, buffer=nl.sbuf)  # target - c0 per tile
        nisa.tensor_scalar(dst=bt.tt, data=c.starts[0:r, :], op0=nl.add, operand0=t,
                           engine=nisa.gpsimd_engine)
    x = nl.ndarray((r, cw), dtype=c.x.dtype, buffer=nl.sbuf)
    _dma(x, c.x[bt.b0:bt.b0 + r, c0:c0 + cw])
    oh = nl.ndarray((r, cw), dtype=c.dtype, buffer=nl.sbuf)     # -g at the target, else 0
    nisa.tensor_scalar(dst=oh, data=c.cols[0:r, 0:cw], op0=nl.equal, operand0=bt.tt[:, j:j + 1],
                       op1=nl.multiply, operand1=-c.g, engine=nisa.gpsimd_engine)
    yield 1
    p = x if x.dtype == c.dtype else nl.ndarray((r, cw), dtype=c.dtype, buffer=nl.sbuf)
    nisa.activation(dst=p, op=nl.exp, data=x, bias=bt.bias)    # g * softmax
    yield 1
    nisa.tensor_tensor(dst=p, data1=p, data2=oh, op=nl.add)
    yield 1
    _dma(c.grad[bt.b0:bt.b0 + r, c0:c0 + cw], p)
