"""Top-k along the last dimension: AWS's ``rotational_topk`` (and its ``topk`` launcher).

``rotational_topk(inp, config)`` takes inp [BxS, V] in HBM (fp32 or bf16) and a
``RotationalTopkConfig`` from ``create_rotational_topk_config``; it returns the k largest
values of each row, descending, in the input dtype, and their indices (uint32), each
[BxS, k] (the leading shape of ``config.topk_config.inp_shape`` when that is 3-D). The
output is sorted whatever ``sorted`` asks (a sorted top-k is a valid unsorted one); among
equal values the earlier index comes first. Rows are split over an LNC launch
(``rotational_topk[2]``) as the config planned.

How: every round VectorE's ``max8`` takes the 8 largest values left in each partition and
``nc_match_replace8`` reports where they were and knocks them out (-inf), so ceil(k/8)
rounds give a sorted top-k with exact indices, ties included. A row's vocabulary is cut into
stages on separate partitions (see ``rotational_topk_utils``), so that few rows still fill
the partitions and long rows respect the 16384-element limit of both instructions. With
several stages the per-stage winners meet in one partition through an HBM round trip (one
DMA each way; AWS's kernel rotates them between partitions with matmuls instead); the final
rounds run over those candidates and a ``range_select`` per output fetches the global index
at the winning position.
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..utils.pipeline import pipeline as _pipeline
from .rotational_topk_utils import (  # noqa: F401  (AWS's module exposes these here too)
    RotationalTopkConfig,
    TopkConfig,
    create_rotational_topk_config,
    create_topk_config,
)

_NEG = float("-inf")


@nki.jit
def rotational_topk(inp, config):
    """The k largest elements of each row of inp [BxS, V] and their indices, per ``config``."""
    cfg = config
    if not isinstance(cfg, RotationalTopkConfig):
        raise E.UnsupportedError(f"rotational_topk: config must be a RotationalTopkConfig (from "
                                 f"create_rotational_topk_config), got {type(cfg).__name__}")
    if tuple(inp.shape) != tuple(cfg.inp_shape):
        if inp.ndim > 2 and tuple(inp.shape) == tuple(cfg.topk_config.inp_shape):
            inp = inp.reshape((cfg.BxS, cfg.vocab_size))
        else:
            raise E.ShapeMismatchError(f"rotational_topk: input {tuple(inp.shape)} does not match the "
                                       f"config's {tuple(cfg.inp_shape)}")
    if inp.dtype not in (nl.float32, nl.bfloat16):
        raise E.UnsupportedError(f"rotational_topk: input dtype must be float32 or bfloat16, got "
                                 f"{inp.dtype.name}")
    n_prog, pid = nl.num_programs(0), nl.program_id(0)
    if cfg.n_prgs > 1 and n_prog != cfg.n_prgs:
        raise E.ShapeMismatchError(f"rotational_topk: the config plans {cfg.n_prgs} programs, the "
                                   f"launch has {n_prog} (use rotational_topk[{cfg.n_prgs}])")
    BxS, k = cfg.BxS, cfg.orig_k
    values = nl.ndarray((BxS, k), dtype=inp.dtype, buffer=nl.shared_hbm)
    indices = nl.ndarray((BxS, k), dtype=nl.uint32, buffer=nl.shared_hbm)
    # A single-program plan is run whole by every program (AWS's rule for one row).
    lo = 0 if cfg.n_prgs == 1 else pid * cfg.per_lnc_BxS
    hi = BxS if cfg.n_prgs == 1 else min(BxS, lo + cfg.per_lnc_BxS)
    bases = {}
    units = [_tile(inp, cfg, b0, min(cfg.tile_size, hi - b0), values, indices, bases)
             for b0 in range(lo, hi, cfg.tile_size)]
    _pipeline(units)
    out_shape = cfg.topk_config.out_shape
    if len(out_shape) != 2:
        return values.reshape(out_shape), indices.reshape(out_shape)
    return values, indices


def topk(inp, k, sorted_flag=True, lnc=None):
    """AWS's launcher: the k largest along the last dim of inp (NumPy or torch, 2-D or more),
    over ``lnc`` programs; returns (values, indices) shaped like inp with k last."""
    n = int(lnc or 1)
    tc = create_topk_config(inp_shape=tuple(inp.shape), inp_dtype=inp.dtype, k=k, sorted=sorted_flag,
                            num_programs=n)
    cfg = create_rotational_topk_config(inp_shape=(tc.BxS, tc.vocab_size), topk_config=tc)
    kernel = rotational_topk[tc.n_prgs] if tc.n_prgs > 1 else rotational_topk
    return kernel(inp, cfg)


def prepare_rotational_constants(config):
    """AWS's harness step before a launch; our constants are built on chip, so a no-op."""
    return config


def cleanup_rotational_constants():
    """AWS's harness step after a launch; nothing to clean up here."""


def _tile(inp, cfg, b0, r, values, indices, bases):
    """Rows b0..b0+r: load folded into stages, local top-k, merge, store (stages of a unit)."""
    S, kk, F, V, k = cfg.n_stages, cfg.local_top_k_per_stage, cfg.stage_free_size, cfg.vocab_size, cfg.orig_k
    P = S * r
    Fa = max(F, 8)                       # max8 reads at least 8 elements
    last_w = V - (S - 1) * F             # elements in the last stage
    data = nl.ndarray((P, Fa), dtype=inp.dtype, buffer=nl.sbuf)
    if last_w < Fa:      # stage padding: -inf never wins while real values remain
        nisa.memset(dst=data[:, last_w:Fa], value=_NEG, engine=nisa.gpsimd_engine)
    _load_stages(inp, data, b0, r, S, F, V, last_w)
    base = _stage_base(bases, r, S, kk, F) if S > 1 else None
    yield 1
    rounds = kk // 8
    vals = nl.ndarray((P, kk), dtype=inp.dtype, buffer=nl.sbuf)
    idx = nl.ndarray((P, kk), dtype=nl.uint32, buffer=nl.sbuf)
    _topk_rounds(data, vals, idx, rounds)
    if S == 1:
        yield 1
        nisa.dma_copy(dst=values[b0:b0 + r, :], src=vals[:, 0:k])
        nisa.dma_copy(dst=indices[b0:b0 + r, :], src=idx[:, 0:k])
        return
    yield 1
    # Stage s of row b is partition s*r + b: through HBM, row b's candidates land side by side.
    mv = nl.ndarray((r, S, kk), dtype=inp.dtype, buffer=nl.sbuf)
    mi = nl.ndarray((r, S, kk), dtype=nl.uint32, buffer=nl.sbuf)
    for src, dst in ((vals, mv), (idx, mi)):
        spill = nl.ndarray((P, kk), dtype=src.dtype, buffer=nl.private_hbm)
        nisa.dma_copy(dst=spill, src=src)
        nisa.dma_copy(dst=dst, src=spill.ap(pattern=[[kk, r], [kk * r, S], [1, kk]]))
    yield 1
    # global index of each candidate (GpSimd, beside VectorE's final rounds)
    gi = nl.ndarray((r, S, kk), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=gi, data1=mi, data2=base, op=nl.add, engine=nisa.gpsimd_engine)
    fr = -(-k // 8)
    fv = nl.ndarray((r, 8 * fr), dtype=inp.dtype, buffer=nl.sbuf)
    pos = nl.ndarray((r, 8 * fr), dtype=nl.uint32, buffer=nl.sbuf)
    _topk_rounds(mv, fv, pos, fr)
    posf = nl.ndarray((r, k), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=posf, src=pos[:, 0:k])
    # out index j = the global index at position pos_j (the max over a one-element range)
    gidx = nl.ndarray((r, k), dtype=nl.float32, buffer=nl.sbuf)
    scratch = nl.ndarray((r, S, kk), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(k):
        nisa.range_select(dst=scratch, on_true_tile=gi, comp_op0=nl.greater_equal,
                          comp_op1=nl.less_equal, bound0=posf[:, j:j + 1], bound1=posf[:, j:j + 1],
                          reduce_res=gidx[:, j:j + 1], reduce_op=nl.maximum, on_false_value=-1.0)
    io = nl.ndarray((r, k), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=io, src=gidx)
    yield 1
    nisa.dma_copy(dst=values[b0:b0 + r, :], src=fv[:, 0:k])
    nisa.dma_copy(dst=indices[b0:b0 + r, :], src=io)


def _load_stages(inp, data, b0, r, S, F, V, last_w):
    """data[s*r + b, :] = inp[b0 + b, s*F : (s+1)*F]: whole stages in up to four DMAs (each
    spreads over 4 of the 16 queues), the short last stage in one more; a single stage in up
    to four column pieces of >= 4 KiB rows."""
    full = S if last_w == F else S - 1
    if S == 1:
        step = -(-V // max(1, min(4, V * data.itemsize // 4096)))
        for a in range(0, V, step):
            nisa.dma_copy(dst=data[:, a:min(V, a + step)], src=inp[b0:b0 + r, a:min(V, a + step)])
        return
    step = -(-full // 4)
    for s0 in range(0, full, step):
        n = min(step, full - s0)
        nisa.dma_copy(dst=data[s0 * r:(s0 + n) * r, 0:F],
                      src=inp.ap(pattern=[[F, n], [V, r], [1, F]], offset=b0 * V + s0 * F))
    if full < S:
        nisa.dma_copy(dst=data[full * r:S * r, 0:last_w], src=inp[b0:b0 + r, full * F:V])


def _stage_base(bases, r, S, kk, F):
    """[r, S, kk] holding s*F, the first global index of stage s, built once on GpSimd."""
    key = (r, S, kk)
    if key not in bases:
        base = nl.ndarray((r, S, kk), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=base, pattern=[[F, S], [0, kk]], offset=0, channel_multiplier=0)
        bases[key] = base
    return bases[key]


def _topk_rounds(data, vals, idx, rounds):
    """``rounds`` rounds of the 8 largest left in each partition of data (knocked out in place):
    values descending into vals[:, 8i:8i+8], their positions into idx."""
    for i in range(rounds):
        sl = slice(8 * i, 8 * i + 8)
        nisa.max8(dst=vals[:, sl], src=data)
        nisa.nc_match_replace8(dst=data, data=data, vals=vals[:, sl], imm=_NEG, dst_idx=idx[:, sl])
