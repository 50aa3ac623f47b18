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
transposes. A unit of 512 keys makes each hand-off between engines carry four 128 x 128 blocks
(the ~1.3 us semaphore waits, not the engines, bounded 128 x 128 units). Key sub-blocks a
causal or sliding-window mask removes entirely are skipped; where a mask cuts through a
unit, TensorE adds it into the scores' PSUM. All accumulation is fp32 (``mixed_precision``
is accepted for AWS's signature; it is always on here).
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

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
    # SBUF bytes per partition a head's operands and dq accumulator take, and a kv head's:
    # heads are pipelined together in chunks that fit (short sequences: many heads at once,
    # so one head's waits overlap the others' work).
    head_bytes = 2 * Sq * isz + Gq * d * (2 * isz + 4)
    kv_bytes = 2 * Skv * isz + Gk * d * (isz + 8)
    chunk = _Chunk(c)
    for b in range(B):
        for hk in range(Hkv):
            if (b * Hkv + hk) % n_prog != pid:
                continue
            chunk.make_room(kv_bytes + head_bytes)
            chunk.used += kv_bytes
            kT = _load(k_ref[b, hk], d, Skv, mm_dtype)          # (d, Skv)
            vT = _load(v_ref[b, hk], d, Skv, mm_dtype)
            k_rows = _rows(kT, d, Skv, mm_dtype)                 # (128, Gk, d)
            # dk and dv accumulate transposed, (d, Skv) as they are stored
            dk_acc = nl.ndarray((d, Skv), dtype=nl.float32, buffer=nl.sbuf)
            dv_acc = nl.ndarray((d, Skv), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=dk_acc, value=0.0, engine=nisa.gpsimd_engine)
            nisa.memset(dst=dv_acc, value=0.0, engine=nisa.gpsimd_engine)
            for h in range(hk * group, (hk + 1) * group):
                chunk.make_room(head_bytes)
                chunk.used += head_bytes
                x = _Head(kT=kT, vT=vT, k_rows=k_rows, dk_acc=dk_acc, dv_acc=dv_acc)
                x.qT = _load(q_ref[b, h], d, Sq, mm_dtype)
                x.dyT = _load(dy_ref[b, h], d, Sq, mm_dtype)
                x.q_rows = _rows(x.qT, d, Sq, mm_dtype)
                x.dy_rows = _rows(x.dyT, d, Sq, mm_dtype)
                # -lse per query, queries on partitions (GpSimd: VectorE's queue is
                # behind the transposes' copies)
                x.neg_lse = nl.ndarray((P, Gq), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=x.neg_lse, src=lse_ref[b, h])
                nisa.tensor_scalar(dst=x.neg_lse, data=x.neg_lse, op0=nl.multiply,
                                   operand0=-1.0, engine=nisa.gpsimd_engine)
                # rowsum(dy * o): the product on GpSimd in the stored layout (d, Sq), its
                # sums over d by TensorE (a matmul by ones), queries on partitions
                x.Dq = _row_dots(c, x.dyT, _load(o_ref[b, h], d, Sq, mm_dtype), d, Sq)
                x.dq_acc = nl.ndarray((d, Sq), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=x.dq_acc, value=0.0, engine=nisa.gpsimd_engine)
                for k0 in range(0, Skv, c.width):
                    kb = _KeyBlock(k0=k0, w=min(c.width, Skv - k0), started=set())
                    units = [(i, _cols(c, i * P, kb)) for i in range(Gq)]
                    units = [(i, cols) for i, cols in units if cols[0] < cols[1]]
                    for n, (i, cols) in enumerate(units):
                        chunk.units.append(_unit(c, x, kb, i, cols, n == len(units) - 1))

                def store_dq(b=b, h=h, dq_acc=x.dq_acc):
                    _store(dq[b, h], dq_acc, scale, dt, nisa.vector_engine)
                chunk.after.append(store_dq)

            def store_dkv(b=b, hk=hk, dk_acc=dk_acc, dv_acc=dv_acc):
                _store(dk[b, hk], dk_acc, scale, k_ref.dtype, nisa.scalar_engine)
                _store(dv[b, hk], dv_acc, 1.0, v_ref.dtype, nisa.gpsimd_engine)
            chunk.after.append(store_dkv)
    chunk.flush()
    return dq, dk, dv


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
_CHUNK_BYTES = 64 * 1024
_BANK_BYTES = 2048


class _Chunk:
    """Units of several heads pipelined together, and the stores that follow them."""

    def __init__(self, c):
        self.c, self.units, self.after, self.used = c, [], [], 0

    def make_room(self, nbytes):
        if self.units and self.used + nbytes > _CHUNK_BYTES:
            self.flush()

    def flush(self):
        # the rings live while the units run, so that the prologues' and the stores'
        # transposes have PSUM
        _rings(self.c)
        _pipeline(self.units)
        _rings(self.c, free=True)
        for f in self.after:
            f()
        self.units, self.after, self.used = [], [], 0


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


_Head = _KeyBlock = _Cfg


def _rings(c, free=False):
    """PSUM and SBUF rings of slots taken in turn by consecutive units (as attention_cte's):
    a unit's tile is read ``gap`` ticks after it is written, and the unit ``gap`` later
    writes the slot in the tick of that read (older units issue first). dv and dk
    accumulate over a key block's query blocks in one PSUM set, which the block's last unit
    adds into SBUF before the next block's first unit writes it."""
    names = ("s_ring", "dp_ring", "dsT_ring", "dq_ring", "dv_ps", "dk_ps", "p_ring", "ds_ring",
             "dsT_sb")
    if free:
        for name in names:
            setattr(c, name, None)
        return
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
    mask = mask_tile(c.masks, q0, k0 + lo, w, P, c.causal, c.window, c.mm_dtype)
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
    prod = nl.ndarray((d, S), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod, data1=aT, data2=bT, op=nl.multiply, engine=nisa.gpsimd_engine)
    if c.ones is None:
        c.ones = nl.ndarray((d, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=c.ones, value=1.0, engine=nisa.gpsimd_engine)
    G = S // P
    out = nl.ndarray((P, G), dtype=nl.float32, buffer=nl.sbuf)
    per = _BANK_BYTES // 4
    for g0 in range(0, G, per):
        m = min(per, G - g0)
        d_ps = nl.ndarray((P, m), dtype=nl.float32, buffer=nl.psum)
        for g in range(g0, g0 + m):
            nisa.nc_matmul(dst=d_ps[:, g - g0:g - g0 + 1], stationary=prod[:, g * P:(g + 1) * P],
                           moving=c.ones)
        nisa.activation(dst=out[:, g0:g0 + m], op=nl.copy, data=d_ps)
    return out


def _load(src, d, S, mm_dtype):
    """A (d, S) HBM slice into SBUF in the matmul dtype."""
    t = nl.ndarray((d, S), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    if src.dtype == mm_dtype:
        return t
    c = nl.ndarray((d, S), dtype=mm_dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=c, src=t)
    return c


def _rows(tT, d, S, dtype):
    """(d, S) transposed block by block into (128, blocks, d): sequence on partitions. A
    PSUM bank takes several blocks' transposes, brought out by one copy (ScalarE and
    VectorE in turn)."""
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


def _store(dst, acc, scale, dtype, engine):
    """acc (d, S) fp32 times scale, in dst's dtype, stored to dst (d, S) by one DMA."""
    t = nl.ndarray(acc.shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t, data=acc, op0=nl.multiply, operand0=scale, engine=engine)
    nisa.dma_copy(dst=dst, src=t)


