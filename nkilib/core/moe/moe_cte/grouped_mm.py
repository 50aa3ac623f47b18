"""Grouped matmul: the kernel ``torch._grouped_mm`` on neuron is modelled by (ours; AWS's
NKI-lib has no such kernel).

``grouped_mm(mat_a, mat_b, offs)`` is PyTorch's 2-D x 3-D form: ``mat_a`` [M_total, K] holds
the rows of G groups one after another, ``mat_b`` [G, K, N] one weight per group and ``offs``
[G] (int32) each group's cumulative row end. Rows offs[g-1]..offs[g] of the result [M_total, N]
are those rows of ``mat_a`` times ``mat_b[g]``; rows past offs[-1] are zero. Groups may be
empty and of any size.

The offsets are data: the kernel reads them into registers, as the device would, and tiles
each group into row tiles of up to 128 rows. For every group and block of up to 1024 output
columns the weight block is loaded once and stays in SBUF for all the group's row tiles. A row
tile is loaded row-major (contiguous DMA rows), put K-on-partitions by TensorE transposes and
multiplied against 512-column slices of the weight block, K in 128-row chunks accumulated in
PSUM. TensorE transposes the next tile between the current tile's matmuls, and the PSUM
copies alternate between VectorE and ScalarE, so TensorE does not wait on either.
"""
from __future__ import annotations

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

_BANK_F32 = 512          # fp32 values per partition in one 2 KiB PSUM bank
_W_BUDGET = 48 * 1024    # bytes per partition one weight block may take in SBUF (two live)


def _fail(cls, msg):
    raise cls(f"grouped_mm: {msg}")


@nki.jit
def grouped_mm(mat_a, mat_b, offs):
    P = nl.tile_size.pmax
    if mat_a.ndim != 2 or mat_b.ndim != 3 or offs.ndim != 1:
        _fail(E.ShapeMismatchError, f"expects mat_a [M, K], mat_b [G, K, N] and offs [G]; got "
              f"{tuple(mat_a.shape)}, {tuple(mat_b.shape)} and {tuple(offs.shape)}")
    M, K = mat_a.shape
    G, Kb, N = mat_b.shape
    if Kb != K or offs.shape[0] != G:
        _fail(E.ShapeMismatchError, f"mat_a {tuple(mat_a.shape)}, mat_b {tuple(mat_b.shape)} and "
              f"offs {tuple(offs.shape)} disagree (need mat_b [G, {K}, N] and offs [G])")
    if mat_a.dtype != mat_b.dtype or mat_a.dtype not in (nl.float32, nl.bfloat16):
        _fail(E.DtypeLegalityError, f"mat_a and mat_b must both be float32 or bfloat16, got "
              f"{mat_a.dtype.name} and {mat_b.dtype.name}")
    if offs.dtype != nl.int32:
        _fail(E.DtypeLegalityError, f"offs must be int32, got {offs.dtype.name}")
    dt = mat_a.dtype
    out = nl.ndarray((M, N), dtype=dt, buffer=nl.shared_hbm)
    ends = _read_offsets(offs, M)
    nk = (K + P - 1) // P
    # Widest column block (at most 1024, so two PSUM slots take 4 banks) whose weights fit
    # the SBUF budget; narrower than a bank only for very large K.
    bn = 1024
    while bn > P and nk * bn * dt.itemsize > _W_BUDGET:
        bn //= 2
    bn = min(bn, N)
    c = _Cfg(a=mat_a, b=mat_b, out=out, dt=dt, K=K, N=N, nk=nk, bn=bn)
    # How many 128x128 transposes share one PSUM bank (they keep the input dtype).
    c.per_bank = max(1, 2048 // (P * dt.itemsize))
    c.t_ring = nl.ndarray((P, 2, c.per_bank * P), dtype=dt, buffer=nl.psum)
    # slots of whole banks, so every 512-column slice sits in one bank
    c.m_ring = nl.ndarray((P, 2, -(-bn // _BANK_F32) * _BANK_F32), dtype=nl.float32,
                          buffer=nl.psum)
    c.n_t = 0
    units = []
    start = 0
    for g in range(G):
        end = ends[g]
        for n0 in range(0, N, bn):
            for r0 in range(start, end, P):
                units.append((g, n0, min(bn, N - n0), r0, min(P, end - r0)))
        start = end
    _zero_tail(c, start, M)
    _run(c, units)
    return out


def _read_offsets(offs, M):
    """The group ends as host-visible loop bounds: each offset through a scalar register."""
    G = offs.shape[0]
    o_sb = nl.ndarray((1, G), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=o_sb, src=offs.reshape((1, G)))
    reg = nisa.register_alloc(0)
    ends, prev = [], 0
    for g in range(G):
        nisa.register_load(reg, o_sb[0:1, g:g + 1])
        e = int(reg)
        if e < prev or e > M:
            _fail(E.IndexOutOfBoundsError, f"offs must be non-decreasing and at most M_total={M}; "
                  f"offs[{g}] = {e} after {prev}")
        ends.append(e)
        prev = e
    return ends


def _zero_tail(c, start, M):
    """Rows past the last group: zeros, as PyTorch's kernel leaves them."""
    P = nl.tile_size.pmax
    if start >= M:
        return
    z = nl.ndarray((P, c.N), dtype=c.dt, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0, engine=nisa.gpsimd_engine)
    for r0 in range(start, M, P):
        r = min(P, M - r0)
        nisa.dma_copy(dst=c.out[r0:r0 + r, :], src=z[0:r, :])


def _load_weights(c, key):
    """One weight block, [128, K/128, w] with K row k*128 + p on partition p."""
    P = nl.tile_size.pmax
    g, n0, w = key
    wt = nl.ndarray((P, c.nk, w), dtype=c.dt, buffer=nl.sbuf)
    for k in range(c.nk):
        kr = min(P, c.K - k * P)
        nisa.dma_copy(dst=wt[0:kr, k, :], src=c.b[g, k * P:k * P + kr, n0:n0 + w])
    return wt


def _load(c, u, weights):
    """DMA of a unit's rows (row-major: contiguous rows), and of its weight block if that is
    not loaded yet."""
    g, n0, w, r0, r = u
    if u[:3] not in weights:
        weights[u[:3]] = _load_weights(c, u[:3])
    a_sb = nl.ndarray((r, c.K), dtype=c.dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=a_sb, src=c.a[r0:r0 + r, :])
    return _Tile(u=u, w=weights[(g, n0, w)], a=a_sb)


class _Tile:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _transpose_rounds(c, t):
    """Generator: TensorE transposes of the tile's K chunks, one PSUM bank per round, each
    copied to SBUF (VectorE and ScalarE in turn) right after; yields between rounds."""
    P = nl.tile_size.pmax
    r = t.u[4]
    t.aT = nl.ndarray((P, c.nk, r), dtype=c.dt, buffer=nl.sbuf)
    for k0 in range(0, c.nk, c.per_bank):
        ks = range(k0, min(c.nk, k0 + c.per_bank))
        slot = c.n_t % 2
        c.n_t += 1
        for j, k in enumerate(ks):
            kr = min(P, c.K - k * P)
            nisa.nc_transpose(dst=c.t_ring[0:kr, slot, j * P:j * P + r], data=t.a[:, k * P:k * P + kr])
        for j, k in enumerate(ks):
            kr = min(P, c.K - k * P)
            src = c.t_ring[0:kr, slot, j * P:j * P + r]
            if (k0 // c.per_bank) % 2:
                nisa.activation(dst=t.aT[0:kr, k, :], op=nl.copy, data=src)
            else:
                nisa.tensor_copy(dst=t.aT[0:kr, k, :], src=src)
        yield


def _matmuls(c, t, slot):
    """The tile's matmuls as a list of thunks, K-major so they can be split into rounds."""
    P = nl.tile_size.pmax
    g, n0, w, r0, r = t.u
    acc = c.m_ring[0:r, slot, 0:w]
    ops = []
    for k in range(c.nk):
        kr = min(P, c.K - k * P)
        for s0 in range(0, w, _BANK_F32):
            sw = min(_BANK_F32, w - s0)
            ops.append((acc[:, s0:s0 + sw], t.aT[0:kr, k, :], t.w[0:kr, k, s0:s0 + sw], k > 0))
    return ops


def _finish(c, t, slot, parity):
    """PSUM to SBUF (one bank at a time, VectorE and ScalarE in turn) and to HBM."""
    g, n0, w, r0, r = t.u
    o = nl.ndarray((r, w), dtype=c.dt, buffer=nl.sbuf)
    for i, s0 in enumerate(range(0, w, _BANK_F32)):
        sw = min(_BANK_F32, w - s0)
        src = c.m_ring[0:r, slot, s0:s0 + sw]
        if (i + parity) % 2:
            nisa.activation(dst=o[:, s0:s0 + sw], op=nl.copy, data=src)
        else:
            nisa.tensor_copy(dst=o[:, s0:s0 + sw], src=src)
    nisa.dma_copy(dst=c.out[r0:r0 + r, n0:n0 + w], src=o)


def _run(c, units):
    """Software pipeline over the row tiles: weight blocks load one block ahead and rows two
    tiles ahead, the next tile's transposes are spread between this tile's matmuls, and the
    tile's results leave PSUM while TensorE works on the next one."""
    if not units:
        return
    keys = []
    for u in units:
        if not keys or keys[-1] != u[:3]:
            keys.append(u[:3])
    weights = {keys[0]: _load_weights(c, keys[0])}
    kj = 0                                # index of the weight block in use
    tiles = [_load(c, units[0], weights)]
    if len(units) > 1:
        tiles.append(_load(c, units[1], weights))
    for _ in _transpose_rounds(c, tiles[0]):
        pass
    for i in range(len(units)):
        if units[i][:3] != keys[kj]:      # a new block is in use: the one before can go
            weights.pop(keys[kj], None)
            kj += 1
        if kj + 1 < len(keys) and keys[kj + 1] not in weights:
            weights[keys[kj + 1]] = _load_weights(c, keys[kj + 1])
        if i + 2 < len(units):
            tiles.append(_load(c, units[i + 2], weights))
        cur = tiles[i]
        nxt = tiles[i + 1] if i + 1 < len(units) else None
        rounds = _transpose_rounds(c, nxt) if nxt is not None else iter(())
        n_rounds = (c.nk + c.per_bank - 1) // c.per_bank if nxt is not None else 0
        ops = _matmuls(c, cur, i % 2)
        step = max(1, -(-len(ops) // (n_rounds + 1)))
        for j in range(0, len(ops), step):
            for dst, st, mv, acc in ops[j:j + step]:
                nisa.nc_matmul(dst=dst, stationary=st, moving=mv, accumulate=acc)
            next(rounds, None)
        for _ in rounds:                 # rounds left when there were fewer matmul pieces
            pass
        _finish(c, cur, i % 2, i)
        tiles[i] = None                  # its SBUF tiles can go
