"""FlashAttention backward: AWS's ``attention_bwd``.

Layouts follow AWS's kernel: q, o and dy are (B, H, d, Sq), k and v (B, Hkv, d, Skv), the
log-sum-exp of the forward's scaled scores (B, H, 128, Sq // 128) with query g*128 + p at
[b, h, p, g] (``attention_cte(..., cache_softmax=True)`` gives it as
``-(neg_max + log(sum_recip))``). Sq is a multiple of 128, as AWS requires for that layout;
Skv is any length. Returns (dq, dk, dv) in the layouts of q, k and v. H a multiple of Hkv is
grouped-query attention: the gradients of a kv head sum over its query heads.

The probabilities are recomputed per 128x128 block from the log-sum-exp, never stored:
P = exp(scale * q.k - lse), dP = dy.v, dS = P * (dP - rowsum(dy * o)); then dv += P^T dy,
dk += scale * dS^T q (both accumulated in PSUM over the query blocks of a key block) and
dq += scale * dS k (in SBUF over the key blocks). Blocks a causal or sliding-window mask
removes entirely are skipped. All accumulation is fp32 (``mixed_precision`` is accepted
for AWS's signature; it is always on here).
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..utils.pipeline import pipeline as _pipeline
from ..utils.refuse import refuse_given

_NEG = -3.0e38


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
    # SBUF bytes per partition a head's operands and dq accumulator take, and a kv head's:
    # heads are pipelined together in chunks that fit (short sequences: many heads at once,
    # so one head's waits overlap the others' work).
    head_bytes = 2 * Sq * isz + Gq * d * (2 * isz + 4)
    kv_bytes = 2 * Skv * isz + Gk * d * (isz + 8)
    chunk = _Chunk()
    for b in range(B):
        for hk in range(Hkv):
            if (b * Hkv + hk) % n_prog != pid:
                continue
            chunk.make_room(kv_bytes + head_bytes)
            chunk.used += kv_bytes
            kT = _load(k_ref[b, hk], d, Skv, mm_dtype)          # (d, Skv)
            vT = _load(v_ref[b, hk], d, Skv, mm_dtype)
            k_rows = _rows(kT, d, Skv, mm_dtype)                 # (128, Gk, d)
            dk_acc = nl.ndarray((P, Gk, d), dtype=nl.float32, buffer=nl.sbuf)
            dv_acc = nl.ndarray((P, Gk, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=dk_acc, value=0.0)
            nisa.memset(dst=dv_acc, value=0.0)
            for h in range(hk * group, (hk + 1) * group):
                chunk.make_room(head_bytes)
                chunk.used += head_bytes
                qT = _load(q_ref[b, h], d, Sq, mm_dtype)
                dyT = _load(dy_ref[b, h], d, Sq, mm_dtype)
                q_rows = _rows(qT, d, Sq, mm_dtype)
                dy_rows = _rows(dyT, d, Sq, mm_dtype)
                o_rows = _rows(_load(o_ref[b, h], d, Sq, mm_dtype), d, Sq, mm_dtype)
                # rowsum(dy * o) and -lse per query, queries on partitions
                Dq = nl.ndarray((P, Gq), dtype=nl.float32, buffer=nl.sbuf)
                for i in range(Gq):
                    prod = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=prod, data1=dy_rows[:, i, :], data2=o_rows[:, i, :],
                                       op=nl.multiply)
                    nisa.tensor_reduce(dst=Dq[:, i:i + 1], op=nl.add, data=prod, axis=1)
                del o_rows
                neg_lse = nl.ndarray((P, Gq), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=neg_lse, src=lse_ref[b, h])
                nisa.tensor_scalar(dst=neg_lse, data=neg_lse, op0=nl.multiply, operand0=-1.0)
                dq_acc = nl.ndarray((P, Gq, d), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=dq_acc, value=0.0)
                for j in range(Gk):
                    k0, kw = j * P, min(P, Skv - j * P)
                    blocks = [i for i in range(Gq) if _needed(i * P, k0, kw, use_causal_mask, window)]
                    if not blocks:
                        continue
                    acc = _KeyBlock(j=j, k0=k0, kw=kw)
                    chunk.units += [_block(acc, i, n == 0, n == len(blocks) - 1, kT, vT, k_rows,
                                           qT, dyT, q_rows, dy_rows, Dq, neg_lse, dq_acc, dk_acc,
                                           dv_acc, scale, use_causal_mask, window, mm_dtype, d)
                                    for n, i in enumerate(blocks)]

                def store_dq(b=b, h=h, dq_acc=dq_acc):
                    for i in range(Gq):
                        _store_T(dq[b, h, :, i * P:(i + 1) * P], dq_acc[:, i, :], P, d, scale, dt)
                chunk.after.append(store_dq)

            def store_dkv(b=b, hk=hk, dk_acc=dk_acc, dv_acc=dv_acc):
                for j in range(Gk):
                    kw = min(P, Skv - j * P)
                    _store_T(dk[b, hk, :, j * P:j * P + kw], dk_acc[0:kw, j, :], kw, d, scale,
                             k_ref.dtype)
                    _store_T(dv[b, hk, :, j * P:j * P + kw], dv_acc[0:kw, j, :], kw, d, 1.0,
                             v_ref.dtype)
            chunk.after.append(store_dkv)
    chunk.flush()
    return dq, dk, dv


_CHUNK_BYTES = 64 * 1024


class _Chunk:
    """Units of several heads pipelined together, and the stores that follow them."""

    def __init__(self):
        self.units, self.after, self.used = [], [], 0

    def make_room(self, nbytes):
        if self.units and self.used + nbytes > _CHUNK_BYTES:
            self.flush()

    def flush(self):
        _pipeline(self.units)
        for f in self.after:
            f()
        self.units, self.after, self.used = [], [], 0


class _KeyBlock:
    """A key block's PSUM accumulators for dv and dk, shared by its query blocks' units."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _block(kb, i, first, last, kT, vT, k_rows, qT, dyT, q_rows, dy_rows, Dq, neg_lse, dq_acc,
           dk_acc, dv_acc, scale, causal, window, mm_dtype, d):
    """One (query block, key block) pair of the backward, as pipeline stages."""
    P = nl.tile_size.pmax
    j, k0, kw = kb.j, kb.k0, kb.kw
    q0 = i * P
    if first:
        kb.dv_ps = nl.ndarray((kw, d), dtype=nl.float32, buffer=nl.psum)
        kb.dk_ps = nl.ndarray((kw, d), dtype=nl.float32, buffer=nl.psum)
    s_ps = nl.ndarray((P, kw), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=s_ps, stationary=qT[:, q0:q0 + P], moving=kT[:, k0:k0 + kw])
    dp_ps = nl.ndarray((P, kw), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=dp_ps, stationary=dyT[:, q0:q0 + P], moving=vT[:, k0:k0 + kw])
    yield 1
    src = _mask(s_ps, q0, k0, kw, causal, window)
    if src is not s_ps:
        yield 1
    p = nl.ndarray((P, kw), dtype=mm_dtype, buffer=nl.sbuf)
    nisa.activation(dst=p, op=nl.exp, data=src, scale=scale, bias=neg_lse[:, i:i + 1])
    del src, s_ps
    yield 2
    ds = nl.ndarray((P, kw), dtype=mm_dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=ds, data=dp_ps, op0=nl.subtract, operand0=Dq[:, i:i + 1],
                              op1=nl.multiply, operand1=p)
    del dp_ps
    yield 2
    # dv += P^T dy and dk += dS^T q: contraction over the queries; dS^T for dq
    nisa.nc_matmul(dst=kb.dv_ps, stationary=p, moving=dy_rows[:, i, :], accumulate=not first)
    nisa.nc_matmul(dst=kb.dk_ps, stationary=ds, moving=q_rows[:, i, :], accumulate=not first)
    dsT_ps = nl.ndarray((kw, P), dtype=mm_dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=dsT_ps, data=ds)
    yield 2
    dsT = nl.ndarray((kw, P), dtype=mm_dtype, buffer=nl.sbuf)
    nisa.activation(dst=dsT, op=nl.copy, data=dsT_ps)
    del dsT_ps
    yield 2
    # dq += dS k: contraction over the keys
    dq_ps = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=dq_ps, stationary=dsT, moving=k_rows[0:kw, j, :])
    yield 2
    nisa.tensor_tensor(dst=dq_acc[:, i, :], data1=dq_acc[:, i, :], data2=dq_ps, op=nl.add)
    if last:
        nisa.tensor_tensor(dst=dv_acc[0:kw, j, :], data1=dv_acc[0:kw, j, :], data2=kb.dv_ps,
                           op=nl.add)
        nisa.tensor_tensor(dst=dk_acc[0:kw, j, :], data1=dk_acc[0:kw, j, :], data2=kb.dk_ps,
                           op=nl.add)
        kb.dv_ps = kb.dk_ps = None


def _needed(q0, k0, kw, causal, window):
    """Whether any (query, key) pair of the 128-query block at q0 and the keys k0..k0+kw-1
    survives the masks."""
    P = nl.tile_size.pmax
    if causal and k0 > q0 + P - 1:
        return False
    if window and k0 + kw - 1 < q0 - window + 1:
        return False
    return True


def _mask(s_ps, q0, k0, kw, causal, window):
    P = nl.tile_size.pmax
    cut_causal = causal and k0 + kw - 1 > q0
    cut_window = window and k0 < q0 + P - window
    if not (cut_causal or cut_window):
        return s_ps
    sm = nl.ndarray((P, kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=sm, src=s_ps)     # GpSimd reads SBUF only
    if cut_causal:
        nisa.affine_select(dst=sm, pattern=[[-1, kw]], channel_multiplier=1, offset=q0 - k0,
                           on_true_tile=sm, on_false_value=_NEG, cmp_op=nl.greater_equal)
    if cut_window:
        nisa.affine_select(dst=sm, pattern=[[1, kw]], channel_multiplier=-1,
                           offset=k0 - q0 + window - 1, on_true_tile=sm, on_false_value=_NEG,
                           cmp_op=nl.greater_equal)
    return sm


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
    """(d, S) transposed block by block into (128, blocks, d): sequence on partitions."""
    P = nl.tile_size.pmax
    n = (S + P - 1) // P
    out = nl.ndarray((P, n, d), dtype=dtype, buffer=nl.sbuf)
    for j in range(n):
        w = min(P, S - j * P)
        t_ps = nl.ndarray((w, d), dtype=dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=t_ps, data=tT[:, j * P:j * P + w])
        nisa.tensor_copy(dst=out[0:w, j, :], src=t_ps)
    return out


def _store_T(dst, acc, w, d, scale, dtype):
    """acc (w, d) fp32 times scale, transposed to (d, w), stored to dst."""
    t = nl.ndarray((w, d), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t, data=acc, op0=nl.multiply, operand0=scale)
    t_ps = nl.ndarray((d, w), dtype=dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=t_ps, data=t)
    o = nl.ndarray((d, w), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o, src=t_ps)
    nisa.dma_copy(dst=dst, src=o)
