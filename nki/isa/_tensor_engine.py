"""TensorE instructions: matrix multiply and transpose through the systolic array."""
from __future__ import annotations

import numpy as np

from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules
from ..simulator import tensore as _tensore
from ._common import _ENG, _FP_MM, _T, _close_groups, _f32, _flat, _issue, _mi, _put
from .constants import engine, matmul_perf_mode


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None):
    """dst = stationary.T @ moving on TensorE; fp32 accumulation in PSUM."""
    I = "nc_matmul"
    sim = _ctx.current()
    p = sim.profile
    _T(dst, "dst", I), _T(stationary, "stationary", I), _T(moving, "moving", I)
    K, M, N = stationary.shape[0], stationary.free_size, moving.free_size
    if moving.shape[0] != K:
        _rules.fail(E.MatmulTileError, f"{I}: stationary {tuple(stationary.shape)} and moving "
                    f"{tuple(moving.shape)} must share the contraction (partition) size")
    if K > p.pe_rows:
        _rules.fail(E.MatmulTileError, f"{I}: contraction (partition) size {K} > {p.pe_rows}")
    if M > p.pe_cols:
        _rules.fail(E.MatmulTileError, f"{I}: stationary free size {M} > {p.pe_cols} "
                    f"(nl.tile_size.gemm_stationary_fmax)")
    if N > p.gemm_moving_fmax:
        _rules.fail(E.MatmulTileError, f"{I}: moving free size {N} > {p.gemm_moving_fmax} "
                    f"(nl.tile_size.gemm_moving_fmax)")
    if dst.shape[0] != M or dst.free_size != N:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must be ({M}, {N}) for "
                    f"stationary {tuple(stationary.shape)} and moving {tuple(moving.shape)}")
    for t, w in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype.name not in _FP_MM:
            _rules.fail(E.DtypeLegalityError, f"{I}: {w} dtype {t.dtype.name} is not supported "
                        f"(float8_e4m3/float8_e5m2/bfloat16/float16/tfloat32/float32)")
    if (stationary.dtype.name == "float32") != (moving.dtype.name == "float32"):
        _rules.fail(E.DtypeLegalityError, f"{I}: fp32 matmul needs both inputs fp32, got "
                    f"{stationary.dtype.name} and {moving.dtype.name}")
    if is_transpose:
        if dst.dtype != stationary.dtype:
            _rules.fail(E.DtypeLegalityError, f"{I}: a transpose (is_transpose=True) writes the input "
                        f"dtype {stationary.dtype.name}, dst is {dst.dtype.name}")
    elif dst.dtype.name not in ("float32", "bfloat16"):
        _rules.fail(E.DtypeLegalityError, f"{I}: matmul results are float32 in PSUM; dst dtype "
                    f"{dst.dtype.name} is not allowed")
    if dst.kind == "psum":
        b = dst.box()[1]
        bank = p.psum_bank_bytes
        if b[3] - b[2] > bank or b[2] // bank != (b[3] - 1) // bank:
            _rules.fail(E.PsumBankError, f"{I}: output {tuple(dst.shape)} occupies PSUM bytes "
                        f"[{b[2]}, {b[3]}) per partition; a matmul writes within one "
                        f"{bank}-byte PSUM bank")
    if perf_mode == matmul_perf_mode.double_row and sim.profile.nki_target == "gen2":
        _rules.fail(E.NkiRuleError, f"{I}: perf_mode double_row is not supported on NeuronCore-v2")
    cycles = max(min(64, M), N)
    if stationary.dtype.name == "float32":
        cycles *= 4
    elif perf_mode == matmul_perf_mode.double_row:
        cycles = cycles / 2
    sim.compute(I, "tensor", cycles, [stationary, moving], [dst])
    # Accumulation groups: the first matmul into a PSUM region overwrites it, later ones add.
    acc = False
    groups = dst.buf.groups
    if groups is not None:
        b = dst.box()[1]
        open_ = b in groups
        if accumulate is None:
            acc = open_
        elif accumulate:
            if not open_ and sim.profile.nki_target != "gen2":
                _rules.fail(E.PsumAccumulateError,
                            f"{I}: accumulate=True onto PSUM {dst.name!r} that no matmul of an open "
                            f"accumulation group wrote; the first matmul into a PSUM location must "
                            f"use accumulate=False (accumulating onto PSUM initialised by another "
                            f"instruction is undefined on NeuronCore-v3+)")
            acc = True
        if not open_:
            _close_groups(dst)
            groups.append(b)
    elif accumulate:
        acc = True
    a = stationary.v if stationary.v.ndim == 2 else _flat(stationary)
    m = moving.v if moving.v.ndim == 2 else _flat(moving)
    out = dst.v
    if out.ndim == 2 and dst.dtype.name == "float32":
        if acc:
            def work():
                tmp = _tensore.pool().tmp(out.shape)
                np.matmul(a.T, m, out=tmp)
                np.add(out, tmp, out=out)
        else:
            def work():
                np.matmul(a.T, m, out=out)
    else:
        def work():
            r = a.T @ m
            _put(dst, r + _f32(dst) if acc else r)
    key = dst.box()[1][2] // p.psum_bank_bytes if dst.kind == "psum" else 0
    # Outside a kernel run (interactive use) nothing would drain the queue: run inline.
    _tensore.pool().submit(key, K * M * N if sim.in_run else 0, work,
                           (stationary.buf.data, moving.buf.data, dst.buf.data))


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst = data.T (partition <-> free) on TensorE (to PSUM) or VectorE (32x32 blocks)."""
    I = "nc_transpose"
    _T(dst, "dst", I), _T(data, "data", I)
    P, F = data.shape[0], data.free_size
    if dst.shape[0] != F or dst.free_size != P:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must be ({F}, {P}) for data {tuple(data.shape)}")
    eng = _ENG.get(engine) or ("tensor" if dst.kind == "psum" else "vector")
    if eng == "vector":
        if P > 32 or F > 32:
            _rules.fail(E.ShapeMismatchError, f"{I}: VectorE transposes at most 32x32, got {P}x{F}")
        cycles = max(_mi(), F)
    else:
        p = _ctx.current().profile
        if P > p.pe_rows or F > p.pe_cols:
            _rules.fail(E.MatmulTileError, f"{I}: TensorE transposes at most {p.pe_rows}x{p.pe_cols}, got {P}x{F}")
        if dst.dtype != data.dtype:
            _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}")
        cycles = max(min(64, F), P) * (4 if data.dtype.name == "float32" else 1)
    _issue(I, eng, cycles, [data], [dst])
    if dst.buf.groups is not None and eng == "tensor":
        _close_groups(dst)
    _put(dst, _flat(data).T.copy())
