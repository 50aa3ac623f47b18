"""Configuration of the top-k kernels: AWS's ``TopkConfig`` and ``RotationalTopkConfig`` and
the factories that build them, with the plan our kernel follows.

The plan: rows (BxS, split over the LNC programs) are taken ``tile_size`` at a time; each row's
vocabulary is cut into ``n_stages`` stages of ``stage_free_size`` elements, each stage on its
own partition (stage s of row b on partition s * tile_size + b), so few rows still fill the
partitions and no instruction exceeds VectorE's 16384-element limit. Each partition finds its
``local_top_k_per_stage`` best (k rounded up to 8); with several stages the candidates of a
row meet on one partition for a final top-k. The factory picks the stage count that
minimises a VectorE cycle estimate of both phases.
"""
from __future__ import annotations

from dataclasses import dataclass

import nki.language as nl
from nki import errors as E

_PMAX = 128
_MAX_FREE = 16384        # max8 / nc_match_replace8 read at most this many elements per partition
_MERGE_CYCLES = 2000     # the candidates' round trip through HBM, as VectorE cycles it may cost


@dataclass(frozen=True, eq=True)
class TopkConfig(nl.NKIObject):
    """A top-k request: the k largest along the last dim of ``inp_shape``, over ``n_prgs``
    programs (each taking ``per_lnc_BxS`` rows)."""

    inp_shape: tuple
    k: int
    sorted: bool
    inp_dtype: object
    index_dtype: object
    BxS: int
    vocab_size: int
    out_shape: tuple
    n_prgs: int
    prg_id: int
    per_lnc_BxS: int
    _pmax: int = _PMAX

    def inp_shape_valid(self) -> bool:
        return len(self.inp_shape) >= 2

    def vocab_size_valid(self) -> bool:
        return 1 <= self.k <= self.vocab_size

    def is_valid(self) -> bool:
        return self.inp_shape_valid() and self.vocab_size_valid()


def create_topk_config(inp_shape, inp_dtype, k, sorted=True, num_programs=2):
    """A ``TopkConfig`` for an input of ``inp_shape`` (2-D or more; leading dims are rows).
    A single row runs on one program whatever ``num_programs`` says (as in AWS's)."""
    inp_shape = tuple(int(n) for n in inp_shape)
    if len(inp_shape) < 2:
        raise E.ShapeMismatchError(f"topk: the input must be at least 2-D, got {inp_shape}")
    BxS, V = 1, inp_shape[-1]
    for n in inp_shape[:-1]:
        BxS *= n
    if not 1 <= k <= V:
        raise E.ShapeMismatchError(f"topk: k must be in [1, {V}] for input {inp_shape}, got {k}")
    n_prgs = 1 if BxS == 1 else int(num_programs)
    return TopkConfig(inp_shape=inp_shape, k=int(k), sorted=bool(sorted), inp_dtype=inp_dtype,
                      index_dtype=nl.uint32, BxS=BxS, vocab_size=V, out_shape=inp_shape[:-1] + (int(k),),
                      n_prgs=n_prgs, prg_id=0, per_lnc_BxS=-(-BxS // n_prgs))


@dataclass(frozen=True, eq=True)
class RotationalTopkConfig(nl.NKIObject):
    """The plan ``rotational_topk`` runs for a [BxS, V] input (see the module docstring).
    Build it with ``create_rotational_topk_config``; frozen, so it can key a kernel cache."""

    inp_shape: tuple
    BxS: int
    vocab_size: int
    orig_k: int
    padded_k: int
    n_prgs: int
    prg_id: int
    per_lnc_BxS: int
    inp_dtype: object
    index_dtype: object
    local_top_k_per_stage: int
    n_stages: int
    stage_free_size: int
    padded_vocab_size: int
    sorted: bool
    tile_size: int
    n_bxs_tiles: int
    topk_config: TopkConfig
    _pmax: int = _PMAX


def create_rotational_topk_config(inp_shape, topk_config, shared_const_cache=None):
    """The plan for a 2-D input [BxS, V] and the request ``topk_config``.
    ``shared_const_cache`` is accepted for AWS's signature: our kernel builds its constants
    on chip."""
    inp_shape = tuple(int(n) for n in inp_shape)
    if len(inp_shape) != 2 or inp_shape[0] != topk_config.BxS or inp_shape[1] != topk_config.vocab_size:
        raise E.ShapeMismatchError(f"rotational_topk: the input must be 2-D ({topk_config.BxS}, "
                                   f"{topk_config.vocab_size}) for {topk_config.inp_shape}, got {inp_shape}")
    k, V, rows = topk_config.k, topk_config.vocab_size, topk_config.per_lnc_BxS
    S, r = _plan(k, V, rows)
    kk = -(-k // 8) * 8
    F = -(-V // S)
    return RotationalTopkConfig(
        inp_shape=inp_shape, BxS=topk_config.BxS, vocab_size=V, orig_k=k, padded_k=S * kk,
        n_prgs=topk_config.n_prgs, prg_id=0, per_lnc_BxS=rows, inp_dtype=topk_config.inp_dtype,
        index_dtype=topk_config.index_dtype, local_top_k_per_stage=kk, n_stages=S,
        stage_free_size=F, padded_vocab_size=S * F, sorted=True, tile_size=r,
        n_bxs_tiles=-(-rows // r), topk_config=topk_config)


def _plan(k, V, rows):
    """(n_stages, rows per tile) with the lowest VectorE cycle estimate: ceil(k/8) rounds of
    max8 + match_replace8 over each stage, then (several stages) the same over the
    n_stages * kk candidates, one range_select per output to fetch its index, and the
    candidates' round trip."""
    kk = -(-k // 8) * 8
    best = None
    s_min = -(-V // _MAX_FREE)
    for S in range(s_min, min(_PMAX, max(s_min, V // 8)) + 1):
        F = -(-V // S)
        if S > 1 and ((S - 1) * F >= V or S * kk > _MAX_FREE):
            continue       # an empty last stage, or too many candidates for one partition
        r = min(rows, _PMAX // S)
        if r < 1:
            break
        cost = kk // 8 * 2 * (max(64, F) + 60)
        if S > 1:
            m = max(64, S * kk) + 60
            cost += -(-k // 8) * 2 * m + k * m + _MERGE_CYCLES
        cost *= -(-rows // r)
        if best is None or cost < best[0]:
            best = (cost, S, r)
    if best is None:
        raise E.ShapeMismatchError(f"rotational_topk: no plan fits vocabulary {V} with k={k} "
                                   f"(at most {_PMAX} stages of {_MAX_FREE} elements)")
    return best[1], best[2]
