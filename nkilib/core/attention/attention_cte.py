"""FlashAttention forward for context encoding (prefill): AWS's ``attention_cte``.

Per query group of 128 rows the scores against up to 512 keys at a time (one fp32 PSUM bank)
leave PSUM for SBUF scaled, with their row maximum, in one pass. An online softmax then runs
per chunk of up to four such sections (2048 keys; two on NeuronCore-v4): the chunk's
exponentials use its running maximum, P.V accumulates over the chunk in one PSUM tile, and
the running sum and the unnormalised output are rescaled once per chunk. So the score matrix
never leaves the chip, and per section each engine makes about the one pass over the scores
that it must. Sections of keys that a causal or sliding-window mask removes entirely are
skipped (a causal kernel does about half the work); sections the mask cuts through get an
``affine_select``. K and V of a batch stay in SBUF when they fit and stream per section when
they do not.

Layouts follow AWS's kernel: q (B, Sq, d) with ``tp_q=True`` (the default) or (B, d, Sq);
k (Bkv, d, Skv) with ``tp_k=False`` (the default) or (Bkv, Skv, d); v (Bkv, Skv, d); the
output (B, Sq, d), or (B, d, Sq) with ``tp_out=True``. Heads ride in the batch dimension;
B a multiple of Bkv is grouped-query attention (query batch b reads kv batch
b // (B // Bkv)). ``scale`` multiplies the scores (AWS's default 1.0: pass 1/sqrt(d) for
SDPA's). With ``cache_softmax=True`` the kernel also returns the negated row maximum and
the reciprocal row sum of the scaled scores, each (B, 128, ceil(Sq / 128)) with query
g*128 + p at [b, p, g], from which the backward kernel's log-sum-exp follows
(``lse = -(neg_max + log(sum_recip))``). ``logit_softcap`` (ours, for Gemma-style models)
replaces each scaled score s by cap * tanh(s / cap) before the softmax.
"""
from __future__ import annotations

from types import SimpleNamespace as _Cfg
from types import SimpleNamespace as _Group   # a query group's running state
from types import SimpleNamespace as _Chunk   # a chunk of a group's sections: shared statistics

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..utils.masks import NEG as _NEG, identity, mask_tile
from ..utils.pipeline import pipeline as _pipeline
from ..utils.refuse import refuse_given, unsupported

_BANK = 512             # fp32 scores per PSUM bank (2 KiB per partition): one matmul's output
_INTERLEAVE = 4         # query groups whose sections alternate in the pipeline
_CHUNK = 4              # sections per softmax rescale: 2048 keys (NeuronCore-v3)
_CHUNK_V4 = 2           # v4, whose rescale is cheap on its VectorE, gains less from a longer chunk
                        # than its pipeline loses (S=4096: 253 us at 2, 259 us at 4)
_KV_RESIDENT = 96 * 1024  # bytes per partition K and V may hold in SBUF for a whole batch


@nki.jit
def attention_cte(q, k, v, scale=1.0, causal_mask=True, k_prior=None, v_prior=None,
                  prior_used_len=None, sink=None, sliding_window=None, tp_q=True, tp_k=False,
                  tp_out=False, cache_softmax=False, softmax_dtype=nl.float32,
                  mm_out_dtype=nl.float32, cp_offset=None, global_cp_deg=None,
                  cp_strided_q_slicing=False, bound_min=None, bound_max=None,
                  logit_softcap=None):
    refuse_given("attention_cte", (
        ("prefix caching (k_prior)", k_prior), ("attention sinks", sink),
        ("context parallelism (cp_offset)", cp_offset),
        ("sequence packing (bound_min/bound_max)", bound_min)))
    P = nl.tile_size.pmax
    if tp_q:
        B, Sq, d = q.shape
    else:
        B, d, Sq = q.shape
    Bkv = k.shape[0]
    Skv = k.shape[1] if tp_k else k.shape[2]
    if d > P:
        raise E.ShapeMismatchError(f"attention_cte: head dim {d} > {P}")
    if tuple(v.shape) != (Bkv, Skv, d):
        raise E.ShapeMismatchError(f"attention_cte: v {tuple(v.shape)} must be ({Bkv}, {Skv}, {d}) "
                                   f"for k {tuple(k.shape)} (tp_k={tp_k})")
    if B % Bkv:
        raise E.ShapeMismatchError(f"attention_cte: query batch {B} is not a multiple of the "
                                   f"key/value batch {Bkv}")
    window = int(sliding_window or 0)
    G = (Sq + P - 1) // P
    out = nl.ndarray((B, d, Sq) if tp_out else (B, Sq, d), dtype=q.dtype, buffer=nl.shared_hbm)
    if cache_softmax:
        neg_max = nl.ndarray((B, P, G), dtype=nl.float32, buffer=nl.shared_hbm)
        sum_recip = nl.ndarray((B, P, G), dtype=nl.float32, buffer=nl.shared_hbm)
    fp32 = q.dtype == nl.float32
    p_dtype = nl.float32 if fp32 else nl.bfloat16
    lscale, cap = float(scale), logit_softcap
    n_prog, pid = nl.num_programs(0), nl.program_id(0)
    resident = 2 * Skv * max(k.dtype.itemsize, 1) <= _KV_RESIDENT
    group = B // Bkv
    cfg = _Cfg(q=q, k=k, v=v, out=out, d=d, Sq=Sq, Skv=Skv, tp_q=tp_q, tp_k=tp_k,
               tp_out=tp_out, causal=causal_mask, window=window, lscale=lscale, cap=cap,
               p_dtype=p_dtype, resident=resident, kv=None, masks={},
               section=_BANK,      # keys per online-softmax step
               cache=(neg_max, sum_recip) if cache_softmax else None)
    groups = []
    for b in range(B):
        for g in range(G):
            if (b * G + g) % n_prog != pid:
                continue
            x = _Group(b=b, kb=b // group, g=g, q0=g * P, r=min(P, Sq - g * P))
            x.hi = min(Skv, x.q0 + x.r) if causal_mask else Skv
            x.lo = max(0, x.q0 - window + 1) // P * P if window else 0
            x.secs = list(range(x.lo, x.hi, cfg.section))
            groups.append(x)
    # NeuronCore-v4: ScalarE's Activation2 reduces a maximum and VectorE's exponential runs
    # at 4x activation's rate, so the max moves to ScalarE and the exp to VectorE
    cfg.fast_exp = nisa.get_nc_version() == nisa.nc_version.gen4
    units = _interleave(groups, _INTERLEAVE, _CHUNK_V4 if cfg.fast_exp else _CHUNK)
    # PSUM in rings of slots, taken in turn by consecutive units (an allocator would
    # fragment PSUM into pieces no 2 KiB score tile fits). A unit starts every tick and its
    # stages are ``gap`` ticks apart, so a stage's inputs come from ``gap`` units back and
    # the 1.3 us semaphore waits overlap other units' work. A slot may be written again in
    # the tick its last reader issues (older units issue first): the scores, read once a
    # stage after their matmul, and P^T take ``gap`` slots each, one
    # more where PSUM has room so that TensorE can run ahead of the slot's reader by a
    # semaphore wait. A unit's exponentials wait ``delay`` ticks more than that, until its
    # chunk's last section has its maximum; P.V accumulates per chunk (``_pv_slots``).
    cfg.gap = gap = 2 if fp32 else 3
    more = int(not fp32)
    cfg.delay = max((u[5].last - u[5].first for u in units), default=0)
    n_pv = _pv_slots(units, cfg.delay, gap)
    cfg.s_ring = nl.ndarray((P, gap + more, cfg.section), dtype=nl.float32, buffer=nl.psum)
    cfg.pt_ring = nl.ndarray((P, gap + more, cfg.section // P, P), dtype=p_dtype, buffer=nl.psum)
    cfg.pv_ring = nl.ndarray((P, n_pv, d), dtype=nl.float32, buffer=nl.psum)
    # SBUF rings too, for the tiles of every unit (tiles allocated per unit fragment SBUF
    # until a long causal kernel finds no 2 KiB range free): the scaled scores, held from
    # their maximum to their exponential, P and P^T, each held one gap. A slot is written
    # again ``gap + 1`` ticks after its last read, so the writer does not wait on the reader's
    # engine (SBUF has the room PSUM lacks).
    held = gap + cfg.delay + (gap if cfg.fast_exp else 0)
    spare = gap + 1
    cfg.ss_ring = nl.ndarray((P, held + spare, cfg.section), dtype=nl.float32, buffer=nl.sbuf)
    cfg.p_ring = nl.ndarray((P, gap + spare, cfg.section), dtype=p_dtype, buffer=nl.sbuf)
    cfg.pT_ring = nl.ndarray((P, gap + spare, cfg.section // P, P), dtype=p_dtype, buffer=nl.sbuf)
    cfg.t_ring = {}
    # the queries' transposes: held one gap, by up to _INTERLEAVE consecutive first units
    cfg.q_ring = [nl.ndarray((P, gap + 1, P), dtype=q.dtype, buffer=nl.psum), 0]
    cfg.pt_modes = _pt_modes(cfg.fast_exp)
    # Masks cut the diagonal sections: with 16-bit inputs and no soft-cap (which must see
    # the unmasked scores) TensorE, which has time to spare, adds the mask into the scores'
    # PSUM as a bf16 matmul by the identity; else VectorE adds it as it reads the scores.
    cfg.mask_on_tensor = not fp32 and not cap
    cfg.mask_dtype = nl.bfloat16 if cfg.mask_on_tensor else nl.float32
    _pipeline([_unit(cfg, i, *u) for i, u in enumerate(units)])
    if cache_softmax:
        return out, neg_max, sum_recip
    return out


def _interleave(groups, n, chunk=_CHUNK):
    """The pipeline's units, sections of ``n`` groups at a time taken in turn: consecutive
    units then belong to different groups, so one group's chain of running statistics does
    not serialise the pipeline. Each unit is (group, section start, first, last, position in
    its chunk, the chunk); a chunk is up to ``chunk`` consecutive sections of one group."""
    order, blocks = [], []
    for x in groups:      # a block shares one kv batch: K and V stay resident per batch
        if blocks and len(blocks[-1]) < n and blocks[-1][0].kb == x.kb:
            blocks[-1].append(x)
        else:
            blocks.append([x])
    for block in blocks:
        for j in range(max(len(x.secs) for x in block)):
            order += [(x, j) for x in block if j < len(x.secs)]
    chunks = {}
    for i, (x, j) in enumerate(order):
        ch = chunks.setdefault((id(x), j // chunk), _Chunk(first=i, last=i, n=0))
        ch.last, ch.n = i, ch.n + 1
    return [(x, x.secs[j], j == 0, j == len(x.secs) - 1, j % chunk, chunks[(id(x), j // chunk)])
            for x, j in order]


def _pv_slots(units, delay, gap):
    """A PSUM slot per chunk for its P.V accumulator, held from its first unit's P.V stage to
    its rescale (a gap after its last unit's): intervals coloured in order of start. Returns
    the number of slots."""
    free, busy, used = [], [], 0
    for ch in sorted({id(u[5]): u[5] for u in units}.values(), key=lambda ch: ch.first):
        start, end = ch.first + delay, ch.last + delay + gap
        for b in [b for b in busy if b[0] <= start]:     # released before this chunk starts
            busy.remove(b)
            free.append(b[1])
        if not free:
            free.append(used)
            used += 1
        ch.slot = min(free)
        free.remove(ch.slot)
        busy.append((end, ch.slot))
    return used


def _pt_modes(fast_exp):
    """The engines that copy consecutive units' P^T out of PSUM, in turn. NeuronCore-v3:
    VectorE carries the pass over the scores with their maximum, ScalarE the exponentials,
    and two copies in three on ScalarE balance them (measured: 293 us at S=4096 against
    312 us with two in three on VectorE). v4: ScalarE carries the maximum, VectorE the
    (4x faster) exponentials, so VectorE copies. DMA transposes (AWS's choice) measured
    slower in the model: one takes all 16 queues at half their rate, 1.3 us per unit."""
    return ("vector",) if fast_exp else ("scalar", "scalar", "vector")


def _scratch(c, rows, cols, dtype):
    """A PSUM tile for a transpose that is copied out at once (queries, keys, output)."""
    P = nl.tile_size.pmax
    ring = c.t_ring.get(dtype.name)
    if ring is None:
        ring = c.t_ring[dtype.name] = [nl.ndarray((P, 2, P), dtype=dtype, buffer=nl.psum), 0]
    ring[1] ^= 1
    return ring[0][0:rows, ring[1], 0:cols]


def _unit(c, i, x, s0, first, last, pos, ch):
    """One query group against one section of keys, as stages separated by ``yield``.

    The one pass over the scores that needs a row maximum (VectorE's ``tensor_scalar_reduce``
    on NeuronCore-v3, ScalarE's ``activate2`` on v4) also scales them into SBUF, which frees
    their PSUM bank at once. The chunk's last section then folds the chunk's maxima into the
    running one; every section's exponential uses it, the running sum gathers the rows on
    GpSimd, and the chunk's last section rescales the output once. Stages are ``c.gap``
    ticks apart, so a stage's inputs come from several units back and the cross-engine
    semaphore waits overlap other units' work."""
    P = nl.tile_size.pmax
    r, d = x.r, c.d
    w = min(c.section, x.hi - s0)
    qload = _load_qT(c, x, r, d) if first else iter((None, None, None))
    next(qload)
    if first:      # K and V of a new batch with the queries
        if c.resident and (c.kv is None or c.kv[0] != x.kb):
            c.kv = (x.kb,) + _load_kv(c, x.kb, 0, c.Skv, d)
        # the running row maximum of the scaled scores, negated (the exp's bias) unless
        # VectorE's exponential subtracts it
        x.nb = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=x.nb, value=_NEG if c.fast_exp else -_NEG, engine=nisa.gpsimd_engine)
        x.l_sum = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=x.l_sum, value=0.0, engine=nisa.gpsimd_engine)
        x.acc = nl.ndarray((r, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=x.acc, value=0.0, engine=nisa.gpsimd_engine)
    if pos == 0:   # each section's row maximum and row sum of exponentials
        ch.mx = nl.ndarray((r, ch.n), dtype=nl.float32, buffer=nl.sbuf)
        ch.rows = nl.ndarray((r, ch.n), dtype=nl.float32, buffer=nl.sbuf)
    if c.resident:   # k_t is the batch's K, kc its column of key s0
        k_t, v_t, vb0, kc = c.kv[1], c.kv[2], s0 // P, s0
    else:
        k_t, v_t = _load_kv(c, x.kb, s0, w, d)
        vb0 = kc = 0
    for _ in range(2):       # every unit, so that all units' stages keep the same offsets
        yield c.gap
        next(qload, None)
    yield c.gap
    # TensorE: the scores, one PSUM bank per 512 keys
    s_ps = c.s_ring[0:r, i % c.s_ring.shape[1], 0:w]
    mask = _mask_tile(c, s0, w, x.q0, r) if c.mask_on_tensor else None
    for col in range(0, w, _BANK):
        cw = min(_BANK, w - col)
        nisa.nc_matmul(dst=s_ps[:, col:col + cw], stationary=x.qT,
                       moving=k_t[:, kc + col:kc + col + cw])
        if mask is not None:     # + I @ mask: exact in the fp32 accumulation
            ident = identity(c.masks, nl.bfloat16)
            nisa.nc_matmul(dst=s_ps[:, col:col + cw], stationary=ident[:, 0:r],
                           moving=mask[:, col:col + cw], accumulate=True)
    yield c.gap
    src, ls = s_ps, c.lscale
    if c.cap:
        t = nl.ndarray((r, w), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=t, op=nl.tanh, data=s_ps, scale=c.lscale / c.cap)
        src, ls = t, float(c.cap)
        yield c.gap
    src = _mask(c, src, s0, w, x.q0, r)
    # the scaled scores to SBUF with their row maximum
    ss = c.ss_ring[0:r, i % c.ss_ring.shape[1], 0:w]
    if c.fast_exp:   # ScalarE
        nisa.activate2(dst=ss, op=nl.copy, data=src, imm0=ls, imm1=0.0, op0=nl.multiply,
                       op1=None, reduce_op=nl.maximum, reduce_res=ch.mx[:, pos:pos + 1],
                       reduce_cmd=nisa.reduce_cmd.reset_reduce)
    else:            # VectorE
        nisa.tensor_scalar_reduce(dst=ss, data=src, op0=nl.multiply, operand0=ls,
                                  reduce_op=nl.maximum, reduce_res=ch.mx[:, pos:pos + 1])
    del src, s_ps
    if c.fast_exp:   # VectorE takes the maxima a stage after ScalarE wrote them
        yield c.gap
    if pos == ch.n - 1:   # VectorE: the chunk's maximum into the running one
        cm = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        ch.nb_old, ch.nb = x.nb, nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=cm, op=nl.max, data=ch.mx, axis=1, negate=not c.fast_exp)
        nisa.tensor_tensor(dst=ch.nb, data1=ch.nb_old, data2=cm,
                           op=nl.maximum if c.fast_exp else nl.minimum)
        x.nb = ch.nb
    # every unit waits as long, so that all keep their order; by then the chunk's last
    # section has its maximum
    yield c.gap + c.delay
    # exp(s - max) with its row sum, and (once per chunk) the correction exp(max_old - max)
    n_blk = (w + P - 1) // P
    p = c.p_ring[0:r, i % c.p_ring.shape[1], 0:w]
    if pos == 0:
        ch.corr = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
    if c.fast_exp:   # on VectorE, at 4x ScalarE's rate
        nisa.exponential(dst=p, src=ss, max_value=ch.nb, reduce_res=ch.rows[:, pos:pos + 1],
                         reduce_cmd=nisa.reduce_cmd.reset_reduce)
        if pos == 0:
            nisa.exponential(dst=ch.corr, src=ch.nb_old, max_value=ch.nb)
    else:            # on ScalarE
        nisa.activation(dst=p, op=nl.exp, data=ss, bias=ch.nb, reduce_op=nl.add,
                        reduce_res=ch.rows[:, pos:pos + 1])
        if pos == 0:
            nisa.activation(dst=ch.corr, op=nl.exp, data=ch.nb_old, scale=-1.0, bias=ch.nb)
    del ss
    yield c.gap
    # TensorE: P transposed, keys onto partitions, into one PSUM tile that a single copy
    # (VectorE or ScalarE, in turn) brings to SBUF
    t_ps = c.pt_ring[0:P, i % c.pt_ring.shape[1], 0:n_blk, 0:r]
    for j in range(n_blk):
        kw = min(P, w - j * P)
        nisa.nc_transpose(dst=t_ps[0:kw, j, :], data=p[:, j * P:j * P + kw])
    # GpSimd: the running sum, rescaled by the chunk's first section
    row = ch.rows[:, pos:pos + 1]
    if pos == 0:
        nisa.tensor_scalar(dst=x.l_sum, data=x.l_sum, op0=nl.multiply, operand0=ch.corr,
                           op1=nl.add, operand1=row, engine=nisa.gpsimd_engine)
    else:
        nisa.tensor_scalar(dst=x.l_sum, data=x.l_sum, op0=nl.add, operand0=row,
                           engine=nisa.gpsimd_engine)
    yield c.gap
    pT = c.pT_ring[:, i % c.pT_ring.shape[1], 0:n_blk, 0:r]
    full = w // P
    eng = nisa.scalar_engine if c.pt_modes[i % len(c.pt_modes)] == "scalar" else nisa.vector_engine
    if full:
        nisa.tensor_copy(dst=pT[:, 0:full, :], src=t_ps[:, 0:full, :], engine=eng)
    if full < n_blk:      # a last block of fewer keys
        kw = w - full * P
        nisa.tensor_copy(dst=pT[0:kw, full, :], src=t_ps[0:kw, full, :], engine=eng)
    blocks = [pT[0:min(P, w - j * P), j, :] for j in range(n_blk)]
    del t_ps
    yield c.gap
    # TensorE: P @ V into the chunk's PSUM accumulator
    pv = c.pv_ring[0:r, ch.slot, :]
    for j, t in enumerate(blocks):
        kw = min(P, w - j * P)
        nisa.nc_matmul(dst=pv, stationary=t[0:kw, :], moving=v_t[0:kw, vb0 + j, :],
                       accumulate=pos > 0 or j > 0)
    del blocks, pT
    if pos == ch.n - 1:
        yield c.gap
        nisa.scalar_tensor_tensor(dst=x.acc, data=x.acc, op0=nl.multiply, operand0=ch.corr,
                                  op1=nl.add, operand1=pv)
    if last:
        yield c.gap
        _finish(c, x, d)


def _mask_tile(c, s0, w, q0, r):
    return mask_tile(c.masks, q0, s0, w, r, c.causal, c.window, c.mask_dtype)


def _mask(c, src, s0, w, q0, r):
    """The section's logits with the masks added where they cut through it, by VectorE as
    it reads the scores (when TensorE has not already accumulated the mask into them)."""
    if c.mask_on_tensor:
        return src
    tile = _mask_tile(c, s0, w, q0, r)
    if tile is None:
        return src
    sm = nl.ndarray((r, w), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sm, data1=src, data2=tile[0:r, :], op=nl.add)
    return sm


def _finish(c, x, d):
    """Normalises the group's output, stores it, and its softmax statistics if asked."""
    P = nl.tile_size.pmax
    r, q0, g, b, q, out, cache = x.r, x.q0, x.g, x.b, c.q, c.out, c.cache
    inv = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=x.l_sum)
    o = nl.ndarray((r, d), dtype=q.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o, data=x.acc, op0=nl.multiply, operand0=inv)
    if c.tp_out:
        oT_ps = _scratch(c, d, r, q.dtype)
        nisa.nc_transpose(dst=oT_ps, data=o)
        oT = nl.ndarray((d, r), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=oT, src=oT_ps)
        nisa.dma_copy(dst=out[b, :, q0:q0 + r], src=oT)
    else:
        nisa.dma_copy(dst=out[b, q0:q0 + r, :], src=o)
    if cache:
        neg_max, sum_recip = cache
        nm = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        sr = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        if r < P:      # rows past the sequence: the padding AWS's layout carries
            nisa.memset(dst=nm, value=0.0)
            nisa.memset(dst=sr, value=0.0)
        if c.fast_exp:
            nisa.tensor_scalar(dst=nm[0:r, :], data=x.nb, op0=nl.multiply, operand0=-1.0)
        else:
            nisa.tensor_copy(dst=nm[0:r, :], src=x.nb)
        nisa.tensor_copy(dst=sr[0:r, :], src=inv)
        nisa.dma_copy(dst=neg_max[b, :, g:g + 1], src=nm)
        nisa.dma_copy(dst=sum_recip[b, :, g:g + 1], src=sr)


def _load_qT(c, x, r, d):
    """The query group transposed, head dim on partitions (the stationary operand), in three
    stages a gap apart: the DMA, the TensorE transpose, the copy out of PSUM. Engines run in
    program order, so in one stage each would wait for the one before."""
    q = c.q
    x.qT = nl.ndarray((d, r), dtype=q.dtype, buffer=nl.sbuf)
    if not c.tp_q:
        nisa.dma_copy(dst=x.qT, src=q[x.b, :, x.q0:x.q0 + r])
        yield
        yield
        return
    q_sb = nl.ndarray((r, d), dtype=q.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q[x.b, x.q0:x.q0 + r, :])
    yield
    ring = c.q_ring
    ring[1] = (ring[1] + 1) % ring[0].shape[1]
    t_ps = ring[0][0:d, ring[1], 0:r]
    nisa.nc_transpose(dst=t_ps, data=q_sb)
    yield
    nisa.activation(dst=x.qT, op=nl.copy, data=t_ps)


def _load_kv(c, kb, s0, n, d):
    """Keys s0..s0+n of kv batch kb: K as (d, n) and V as (128, blocks, d), block j holding
    keys s0 + 128j onwards on partitions."""
    P = nl.tile_size.pmax
    k, v, tp_k = c.k, c.v, c.tp_k
    k_sb = nl.ndarray((d, n), dtype=k.dtype, buffer=nl.sbuf)
    if not tp_k:     # in 512-key pieces, so the first scores need not wait for all of K
        for c in range(0, n, _BANK):
            nisa.dma_copy(dst=k_sb[:, c:c + min(_BANK, n - c)], src=k[kb, :, s0 + c:s0 + min(n, c + _BANK)])
    n_blk = (n + P - 1) // P
    v_sb = nl.ndarray((P, n_blk, d), dtype=v.dtype, buffer=nl.sbuf)
    for j in range(n_blk):
        kw = min(P, n - j * P)
        nisa.dma_copy(dst=v_sb[0:kw, j, :], src=v[kb, s0 + j * P:s0 + j * P + kw, :])
        if tp_k:
            kt = nl.ndarray((kw, d), dtype=k.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=kt, src=k[kb, s0 + j * P:s0 + j * P + kw, :])
            t_ps = _scratch(c, d, kw, k.dtype)
            nisa.nc_transpose(dst=t_ps, data=kt)
            nisa.tensor_copy(dst=k_sb[:, j * P:j * P + kw], src=t_ps)
    return k_sb, v_sb
