"""FlashAttention backward: AWS's ``attention_bwd``.

Layouts follow AWS's kernel: q, o and dy are (B, H, d, Sq), k and v (B, Hkv, d, Skv), the
log-sum-exp of the forward's scaled scores (B, H, 128, Sq // 128) with query g*128 + p at
[b, h, p, g] (``attention_cte(..., cache_softmax=True)`` gives it as
``-(neg_max + log(sum_recip))``). Sq is a multiple of 128, as AWS requires for that layout;
Skv is any length. Returns (dq, dk, dv) in the layouts of q, k and v. H a multiple of Hkv is
grouped-query attention: the gradients of a kv head sum over its query heads.

The probabilities are recomputed per unit (a 128-query block against up to 512 keys, 256
for fp32) from the log-sum-exp, never stored: P = exp(scale * q.k - lse), dP = dy.v,
dS = P * (dP - rowsum(dy * o)); then dv += P^T dy, dk += scale * dS^T q (both accumulated in
PSUM over the query blocks of a key block) and dq += scale * dS k (in SBUF over the key
blocks), all three transposed, (d, sequence) as they are stored, so that the stores need no
transposes. One pipeline runs every head: the next head's loads are issued among the
current head's units where SBUF holds both, and query sequences too long for SBUF beside
their kv head run as segments of query blocks. A unit of 512 keys makes each hand-off
between engines carry four 128 x 128 blocks (the ~1.3 us semaphore waits, not the
engines, bounded 128 x 128 units). Key sub-blocks a
causal or sliding-window mask removes entirely are skipped; where a mask cuts through a
unit, TensorE adds it into the scores' PSUM. All accumulation is fp32 (``mixed_precision``
is accepted for AWS's signature; it is always on here).
"""
from __future__ import annotations

from types import SimpleNamespace as _Cfg
from types import SimpleNamespace as _Head       # a head's query rows (or a segment of them)
from types import SimpleNamespace as _KeyBlock   # a key block's dv/dk accumulation state

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..utils.dma import runs
from ..utils.masks import identity, mask_tile
from ..utils.pipeline import pipeline as _pipeline
from ..utils.refuse import refuse_given


@nki.jit
def attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                  bound_max=None, use_causal_mask=False, mixed_precision=False,
                  softmax_scale=None, sliding_window=None):
    refuse_given("attention_bwd", (("attention sinks", sinks_ref),
                                   ("sequence packing (bound_min)", bound_min),
                                   ("sequence packing (bound_max)", bound_max)))
    P = nl.tile_size.pmax
    B, H, d, Sq = q_ref.shape
    Hkv, Skv = k_ref.shape[1], k_ref.shape[3]
    if Sq % P:
        raise E.ShapeMismatchError(f"attention_bwd: seqlen_q {Sq} must be a multiple of {P} "
                                   f"(the log-sum-exp layout (B, H, {P}, Sq // {P}))")
    if d > P:
        raise E.ShapeMismatchError(f"attention_bwd: head dim {d} > {P}")
    if H % Hkv:
        raise E.ShapeMismatchError(f"attention_bwd: {H} query heads are not a multiple of "
                                   f"{Hkv} key/value heads")
    for name, t, want in (("v_ref", v_ref, (B, Hkv, d, Skv)), ("o_ref", o_ref, (B, H, d, Sq)),
                          ("dy_ref", dy_ref, (B, H, d, Sq)),
                          ("lse_ref", lse_ref, (B, H, P, Sq // P))):
        if tuple(t.shape) != want:
            raise E.ShapeMismatchError(f"attention_bwd: {name} {tuple(t.shape)} must be {want}")
    scale = float(softmax_scale) if softmax_scale else 1.0 / float(d) ** 0.5
    window = int(sliding_window or 0)
    dt = q_ref.dtype
    mm_dtype = nl.float32 if dt == nl.float32 else nl.bfloat16
    dq = nl.ndarray((B, H, d, Sq), dtype=dt, buffer=nl.shared_hbm)
    dk = nl.ndarray((B, Hkv, d, Skv), dtype=k_ref.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((B, Hkv, d, Skv), dtype=v_ref.dtype, buffer=nl.shared_hbm)
    Gq, Gk = Sq // P, (Skv + P - 1) // P
    group = H // Hkv
    n_prog, pid = nl.num_programs(0), nl.program_id(0)
    isz = 4 if mm_dtype == nl.float32 else 2
    c = _Cfg(d=d, scale=scale, causal=use_causal_mask, window=window, mm_dtype=mm_dtype,
             width=_WIDTH if isz == 2 else _WIDTH // 2, ticks=_TICKS)
    c.nsub = c.width // P
    c.masks, c.ones, c.n = {}, None, 0
    c.refs = (q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref)
    c.outs = (dq, dk, dv)
    # SBUF bytes per partition a kv head's tiles take (K and V, K sequence-major, the dk and
    # dv accumulators), and per query a head's (q and dy both ways, dq's accumulator, o).
    # Long query sequences run as segments that fit beside the kv head; where two heads (or
    # segments) fit at once, the next one's loads are issued inside the current one's
    # pipeline (its first units then find them ready); else it waits for the current one
    # to store its gradients.
    kv_bytes = Skv * (2 * isz + 8) + Gk * d * isz
    per_query = 5 * isz + 4
    room = _SBUF_BYTES - kv_bytes - _DQ_CHUNK * 4
    if room < P * per_query:
        raise E.SbufCapacityError(f"attention_bwd: {Skv} keys need {kv_bytes} bytes per "
                                  f"partition of SBUF beside one query block; at most "
                                  f"{_SBUF_BYTES} (shorter key sequences or split the call)")
    seg = min(Sq, room // per_query // P * P)
    overlap = 2 * (seg * per_query + kv_bytes) <= _OVERLAP_BYTES
    order, last_pro = [], -1
    for b in range(B):
        for hk in range(Hkv):
            if (b * Hkv + hk) % n_prog != pid:
                continue
            kv = _Cfg(b=b, hk=hk)
            for h in range(hk * group, (hk + 1) * group):
                for s0 in range(0, Sq, seg):
                    x = _Head(kv=kv, b=b, h=h, s0=s0, sq=min(seg, Sq - s0))
                    pro = _prologue(c, x, h == hk * group and s0 == 0)
                    if overlap:
                        at = max(last_pro + 1, len(order) - _PROLOGUE_TICKS - 1)
                    else:
                        order += [_idle()] * (sum(_TICKS) + 2)   # the last one's stores first
                        at = len(order)
                    order.insert(at, pro)
                    last_pro = at
                    order += [_idle()] * max(0, _PROLOGUE_TICKS + 1 - (len(order) - at - 1))
                    for k0 in range(0, Skv, c.width):
                        kb = _KeyBlock(k0=k0, w=min(c.width, Skv - k0), started=set())
                        units = [(i, _cols(c, s0 + i * P, kb)) for i in range(x.sq // P)]
                        units = [(i, cols) for i, cols in units if cols[0] < cols[1]]
                        for n, (i, cols) in enumerate(units):
                            order.append(_unit(c, x, kb, i, cols, n == len(units) - 1))
                    last = h == (hk + 1) * group - 1 and s0 + seg >= Sq
                    order.append(_epilogue(c, x, last))
                    del x
    _rings(c)
    _pipeline(order)
    return dq, dk, dv


def _prologue(c, x, first_of_kv):
    """A head's (or query segment's) loads, and its kv head's for the first of a group,
    the sequence-major copies among them by DMA transposes; then, ``_PROLOGUE_TICKS`` ticks
    later so that no engine waits in program order for a DMA, what engines do with them
    (conversions, fp32's TensorE transposes, rowsum(dy * o))."""
    P, d, mm = nl.tile_size.pmax, c.d, c.mm_dtype
    q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref = c.refs
    b, h, kv = x.b, x.h, x.kv
    Skv = k_ref.shape[3]
    s0, Sq = x.s0, x.sq
    Gq = Sq // P
    q_src, dy_src = q_ref[b, h, :, s0:s0 + Sq], dy_ref[b, h, :, s0:s0 + Sq]
    # in the order the first units need them: K and Q (scores), V and dy (dP), o (dS),
    # the sequence-major copies (dv, dk, dq)
    if first_of_kv:
        kT = _dma_in(k_ref[b, kv.hk])
    qT = _dma_in(q_src)
    if first_of_kv:
        vT = _dma_in(v_ref[b, kv.hk])
    dyT = _dma_in(dy_src)
    x.neg_lse = nl.ndarray((P, Gq), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x.neg_lse, src=lse_ref[b, h, :, s0 // P:s0 // P + Gq])
    oT = _dma_in(o_ref[b, h, :, s0:s0 + Sq])
    rows = {"q": _rows_dma(q_src, d, Sq), "dy": _rows_dma(dy_src, d, Sq),
            "k": _rows_dma(k_ref[b, kv.hk], d, Skv) if first_of_kv else None}
    yield _PROLOGUE_TICKS - 3
    if first_of_kv:
        kv.kT, kv.vT = _as(kT, mm), _as(vT, mm)
        kv.k_rows = _rows(rows["k"], kv.kT, d, Skv, mm)     # (128, Gk, d)
        # dk and dv accumulate transposed, (d, Skv) as they are stored
        kv.dk_acc = nl.ndarray((d, Skv), dtype=nl.float32, buffer=nl.sbuf)
        kv.dv_acc = nl.ndarray((d, Skv), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=kv.dk_acc, value=0.0, engine=nisa.gpsimd_engine)
        nisa.memset(dst=kv.dv_acc, value=0.0, engine=nisa.gpsimd_engine)
    x.kT, x.vT, x.k_rows, x.dk_acc, x.dv_acc = kv.kT, kv.vT, kv.k_rows, kv.dk_acc, kv.dv_acc
    yield 1
    x.qT, x.dyT = _as(qT, mm), _as(dyT, mm)
    x.q_rows = _rows(rows["q"], x.qT, d, Sq, mm)
    yield 1
    x.dy_rows = _rows(rows["dy"], x.dyT, d, Sq, mm)
    yield 1
    # -lse per query, queries on partitions; rowsum(dy * o): the product on GpSimd in the
    # stored layout (d, Sq), its sums over d by TensorE (a matmul by ones)
    nisa.tensor_scalar(dst=x.neg_lse, data=x.neg_lse, op0=nl.multiply, operand0=-1.0,
                       engine=nisa.gpsimd_engine)
    x.Dq = _row_dots(c, x.dyT, _as(oT, mm), d, Sq)
    x.dq_acc = nl.ndarray((d, Sq), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=x.dq_acc, value=0.0, engine=nisa.gpsimd_engine)


def _epilogue(c, x, last_of_kv):
    """A head's dq stored once its last unit has added into it, and its kv head's dk and dv
    after the group's last head (casts on GpSimd, off the pipeline's engines)."""
    yield sum(_TICKS) + 1
    q_ref, k_ref, v_ref = c.refs[:3]
    dq, dk, dv = c.outs
    _store(dq[x.b, x.h, :, x.s0:x.s0 + x.sq], x.dq_acc, c.scale, q_ref.dtype)
    if last_of_kv:
        _store(dk[x.b, x.kv.hk], x.dk_acc, c.scale, k_ref.dtype)
        _store(dv[x.b, x.kv.hk], x.dv_acc, 1.0, v_ref.dtype)


def _idle():
    """A pipeline slot with no work: one tick's delay."""
    return
    yield


# Keys per unit: one 2 KiB PSUM bank of fp32 scores for 16-bit inputs (half for fp32, whose
# dS^T transposes take twice the PSUM). A unit of 128 queries against 512 keys makes each
# hand-off between engines carry four 128 x 128 blocks of work.
_WIDTH = 512
# Ticks between a unit's stages (S -> exp -> dP -> dS -> dv/dk/dS^T -> copy -> dq -> add).
# The hops a PSUM tile carries get one tick, so that its ring needs two slots (PSUM holds
# two of each beside the dv/dk accumulators); the SBUF hops into TensorE get two, which
# hides the semaphore wait. Measured on trn2, S=2048: 156 us against 174 us with every hop
# one tick. A ring has one slot more than the ticks its tile is held: its writer then
# waits for the reader two units back, not the one before.
_TICKS = (1, 1, 1, 2, 1, 2, 1)
# Ticks from a head's loads to its first unit (a head's 4 MiB of bf16 loads at S=2048 take
# about 12-17 us of the 16 DMA queues; units run 1.5-2 us per tick).
_PROLOGUE_TICKS = 8
# SBUF per partition two heads may hold at once (of 192 KiB: the rings, masks and
# temporaries take the rest).
_OVERLAP_BYTES = 144 * 1024
# SBUF per partition for one head (or segment of one) and its kv head: of 192 KiB, the
# rings (14 KiB), masks and the constants take the rest.
_SBUF_BYTES = 168 * 1024
# Queries per chunk of the product dy * o (fp32 on GpSimd) whose sums give rowsum(dy * o).
_DQ_CHUNK = 512
_BANK_BYTES = 2048


def _rings(c):
    """PSUM and SBUF rings of slots taken in turn by consecutive units (as attention_cte's):
    a unit's tile is read ``gap`` ticks after it is written, and the unit ``gap`` later
    writes the slot in the tick of that read (older units issue first). dv and dk
    accumulate over a key block's query blocks in one PSUM set, which the block's last unit
    adds into SBUF before the next block's first unit writes it."""
    P, w, nsub, d = nl.tile_size.pmax, c.width, c.nsub, c.d
    mm = c.mm_dtype
    t = c.ticks
    c.s_ring = nl.ndarray((P, t[0] + 1, w), dtype=nl.float32, buffer=nl.psum)
    c.dp_ring = nl.ndarray((P, t[2] + 1, w), dtype=nl.float32, buffer=nl.psum)
    c.dsT_ring = nl.ndarray((P, t[4] + 1, nsub, P), dtype=mm, buffer=nl.psum)
    c.dq_ring = nl.ndarray((d, t[6] + 1, P), dtype=nl.float32, buffer=nl.psum)
    c.dv_ps = nl.ndarray((d, w), dtype=nl.float32, buffer=nl.psum)
    c.dk_ps = nl.ndarray((d, w), dtype=nl.float32, buffer=nl.psum)
    # SBUF: P from its exp to the dv matmul, dS from its pass to the dk matmul, dS^T from its
    # copy to the dq matmul, one slot spare each
    c.p_ring = nl.ndarray((P, sum(t[1:4]) + 2, w), dtype=mm, buffer=nl.sbuf)
    c.ds_ring = nl.ndarray((P, t[3] + 2, w), dtype=mm, buffer=nl.sbuf)
    c.dsT_sb = nl.ndarray((P, t[5] + 2, nsub, P), dtype=mm, buffer=nl.sbuf)


def _cols(c, q0, kb):
    """The columns [lo, hi) of key block ``kb`` that any query of the block at q0 keeps,
    whole 128-key sub-blocks (masks cut inside them)."""
    P = nl.tile_size.pmax
    lo, hi = 0, kb.w
    if c.causal:
        hi = min(hi, q0 + P - kb.k0)
    if c.window:
        lo = max(lo, q0 - c.window + 1 - kb.k0)
    if hi <= lo:
        return (0, 0)
    return (lo // P * P, min(kb.w, -(-hi // P) * P))


def _unit(c, x, kb, i, cols, last):
    """One query block against the kept columns of one key block, as pipeline stages."""
    P, d, t = nl.tile_size.pmax, c.d, c.ticks
    n, c.n = c.n, c.n + 1
    q0, k0 = i * P, kb.k0
    lo, hi = cols
    w = hi - lo
    subs = range(lo // P, -(-hi // P))
    # TensorE: scores, with the masks added by a matmul of the identity where they cut
    s_ps = c.s_ring[:, n % c.s_ring.shape[1], 0:w]
    nisa.nc_matmul(dst=s_ps, stationary=x.qT[:, q0:q0 + P], moving=x.kT[:, k0 + lo:k0 + hi])
    mask = mask_tile(c.masks, x.s0 + q0, k0 + lo, w, P, c.causal, c.window, c.mm_dtype)
    if mask is not None:
        nisa.nc_matmul(dst=s_ps, stationary=identity(c.masks, c.mm_dtype), moving=mask,
                       accumulate=True)
    yield t[0]
    # ScalarE: P = exp(scale * s - lse)
    p = c.p_ring[:, n % c.p_ring.shape[1], 0:w]
    nisa.activation(dst=p, op=nl.exp, data=s_ps, scale=c.scale, bias=x.neg_lse[:, i:i + 1])
    yield t[1]
    # TensorE: dP = dy v^T
    dp_ps = c.dp_ring[:, n % c.dp_ring.shape[1], 0:w]
    nisa.nc_matmul(dst=dp_ps, stationary=x.dyT[:, q0:q0 + P], moving=x.vT[:, k0 + lo:k0 + hi])
    yield t[2]
    # VectorE: dS = P * (dP - rowsum(dy * o))
    ds = c.ds_ring[:, n % c.ds_ring.shape[1], 0:w]
    nisa.scalar_tensor_tensor(dst=ds, data=dp_ps, op0=nl.subtract, operand0=x.Dq[:, i:i + 1],
                              op1=nl.multiply, operand1=p)
    yield t[3]
    # TensorE: dv^T += dy^T P and dk^T += q^T dS (contraction over the queries), per 128 keys
    # (a PSUM accumulation group is one region), and dS^T for dq
    for sb in subs:
        a0, a1 = sb * P, min(kb.w, sb * P + P)
        for acc, lhs, rhs in ((c.dv_ps, x.dy_rows, p), (c.dk_ps, x.q_rows, ds)):
            nisa.nc_matmul(dst=acc[:, a0:a1], stationary=lhs[:, i, :],
                           moving=rhs[:, a0 - lo:a1 - lo], accumulate=sb in kb.started)
    kb.started.update(subs)
    dsT_ps = c.dsT_ring[:, n % c.dsT_ring.shape[1]]
    for sb in subs:
        a, kw = sb * P - lo, min(P, kb.w - sb * P)
        nisa.nc_transpose(dst=dsT_ps[0:kw, sb - subs[0], :], data=ds[:, a:a + kw])
    # VectorE: the block's dv and dk into SBUF, in the next tick, before the next block's
    # first unit writes the accumulators (older units issue first)
    yield 1
    if last:
        a0, a1 = min(kb.started) * P, min(kb.w, (max(kb.started) + 1) * P)
        for acc, ps in ((x.dv_acc, c.dv_ps), (x.dk_acc, c.dk_ps)):
            nisa.tensor_tensor(dst=acc[:, k0 + a0:k0 + a1], data1=acc[:, k0 + a0:k0 + a1],
                               data2=ps[:, a0:a1], op=nl.add)
    if t[4] > 1:
        yield t[4] - 1
    # ScalarE: dS^T out of PSUM
    ns = len(subs)
    dsT = c.dsT_sb[:, n % c.dsT_sb.shape[1], 0:ns, :]
    nisa.activation(dst=dsT, op=nl.copy, data=dsT_ps[:, 0:ns, :])
    yield t[5]
    # TensorE: dq^T += k^T dS^T, contraction over the keys
    dq_ps = c.dq_ring[:, n % c.dq_ring.shape[1], :]
    j0 = k0 // P
    for m, sb in enumerate(subs):
        kw = min(P, kb.w - sb * P)
        nisa.nc_matmul(dst=dq_ps, stationary=x.k_rows[0:kw, j0 + sb, :], moving=dsT[0:kw, m, :],
                       accumulate=m > 0)
    yield t[6]
    nisa.tensor_tensor(dst=x.dq_acc[:, q0:q0 + P], data1=x.dq_acc[:, q0:q0 + P], data2=dq_ps,
                       op=nl.add)


def _row_dots(c, aT, bT, d, S):
    """sum over d of aT * bT (d, S), as (128, S // 128): query g*128 + p at [p, g]."""
    P = nl.tile_size.pmax
    if c.ones is None:
        c.ones = nl.ndarray((d, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=c.ones, value=1.0, engine=nisa.gpsimd_engine)
    G = S // P
    out = nl.ndarray((P, G), dtype=nl.float32, buffer=nl.sbuf)
    per = _BANK_BYTES // 4
    for g0 in range(0, G, per):
        m = min(per, G - g0)
        d_ps = nl.ndarray((P, m), dtype=nl.float32, buffer=nl.psum)
        step = _DQ_CHUNK // P
        for u0 in range(g0, g0 + m, step):     # the product a chunk of queries at a time
            u1 = min(g0 + m, u0 + step)
            prod = nl.ndarray((d, (u1 - u0) * P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=prod, data1=aT[:, u0 * P:u1 * P], data2=bT[:, u0 * P:u1 * P],
                               op=nl.multiply, engine=nisa.gpsimd_engine)
            for g in range(u0, u1):
                nisa.nc_matmul(dst=d_ps[:, g - g0:g - g0 + 1],
                               stationary=prod[:, (g - u0) * P:(g - u0 + 1) * P], moving=c.ones)
        nisa.activation(dst=out[:, g0:g0 + m], op=nl.copy, data=d_ps)
    return out


def _dma_in(src):
    """An HBM slice into a new SBUF tile, as stored."""
    t = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
    for r0, n in runs(src.shape[0]):
        nisa.dma_copy(dst=t[r0:r0 + n], src=src[r0:r0 + n])
    return t


def _as(t, dtype):
    """t in the matmul dtype (fp16 inputs: a copy in bf16)."""
    if t.dtype == dtype:
        return t
    c = nl.ndarray(t.shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=c, src=t)
    return c


def _rows_dma(src, d, S):
    """The (d, S) HBM slice ``src`` block by block transposed into (128, blocks, d),
    sequence on partitions, by DMA transposes (no engine time, and no PSUM, which the
    pipeline's rings hold); None for 4-byte dtypes, which DMA does not transpose."""
    if src.dtype.itemsize != 2:
        return None
    P = nl.tile_size.pmax
    n = (S + P - 1) // P
    out = nl.ndarray((P, n, d), dtype=src.dtype, buffer=nl.sbuf)
    whole = S // P
    if whole:
        nisa.dma_transpose(dst=out[:, 0:whole, :],
                           src=src[:, 0:whole * P].reshape((d, whole, P)), axes=(2, 1, 0))
    if whole < n:
        w = S - whole * P
        nisa.dma_transpose(dst=out[0:w, whole, :], src=src[:, whole * P:S])
    return out


def _rows(by_dma, tT, d, S, dtype):
    """(128, blocks, d) in the matmul dtype: ``by_dma`` (``_rows_dma``'s) converted, or for
    fp32 the (d, S) tile ``tT`` transposed by TensorE, a PSUM bank of blocks at a time,
    copied out by ScalarE and VectorE in turn."""
    if by_dma is not None:
        return _as(by_dma, dtype)
    P = nl.tile_size.pmax
    n = (S + P - 1) // P
    out = nl.ndarray((P, n, d), dtype=dtype, buffer=nl.sbuf)
    per = max(1, _BANK_BYTES // (d * dtype.itemsize))
    for t, j0 in enumerate(range(0, n, per)):
        m = min(per, n - j0)
        t_ps = nl.ndarray((P, m, d), dtype=dtype, buffer=nl.psum)
        for j in range(j0, j0 + m):
            w = min(P, S - j * P)
            nisa.nc_transpose(dst=t_ps[0:w, j - j0, :], data=tT[:, j * P:j * P + w])
        whole = m if S >= (j0 + m) * P else m - 1
        if whole:
            _copy(out[:, j0:j0 + whole, :], t_ps[:, 0:whole, :], t)
        if whole < m:       # a partial last block: its rows only
            w = S - (j0 + whole) * P
            _copy(out[0:w, j0 + whole, :], t_ps[0:w, whole, :], t + 1)
    return out


def _copy(dst, src, turn):
    if turn % 2:
        nisa.tensor_copy(dst=dst, src=src)
    else:
        nisa.activation(dst=dst, op=nl.copy, data=src)


def _store(dst, acc, scale, dtype):
    """acc (d, S) fp32 times scale, in dst's dtype, stored to dst (d, S) by one DMA."""
    t = nl.ndarray(acc.shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t, data=acc, op0=nl.multiply, operand0=scale,
                       engine=nisa.gpsimd_engine)
    nisa.dma_copy(dst=dst, src=t)


