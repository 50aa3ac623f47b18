"""Decode (token-generation) attention against a KV cache: AWS's ``attention_tkg``.

A few new query tokens per sequence (s_active, 1..8 typically) attend to the sequence's
cached keys and values and, causally, to each other. Query head h reads kv head
h // (H // Hkv) (grouped-query attention). Layouts, B sequences, H query heads, Hkv kv heads:

* ``q`` [B, d, H, s_active] and ``out`` [B, H, d, s_active]: AWS's HBM layouts (cfg.qk_in_sb
  and cfg.out_in_sb False). The kernel applies ``scale`` (ours; AWS's kernel expects q
  pre-scaled, which is scale=1.0, the default).
* Contiguous cache, per sequence: ``v_prior`` [B+, Hkv, S, d] and ``k_prior`` [B+, Hkv, d, S]
  (AWS's default, ``cfg.tp_k_prior=False``) or [B+, Hkv, S, d] (``cfg.tp_k_prior=True``).
  AWS's [B, 1, ...] is the Hkv = 1 case; a batch B+ > B is allowed, as AWS's.
* Paged cache, as vLLM lays it out: ``k_prior``/``v_prior`` [num_blocks, block_size, Hkv, d]
  (AWS's [num_blocks, block_len, d] is Hkv = 1), ``active_blocks_table`` [B, max_blocks] int32
  (block j of sequence b holds its tokens j*block_size ...), and ``context_lens`` [B] int32.
* ``context_lens`` (ours) [B] int32: the valid cached tokens of each sequence. Without it a
  contiguous cache is valid up to ``cfg.curr_sprior`` (or its full length).
* With ``k_active`` [B, Hkv, d, s_active] (AWS's [B, d, s_active] when Hkv = 1) and
  ``v_active`` [B, Hkv, s_active, d], the new tokens' keys and values come separately, after
  the context_lens cached ones (AWS's convention). With ``k_active=None`` they are already in
  the cache (vLLM's): context_lens counts them, and query i sits at position
  context_lens - s_active + i. Either way query i sees every earlier position and itself.

Returns ``(out, None)`` as AWS's kernel does (the second is the RoPE'd k_out, not produced).

How: per kv head, the cache goes through SBUF in folds of up to 128 partitions, each
holding a run of n consecutive tokens (a block of a paged cache, a slice of a contiguous
one), so every DMA moves long contiguous rows. Keys are transposed on TensorE (d onto
partitions) unless the cache stores them transposed. Scores come out keys-on-partitions,
[keys, G * s_active], so the softmax's exponentials are directly the moving operand of the
P @ V matmul and nothing is transposed back; the per-query maximum is a partition reduce on
GpSimd, broadcast back to the partitions by a one-row matmul. Folds combine with an online
softmax. Every (fold, kv head) is a unit of stages that ``nkilib.core.utils.pipeline``
interleaves; keys are loaded two folds ahead and values just in time, so the DMA queues
stay busy while the engines work on earlier folds. Modelled latency is KV bytes / HBM rate
plus a fixed ~20 us (the last fold's chain of engine hand-offs): 78% of that rate at 8K
tokens x 8 kv heads on trn2.

The lengths are runtime data: they are read into registers, which set the loops' extents
(the simulator runs such dynamic loops as Python loops). A paged fold is one indirect DMA
per K and V: the fold's block ids are loaded from the block table into SBUF and address
the cache's first dim (``.ap(vector_offset=...)``), so a fold of many small blocks pays
one DMA's fixed cost, not one per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ..utils.pipeline import pipeline as _pipeline
from ..utils.refuse import refuse_given, unsupported

_NEG = -3.0e38           # masked score: exp() of it underflows to 0
_TILE_BYTES = 8 * 1024   # per partition, one fold's K (or V) tile of one kv head
_PAGED_BYTES = 16 * 1024  # the same for a paged fold, which may carry several kv heads
_SCORE_BYTES = 4 * 1024  # per partition, one fold's fp32 scores


@dataclass
class AttnTKGConfig(nl.NKIObject):
    """AWS's configuration of ``attention_tkg``. Shape fields left 0 are taken from the
    tensors (given, they are checked); ``tp_k_prior`` picks the contiguous K layout; the
    SBUF-placement, RoPE and in-kernel mask options are not implemented here."""
    bs: int = 0
    q_head: int = 0
    s_active: int = 0
    curr_sprior: int = 0
    full_sprior: int = 0
    d_head: int = 0
    block_len: int = 0
    tp_k_prior: bool = False
    strided_mm1: bool = True
    use_pos_id: bool = False
    fuse_rope: bool = False
    use_gpsimd_sb2sb: bool = True
    qk_in_sb: bool = False
    k_out_in_sb: bool = False
    out_in_sb: bool = False
    enable_fa_s_prior_tiling: bool = True


@nki.jit
def attention_tkg(q, k_active, v_active, k_prior, v_prior, mask=None, out=None, cfg=None,
                  sbm=None, inv_freqs=None, rope_pos_ids=None, start_pos_ids=None, sink=None,
                  active_blocks_table=None, k_out=None, DBG_TENSORS=None, context_lens=None,
                  scale=1.0):
    # sbm (AWS's SBUF allocator) is accepted and unused: the simulator allocates.
    refuse_given("attention_tkg", (
        ("a pre-generated mask (pass context_lens)", mask), ("attention sinks", sink),
        ("fused RoPE (inv_freqs, rope_pos_ids)", inv_freqs),
        ("sliding-window starts (start_pos_ids)", start_pos_ids),
        ("k_out", k_out), ("DBG_TENSORS", DBG_TENSORS)))
    c = _plan(q, k_active, v_active, k_prior, v_prior, active_blocks_table, context_lens,
              cfg if cfg is not None else AttnTKGConfig(), float(scale))
    if out is None:
        out = nl.ndarray((c.B, c.H, c.d, c.sa), dtype=q.dtype, buffer=nl.shared_hbm)
    elif tuple(out.shape) != (c.B, c.H, c.d, c.sa):
        raise E.ShapeMismatchError(f"attention_tkg: out {tuple(out.shape)} must be "
                                   f"{(c.B, c.H, c.d, c.sa)} ([B, H, d, s_active])")
    c.out = out
    _setup(c)
    _pipeline(_units(c))
    return out, None


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _plan(q, k_act, v_act, k_prior, v_prior, table, lens, cfg, scale):
    """Validates shapes against the layouts above and picks the fold geometry."""
    K = "attention_tkg"
    for flag in ("fuse_rope", "use_pos_id", "qk_in_sb", "out_in_sb", "k_out_in_sb"):
        if getattr(cfg, flag, False):
            unsupported(K, f"cfg.{flag}=True")
    if q.ndim != 4:
        raise E.ShapeMismatchError(f"{K}: q {tuple(q.shape)} must be [B, d, H, s_active]")
    B, d, H, sa = q.shape
    paged = table is not None
    if paged:
        if k_prior.ndim not in (3, 4) or tuple(v_prior.shape) != tuple(k_prior.shape):
            raise E.ShapeMismatchError(f"{K}: a paged cache needs k_prior and v_prior both "
                                       f"[num_blocks, block_size, Hkv, d], got {tuple(k_prior.shape)} "
                                       f"and {tuple(v_prior.shape)}")
        Hkv = k_prior.shape[2] if k_prior.ndim == 4 else 1
        bs = k_prior.shape[1]
        if k_prior.shape[-1] != d:
            raise E.ShapeMismatchError(f"{K}: cache head dim {k_prior.shape[-1]} != q's {d}")
        if table.ndim != 2 or table.shape[0] != B:
            raise E.ShapeMismatchError(f"{K}: active_blocks_table {tuple(table.shape)} must be "
                                       f"[B={B}, max_blocks]")
        if lens is None:
            raise E.ShapeMismatchError(f"{K}: a paged cache needs context_lens [B]")
        S = table.shape[1] * bs
    else:
        if k_prior.ndim != 4 or v_prior.ndim != 4:
            raise E.ShapeMismatchError(f"{K}: a contiguous cache is 4-D: k_prior {tuple(k_prior.shape)}, "
                                       f"v_prior {tuple(v_prior.shape)}")
        Hkv, S = v_prior.shape[1], v_prior.shape[2]
        want_k = (Hkv, S, d) if cfg.tp_k_prior else (Hkv, d, S)
        if tuple(v_prior.shape[1:]) != (Hkv, S, d) or tuple(k_prior.shape[1:]) != want_k:
            raise E.ShapeMismatchError(
                f"{K}: k_prior {tuple(k_prior.shape)} / v_prior {tuple(v_prior.shape)} must be "
                f"[B+, Hkv, {'S, d' if cfg.tp_k_prior else 'd, S'}] / [B+, Hkv, S, d] "
                f"(cfg.tp_k_prior={cfg.tp_k_prior}) with d = {d}")
        if k_prior.shape[0] < B or v_prior.shape[0] < B:
            raise E.ShapeMismatchError(f"{K}: the cache holds {k_prior.shape[0]} sequences, q {B}")
        bs = 0
    if H % Hkv:
        raise E.ShapeMismatchError(f"{K}: {H} query heads are not a multiple of {Hkv} kv heads")
    G = H // Hkv
    R = G * sa
    if d > 128 or R > 128:
        raise E.ShapeMismatchError(f"{K}: head dim {d} and (H / Hkv) * s_active = {R} must be "
                                   f"<= 128 (q {tuple(q.shape)}, {Hkv} kv heads)")
    if (k_act is None) != (v_act is None):
        raise E.ShapeMismatchError(f"{K}: give both k_active and v_active, or neither")
    if k_act is not None:
        want = [(B, Hkv, d, sa)] + ([(B, d, sa)] if Hkv == 1 else [])
        if tuple(k_act.shape) not in want or tuple(v_act.shape) != (B, Hkv, sa, d):
            raise E.ShapeMismatchError(f"{K}: k_active {tuple(k_act.shape)} / v_active "
                                       f"{tuple(v_act.shape)} must be [B, Hkv, d, s_active] / "
                                       f"[B, Hkv, s_active, d] = {(B, Hkv, d, sa)} / {(B, Hkv, sa, d)}")
    if lens is not None and lens.size != B:
        raise E.ShapeMismatchError(f"{K}: context_lens {tuple(lens.shape)} must hold {B} lengths")
    for name, want in (("bs", B), ("q_head", H), ("s_active", sa), ("d_head", d),
                       ("block_len", bs if paged else None), ("full_sprior", None if paged else S)):
        got = getattr(cfg, name, 0)
        if got and want is not None and got != want:
            raise E.ShapeMismatchError(f"{K}: cfg.{name}={got} does not match the tensors ({want})")
    dt = q.dtype
    for name, t in (("k_prior", k_prior), ("v_prior", v_prior), ("k_active", k_act),
                    ("v_active", v_act)):
        if t is not None and t.dtype != dt:
            raise E.DtypeLegalityError(f"{K}: {name} is {t.dtype.name}, q is {dt.name}; the kernel "
                                       f"needs one dtype")
    if dt.name not in ("float32", "bfloat16", "float16"):
        raise E.DtypeLegalityError(f"{K}: dtype {dt.name} is not supported (float32, bfloat16, float16)")
    item = dt.itemsize
    c = _Obj(B=B, d=d, H=H, sa=sa, Hkv=Hkv, G=G, R=R, S=S, paged=paged, bs=bs, dt=dt, item=item,
             p_dtype=nl.float32 if dt == nl.float32 else nl.bfloat16, scale=scale, q=q,
             k_act=k_act, v_act=v_act, kp=k_prior, vp=v_prior, table=table, lens=lens,
             tp_k=bool(cfg.tp_k_prior), curr=int(cfg.curr_sprior or 0), vllm=k_act is None)
    n_cap = max(1, _SCORE_BYTES // (4 * R))       # the fold's scores within budget
    if paged:
        # Heads per block DMA: as many as fit (bigger DMAs), a divisor of Hkv.
        c.hg = max(g for g in range(1, Hkv + 1) if Hkv % g == 0 and bs * g * d * item <= _PAGED_BYTES
                   or g == 1)
        # A block larger than the budget spreads over several partitions; several heads
        # per DMA may take the larger budget (their DMAs are the ones worth enlarging).
        budget = _PAGED_BYTES if c.hg > 1 else _TILE_BYTES
        split = 1
        while bs % (split * 2) == 0 and (bs // split * c.hg * d * item > budget
                                         or bs // split > n_cap):
            split *= 2
        c.split, c.n = split, bs // split
    else:
        c.hg, c.split = 1, 1
        c.n = max(1, min(-(-S // 128), _TILE_BYTES // (d * item), n_cap))
    c.k_ahead = 2 if c.n * c.hg * d * item <= _TILE_BYTES else 1
    return c


def _setup(c):
    """Constants, the per-sequence lengths (SBUF and registers), the block table and the
    active tokens' causal mask."""
    P, B = nl.tile_size.pmax, c.B
    c.ones_row = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=c.ones_row, value=1.0)
    c.ones_pd = nl.ndarray((P, c.d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=c.ones_pd, value=1.0, engine=nisa.gpsimd_engine)
    c.zeros = None
    slot = 64
    while slot < 2 * c.R * 4:
        slot *= 2
    c.ring = _Ring(slot, max(4, 4096 // slot))
    # thr[:, b]: query i of sequence b sees cached key position j iff j - ci * i <= thr[b]
    # (ci = 1 when the active tokens are in the cache, else 0).
    c.thr = nl.ndarray((P, B), dtype=nl.float32, buffer=nl.sbuf)
    if c.lens is not None:
        lens = c.lens.reshape((1, B))
        li = nl.ndarray((P, B), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=li, src=lens.ap([[0, P], [1, B]], offset=0))   # on every partition
        nisa.tensor_copy(dst=c.thr, src=li, engine=nisa.gpsimd_engine)
        nisa.tensor_scalar(dst=c.thr, data=c.thr, op0=nl.subtract,
                           operand0=float(c.sa if c.vllm else 1), engine=nisa.gpsimd_engine)
        reg = nisa.register_alloc(0)
        c.L = []
        for b in range(B):      # the host-visible extents of the loops below
            nisa.register_load(reg, li[0:1, b:b + 1])
            c.L.append(int(reg))
    else:
        L = c.curr or c.S
        c.L = [L] * B
        nisa.memset(dst=c.thr, value=float(L - (c.sa if c.vllm else 1)), engine=nisa.gpsimd_engine)
    for b, L in enumerate(c.L):
        cap = c.S
        if L < 0 or L > cap or (c.vllm and L < c.sa):
            raise E.IndexOutOfBoundsError(
                f"attention_tkg: sequence {b} has context length {L}; the cache holds {cap} "
                f"positions{' and the ' + str(c.sa) + ' active tokens must be among them' if c.vllm else ''}")
    # q^T of every sequence up front: small, and ahead of the cache in the DMA queues.
    # Column (b * H + h) * s_active + i holds q[b, :, h, i].
    c.qT = nl.ndarray((c.d, B * c.H * c.sa), dtype=c.dt, buffer=nl.sbuf)
    w = c.H * c.sa
    nisa.dma_copy(dst=c.qT, src=c.q.ap([[w, c.d], [c.d * w, B], [1, w]], offset=0))
    if not c.vllm:      # key j of the active tokens is visible to query i iff j <= i
        m = nl.ndarray((c.sa, c.R), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=m, pattern=[[0, c.G], [-1, c.sa]], offset=0, channel_multiplier=1)
        nisa.tensor_scalar(dst=m, data=m, op0=nl.greater, operand0=0.0, op1=nl.multiply,
                           operand1=_NEG, engine=nisa.gpsimd_engine)
        c.act_mask = m


def _units(c):
    """The (fold, kv head) units in issue order, and the cache loads they share."""
    n_prog, pid = nl.num_programs(0), nl.program_id(0)
    per = 128 // c.split * c.split        # chunks per fold, whole blocks
    groups = []
    for b in range(c.B):
        for h0 in range(0, c.Hkv, c.hg):
            if (b * c.Hkv + h0) // c.hg % n_prog == pid:
                groups.append((b, h0))
    loads, plan = [], []
    for b, h0 in groups:
        L = c.L[b]
        folds = []
        if not c.vllm:
            for h in range(h0, h0 + c.hg):
                ld = _Obj(kind="active", b=b, h0=h, np=c.sa, n=1, issued=set())
                loads.append(ld)
                folds.append(([h], ld))
        n_chunks = -(-L // c.n)
        if c.paged:
            n_chunks = -(-L // c.bs) * c.split
        for c0 in range(0, n_chunks, per):
            ld = _Obj(kind="paged" if c.paged else "contig", b=b, h0=h0, c0=c0,
                      np=min(per, n_chunks - c0), n=c.n, issued=set())
            # A fold needs a mask where some of its positions lie past a query's reach.
            last_pos = (c0 + ld.np) * c.n - 1
            ld.masked = last_pos > L - (c.sa if c.vllm else 1)
            loads.append(ld)
            folds.append((list(range(h0, h0 + c.hg)), ld))
        heads = {h: _Obj(b=b, h=h) for h in range(h0, h0 + c.hg)}
        for hs, ld in folds:
            ld.users = len(hs)
            for h in hs:
                plan.append((heads[h], ld))
    # first / last unit of each head, and which load each unit prefetches
    seen, last = set(), {}
    for k, (st, ld) in enumerate(plan):
        last[id(st)] = k
    # The first unit of load i issues K of load i + 2; V it issues itself four steps before
    # P @ V needs it, so V's tiles are short-lived. The DMA queues get one K and one V per
    # step, and a fold's K lands well before its V: its scores and softmax overlap V's
    # transfer (which matters most for the last fold). Loads of 16 KiB per partition and
    # more (several heads of a paged block) prefetch K one load ahead only, within SBUF.
    units, owned = [], set()
    index = {id(a): i for i, a in enumerate(loads)}
    for k, (st, ld) in enumerate(plan):
        first = id(st) not in seen
        seen.add(id(st))
        pre = []
        if id(ld) not in owned:
            owned.add(id(ld))
            i = index[id(ld)]
            ka = c.k_ahead
            if k == 0:
                pre += [(x, "k") for x in loads[0:ka]]
            pre += [(x, "k") for x in loads[i + ka:i + ka + 1]]
        units.append(_unit(c, st, ld, first, last[id(st)] == k, pre))
    return units


def _issue(c, ld, what):
    """The cache DMAs of one load's K (what="k") or V: tiles [np, n * heads * d] whose
    partition p holds tokens (c0 + p) * n ..., or K already transposed [d, np * n]. Each is
    one large DMA where the cache is contiguous (the fixed cost per DMA is paid once)."""
    if what in ld.issued:
        return
    ld.issued.add(what)
    P, d, n, np_, b = nl.tile_size.pmax, c.d, ld.n, ld.np, ld.b
    dt = c.dt
    if ld.kind == "active":
        if what == "k":
            ld.kT = nl.ndarray((d, c.sa), dtype=dt, buffer=nl.sbuf)
            src = c.k_act[b, ld.h0] if c.k_act.ndim == 4 else c.k_act[b]
            nisa.dma_copy(dst=ld.kT, src=src)
        else:
            ld.v = nl.ndarray((c.sa, d), dtype=dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=ld.v, src=c.v_act[b, ld.h0])
        return
    w = n * c.hg * d
    if ld.kind == "paged":      # one indirect DMA: the fold's blocks at their table ids
        t = nl.ndarray((np_, w), dtype=dt, buffer=nl.sbuf)
        setattr(ld, what, t)
        nb = np_ // c.split
        if getattr(ld, "ids", None) is None:    # the fold's block ids, shared by K and V
            ld.ids = nl.ndarray((nb, 1), dtype=c.table.dtype, buffer=nl.sbuf)
            row = c.table.shape[1]
            nisa.dma_copy(dst=ld.ids, src=c.table.ap([[1, nb], [1, 1]],
                                                     offset=b * row + ld.c0 // c.split))
        cache = c.kp if what == "k" else c.vp
        hk = c.Hkv
        # Block ids index dim 0; each block's bs tokens land on `split` partitions, n each,
        # the fold's heads h0 .. h0 + hg of every token.
        src = cache.ap([[c.bs * hk * d, nb], [n * hk * d, c.split], [hk * d, n], [d, c.hg], [1, d]],
                       offset=ld.h0 * d, vector_offset=ld.ids, indirect_dim=0)
        nisa.dma_copy(dst=t, src=src)
        return
    # contiguous: the fold's tokens [t0, t0 + np * n), of which [t0, S) exist
    t0, S, h = ld.c0 * n, c.S, ld.h0
    full = min(np_, (S - t0) // n)
    rem = (S - t0) - full * n if full < np_ else 0
    if what == "k" and not c.tp_k:   # K^T straight from the cache: column p * n + t is token t0 + p * n + t
        ld.kT = nl.ndarray((d, np_ * n), dtype=dt, buffer=nl.sbuf)
        have = min(S - t0, np_ * n)
        nisa.dma_copy(dst=ld.kT[:, 0:have], src=c.kp[b, h, :, t0:t0 + have])
        if have < np_ * n:
            nisa.memset(dst=ld.kT[:, have:np_ * n], value=0.0)
        return
    t = nl.ndarray((np_, w), dtype=dt, buffer=nl.sbuf)
    setattr(ld, what, t)
    src_tok = (c.kp if what == "k" else c.vp)[b, h]          # [S, d] of this head
    if full:
        nisa.dma_copy(dst=t[0:full, :], src=src_tok[t0:t0 + full * n, :].reshape((full, w)))
    if rem:     # a last partial run: the rest of the row must not hold NaN garbage
        nisa.dma_copy(dst=t[full:full + 1, 0:rem * d], src=src_tok[t0 + full * n:S, :])
        if c.zeros is None:
            c.zeros = nl.ndarray((1, w), dtype=dt, buffer=nl.sbuf)
            nisa.memset(dst=c.zeros, value=0.0)
        nisa.dma_copy(dst=t[full:full + 1, rem * d:w], src=c.zeros[0:1, 0:w - rem * d])


def _k_transposed(c, ld, hl):
    """A function t -> [d, np] stationary operand: the keys t, n + t, 2n + t, ... of the
    fold (one per partition) with d on partitions."""
    n, np_ = ld.n, ld.np
    if ld.kind == "active":
        return lambda t: ld.kT
    if getattr(ld, "kT", None) is not None:
        return lambda t: ld.kT[:, t:np_ * n:n]
    d, dt, item = c.d, c.dt, c.item
    kT = nl.ndarray((d, n * np_), dtype=dt, buffer=nl.sbuf)
    gb = max(1, min(n, 2048 // (np_ * item)))       # transposes per PSUM bank
    for g, t0 in enumerate(range(0, n, gb)):
        tw = min(gb, n - t0)
        t_ps = nl.ndarray((d, tw * np_), dtype=dt, buffer=nl.psum)
        for t in range(t0, t0 + tw):
            col = ((t * c.hg) + hl) * d
            nisa.nc_transpose(dst=t_ps[:, (t - t0) * np_:(t - t0 + 1) * np_],
                              data=ld.k[:, col:col + d])
        dst = kT[:, t0 * np_:(t0 + tw) * np_]
        if g % 3 == 2:          # ScalarE has less else to do than VectorE
            nisa.tensor_copy(dst=dst, src=t_ps)
        else:
            nisa.activation(dst=dst, op=nl.copy, data=t_ps)
    return lambda t: kT[:, t * np_:(t + 1) * np_]


def _done(ld, what):
    """Frees a load's K (or V) tiles once the last head sharing them has used them."""
    k = "left_" + what
    left = getattr(ld, k, ld.users) - 1
    setattr(ld, k, left)
    if left == 0:
        for a in (("k", "kT") if what == "k" else ("v",)):
            setattr(ld, a, None)


def _v(c, ld, hl, t):
    if ld.kind == "active":
        return ld.v
    col = ((t * c.hg) + hl) * c.d
    return ld.v[:, col:col + c.d]


def _mask_tile(c, ld):
    """Additive mask [np, n * R] of a fold: _NEG where key position (c0 + p) * n + t is
    beyond what query i (column g * s_active + i) may see."""
    if ld.kind == "active":
        return c.act_mask
    n, np_, R = ld.n, ld.np, c.R
    m = nl.ndarray((np_, n * R), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=m, pattern=[[1, n], [0, c.G], [-1 if c.vllm else 0, c.sa]],
              offset=ld.c0 * n, channel_multiplier=n)
    nisa.tensor_scalar(dst=m, data=m, op0=nl.greater, operand0=c.thr[0:np_, ld.b:ld.b + 1],
                       op1=nl.multiply, operand1=_NEG, engine=nisa.gpsimd_engine)
    return m


class _Ring:
    """Slots of a reserved PSUM region for the small per-unit tiles (broadcast rows, P @ V
    and its row sums): handed out in rotation, so dozens of short-lived 64..1024-byte tiles
    neither fragment the banks the transposes and scores need nor reuse an address sooner
    than necessary (a reused address waits for its previous readers)."""

    def __init__(self, slot_bytes, slots):
        self.slot, self.n = slot_bytes // 4, slots
        self.t = nl.ndarray((nl.tile_size.pmax, self.slot * slots), dtype=nl.float32,
                            buffer=nl.psum)
        self.busy = [False] * slots
        self.cur = 0

    def take(self, rows, cols):
        """(slot, [rows, cols] tile, its partition pitch in elements)."""
        for k in range(self.n):
            i = (self.cur + k) % self.n
            if not self.busy[i]:
                self.busy[i], self.cur = True, (i + 1) % self.n
                return i, self.t[0:rows, i * self.slot:i * self.slot + cols], self.slot * self.n
        # every slot live (many units in flight): a tile of its own
        return None, nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.psum), cols

    def give(self, i):
        if i is not None:
            self.busy[i] = False


def _unit(c, st, ld, first, last, prefetch):
    """One fold of keys for one kv head: scores, online-softmax update, P @ V."""
    P, d, R, n, np_ = nl.tile_size.pmax, c.d, c.R, ld.n, ld.np
    hl = st.h - ld.h0 if ld.kind != "active" else 0
    for x, what in [(ld, "k")] + prefetch:   # its own K is normally in flight already
        _issue(c, x, what)
    q0 = (st.b * c.H + st.h * c.G) * c.sa     # q^T [d, G * s_active] of this kv head's queries
    qT = c.qT[:, q0:q0 + R]
    masked = ld.kind == "active" or ld.masked
    yield 2
    kT = _k_transposed(c, ld, hl)
    mask = _mask_tile(c, ld) if masked and ld.kind != "active" else None
    yield 1
    # scores^T [np, (t, r)] on TensorE, one PSUM bank per group of t, copied out by ScalarE
    # (lightly loaded) as each bank fills; VectorE reads them a step later from SBUF
    s = nl.ndarray((np_, n * R), dtype=nl.float32, buffer=nl.sbuf)
    tb = max(1, min(n, 512 // R))
    for t0 in range(0, n, tb):
        tw = min(tb, n - t0)
        s_ps = nl.ndarray((np_, tw * R), dtype=nl.float32, buffer=nl.psum)
        for t in range(t0, t0 + tw):
            nisa.nc_matmul(dst=s_ps[:, (t - t0) * R:(t - t0 + 1) * R], stationary=kT(t), moving=qT)
        dst = s[:, t0 * R:(t0 + tw) * R]
        if masked:
            mt = c.act_mask if mask is None else mask[:, t0 * R:(t0 + tw) * R]
            nisa.tensor_tensor(dst=dst, data1=s_ps, data2=mt, op=nl.add)
        else:
            nisa.activation(dst=dst, op=nl.copy, data=s_ps)
        del s_ps
    del kT, mask
    _done(ld, "k")
    yield 1
    pmax = nl.ndarray((np_, R), dtype=nl.float32, buffer=nl.sbuf)   # over each partition's t
    nisa.tensor_reduce(dst=pmax, op=nl.max, data=s.ap([[n * R, np_], [1, R], [R, n]]), axis=2)
    _issue(c, ld, "v")
    yield 1
    # across partitions on GpSimd
    mrow = nl.ndarray((1, R), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(dst=mrow, op=nl.maximum, data=pmax)
    del pmax
    if not first:       # the running maximum, on GpSimd too: no hop to another engine
        m_new = nl.ndarray((1, R), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=m_new, data1=st.m, data2=mrow, op=nl.maximum,
                           engine=nisa.gpsimd_engine)
        dm = nl.ndarray((1, R), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dm, data1=st.m, data2=m_new, op=nl.subtract,
                           engine=nisa.gpsimd_engine)
        mrow = m_new
    st.m = mrow
    yield 1
    # the running maximum onto every partition: ones[1, 128]^T @ row (TensorE); the
    # correction of the earlier folds, exp(scale * (m_old - m_new)), off the critical path
    ring = c.ring
    ib, bm, pitch = ring.take(P, R)
    nisa.nc_matmul(dst=bm, stationary=c.ones_row, moving=mrow)
    if not first:
        corr = nl.ndarray((1, R), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=corr, op=nl.exp, data=dm, scale=c.scale)
    yield 1
    # s -= max, the [np, R] maximum read n times over (a stride-0 access pattern)
    nisa.tensor_tensor(dst=s, data1=s, data2=bm.ap([[pitch, np_], [0, n], [1, R]]), op=nl.subtract)
    ring.give(ib)
    del bm
    if not first:
        ic, bcorr, _ = ring.take(d, R)
        nisa.nc_matmul(dst=bcorr, stationary=c.ones_row[:, 0:d], moving=corr)
    yield 1
    p = nl.ndarray((np_, n * R), dtype=c.p_dtype, buffer=nl.sbuf)
    nisa.activation(dst=p, op=nl.exp, data=s, scale=c.scale)
    del s
    if not first:
        corr_d = nl.ndarray((d, R), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=corr_d, op=nl.copy, data=bcorr)
        ring.give(ic)
        del bcorr
    yield 1
    # P @ V (keys contracted on partitions) -> [d, R]; the row sums of P beside it
    ps = nl.ndarray((np_, R), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=ps, op=nl.add, data=p.ap([[n * R, np_], [1, R], [R, n]]), axis=2)
    io, ol, _ = ring.take(d, 2 * R)
    for t in range(n):
        nisa.nc_matmul(dst=ol[:, 0:R], stationary=_v(c, ld, hl, t), moving=p[:, t * R:(t + 1) * R],
                       accumulate=t > 0)
    del p
    _done(ld, "v")
    yield 1
    nisa.nc_matmul(dst=ol[:, R:2 * R], stationary=c.ones_pd[0:np_, :], moving=ps)
    yield 1
    if first:
        st.acc = nl.ndarray((d, 2 * R), dtype=nl.float32, buffer=nl.sbuf)  # [P @ V | row sums]
        nisa.tensor_copy(dst=st.acc, src=ol)
    else:
        nisa.tensor_tensor(dst=st.acc, data1=st.acc, data2=corr_d.ap([[R, d], [0, 2], [1, R]]),
                           op=nl.multiply)
        nisa.tensor_tensor(dst=st.acc, data1=st.acc, data2=ol, op=nl.add)
    ring.give(io)
    del ol
    if last:
        o = nl.ndarray((d, R), dtype=c.out.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=st.acc[:, 0:R], data2=st.acc[:, R:2 * R], op=nl.divide)
        H, sa, G = c.H, c.sa, c.G
        dst = c.out.ap([[sa, d], [d * sa, G], [1, sa]], offset=(st.b * H + st.h * G) * d * sa)
        nisa.dma_copy(dst=dst, src=o)
        st.acc = st.m = None
