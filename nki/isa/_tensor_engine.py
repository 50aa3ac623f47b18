"""TensorE instructions: matrix multiply and transpose through the systolic array."""
from __future__ import annotations

import numpy as np

from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules
from ..simulator import tensore as _tensore
from . import _mx
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
        # transpose mode (NeuronCore-v3+) runs fp32 transposes 2x faster than an fp32 matmul
        # (Trainium2 architecture guide, "Built-in Transpose Support")
        cycles *= 2 if is_transpose and sim.profile.nki_target != "gen2" else 4
    elif perf_mode == matmul_perf_mode.double_row:
        cycles = cycles / 2
    sim.compute(I, "tensor", cycles, [stationary, moving], [dst])
    acc = _accumulates(sim, I, dst, accumulate)
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


def _accumulates(sim, I, dst, accumulate) -> bool:
    """Accumulation groups: the first matmul into a PSUM region overwrites it, later ones add."""
    groups = dst.buf.groups
    if groups is None:
        return bool(accumulate)
    b = dst.box()[1]
    open_ = b in groups
    acc = open_
    if accumulate is not None:
        acc = bool(accumulate)
        if acc and not open_ and sim.profile.nki_target != "gen2":
            _rules.fail(E.PsumAccumulateError,
                        f"{I}: accumulate=True onto PSUM {dst.name!r} that no matmul of an open "
                        f"accumulation group wrote; the first matmul into a PSUM location must "
                        f"use accumulate=False (accumulating onto PSUM initialised by another "
                        f"instruction is undefined on NeuronCore-v3+)")
    if not open_:
        _close_groups(dst)
        groups.append(b)
    return acc


def _mx_tiling(I, K, tile_position, tile_size):
    """Row tiling only: (row_size, 128) tiles of 32/64/128 PE rows, at a multiple of row_size."""
    if not tile_position and not tile_size:
        return
    if not tile_position or not tile_size:
        _rules.fail(E.MatmulTileError, f"{I}: tile_position and tile_size must both be set (or neither), "
                    f"got {tile_position} and {tile_size}")
    (r0, c0), (rs, cs) = (int(x) for x in tile_position), (int(x) for x in tile_size)
    if cs != 128 or c0 != 0:
        _rules.fail(E.MatmulTileError, f"{I}: only row tiling is supported: column_size must be 128 and "
                    f"start_column 0, got tile_size {tuple(tile_size)}, tile_position {tuple(tile_position)}")
    if rs not in (32, 64, 128) or r0 % rs or not 0 <= r0 < 128:
        _rules.fail(E.MatmulTileError, f"{I}: row tile {rs} at row {r0}: row_size must be 32, 64 or 128 "
                    f"and start_row a multiple of it below 128")
    if K > rs:
        _rules.fail(E.MatmulTileError, f"{I}: stationary spans {K} partitions, more than the {rs}-row tile")


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None,
                 tile_size=None, accumulate=None, name=None):
    """dst = deq(stationary).T @ deq(moving) for MXFP8/MXFP4 x4 tiles on TensorE (trn3).

    The contraction runs over the partitions and the 4 values of each x4 word; deq multiplies
    each group of 8 partitions x 4 values by its E8M0 scale (see nki.isa._mx for the scale
    layout). Products accumulate in fp32; dst (PSUM) is float32 or bfloat16."""
    I = "nc_matmul_mx"
    sim = _ctx.current()
    _mx.require_gen4(I, sim)
    for t, w in ((dst, "dst"), (stationary, "stationary"), (moving, "moving"),
                 (stationary_scale, "stationary_scale"), (moving_scale, "moving_scale")):
        _T(t, w, I)
    _check_mx_matmul(I, dst, stationary, moving)
    _mx.check_scale(I, stationary_scale, stationary, "stationary_scale")
    _mx.check_scale(I, moving_scale, moving, "moving_scale")
    K, M, N = stationary.shape[0], stationary.free_size, moving.free_size
    _mx_tiling(I, K, tile_position, tile_size)
    # Each PE multiplies 4 value pairs a cycle: a bf16 matmul's cycles for 4x the contraction.
    reads = [stationary, moving, _mx.scale_span(stationary_scale, K), _mx.scale_span(moving_scale, K)]
    sim.compute(I, "tensor", max(min(64, M), N), reads, [dst])
    acc = _accumulates(sim, I, dst, accumulate)
    r = _mx.dequantize(stationary, stationary_scale).T @ _mx.dequantize(moving, moving_scale)
    _put(dst, r + _f32(dst) if acc else r)


def _check_mx_matmul(I, dst, stationary, moving):
    K, M, N = stationary.shape[0], stationary.free_size, moving.free_size
    for t, w in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype.name not in _mx.DATA:
            _rules.fail(E.DtypeLegalityError, f"{I}: {w} dtype must be float8_e5m2_x4, float8_e4m3fn_x4 "
                        f"or float4_e2m1fn_x4, got {t.dtype.name}")
    if dst.dtype.name not in ("float32", "bfloat16"):
        _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype must be float32 or bfloat16, got {dst.dtype.name}")
    if moving.shape[0] != K:
        _rules.fail(E.MatmulTileError, f"{I}: stationary {tuple(stationary.shape)} and moving "
                    f"{tuple(moving.shape)} must share the contraction (partition) size")
    # AWS's docs allow any multiple of 32; NKI-lib pads 96 to 128 because the PE array
    # takes 32, 64 or 128 rows for MX.
    if K not in (32, 64, 128):
        _rules.fail(E.MatmulTileError, f"{I}: contraction (partition) size {K} must be 32, 64 or 128")
    if M % 2 or M > 128:
        _rules.fail(E.MatmulTileError, f"{I}: stationary free size {M} must be even and at most 128")
    nmax = 4096 if dst.dtype.name == "float32" else 8192      # all 8 PSUM banks
    if N > nmax:
        _rules.fail(E.MatmulTileError, f"{I}: moving free size {N} > {nmax} for a {dst.dtype.name} dst")
    if dst.shape[0] != M or dst.free_size != N:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must be ({M}, {N}) for "
                    f"stationary {tuple(stationary.shape)} and moving {tuple(moving.shape)}")


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
        fp32 = 2 if p.nki_target != "gen2" else 4       # transpose mode, as in nc_matmul
        cycles = max(min(64, F), P) * (fp32 if data.dtype.name == "float32" else 1)
    _issue(I, eng, cycles, [data], [dst])
    if dst.buf.groups is not None and eng == "tensor":
        _close_groups(dst)
    _put(dst, _flat(data).T.copy())
