"""GpSimd instructions: index patterns, selects, gathers and random numbers."""
from __future__ import annotations

import numpy as np

from .. import _ops
from .. import errors as E
from ..simulator import context as _ctx
from ..simulator import rules as _rules
from ..simulator import tensore as _tensore
from ..simulator.tensor import NkiTensor
from ._common import _ENG, _T, _f32, _flat, _issue, _mi, _op, _operand, _put, _reduce_regs
from .constants import engine, reduce_cmd


def _pattern_values(dst, pattern, offset, channel_multiplier, I):
    pat = [list(p) for p in pattern]
    if len(pat) > 4:
        _rules.fail(E.NkiRuleError, f"{I}: pattern has at most 4 [step, num] pairs")
    steps = np.array([p[0] for p in pat], np.int64)
    nums = [int(p[1]) for p in pat]
    if int(np.prod(nums)) != dst.free_size:
        _rules.fail(E.ShapeMismatchError, f"{I}: pattern generates {int(np.prod(nums))} elements per "
                    f"partition, dst has {dst.free_size}")
    free = np.zeros(1, np.int64)
    for s, n in zip(steps, nums):
        free = (free[:, None] + s * np.arange(n, dtype=np.int64)[None, :]).reshape(-1)
    ch = np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
    return int(offset) + ch + free[None, :]


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, ...] = offset + p*channel_multiplier + sum(step_i * idx_i) on GpSimd."""
    I = "iota"
    _T(dst, "dst", I)
    vals = _pattern_values(dst, pattern, offset, channel_multiplier, I)
    _issue(I, "gpsimd", 150 + dst.free_size, [], [dst])
    _put(dst, vals.astype(np.float32) if dst.dtype.is_float else vals)


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None,
                  offset=0, name=None):
    """dst = on_true where cmp_op(affine(p, i), 0) else on_false_value, on GpSimd."""
    I = "affine_select"
    _T(dst, "dst", I), _T(on_true_tile, "on_true_tile", I)
    _rules.same_elems(I, dst, on_true_tile)
    f = _op(cmp_op if cmp_op is not None else _ops.BINARY["equal"], I, ("compare",))
    vals = _pattern_values(dst, pattern, offset, channel_multiplier, I)
    _issue(I, "gpsimd", 150 + dst.free_size, [on_true_tile], [dst])
    pred = f.fn(vals.astype(np.float64), 0.0) != 0
    _put(dst, np.where(pred, _f32(on_true_tile), np.float32(on_false_value)))


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=None, reverse_pred=False, name=None):
    """dst = where(predicate, on_true, on_false) on VectorE, optionally max-reducing each
    partition into reduce_res (through the VectorE accumulator registers)."""
    I = "select_reduce"
    _T(dst, "dst", I), _T(predicate, "predicate", I), _T(on_true, "on_true", I)
    _rules.same_elems(I, dst, on_true), _rules.same_elems(I, predicate, on_true)
    if on_true.dtype.name in ("tfloat32", "int32", "uint32"):
        _rules.fail(E.DtypeLegalityError, f"{I}: on_true dtype {on_true.dtype.name} is not supported "
                    f"(any dtype except tfloat32, int32, uint32)")
    if predicate.dtype.name not in ("int8", "uint8", "int16", "uint16"):
        _rules.fail(E.DtypeLegalityError, f"{I}: predicate dtype must be int8/uint8/int16/uint16, "
                    f"got {predicate.dtype.name}")
    if on_true.kind == "psum" and predicate.kind == "psum":
        _rules.fail(E.MemoryLegalityError, f"{I}: on_true and predicate cannot both be in PSUM")
    if reduce_op is not None and getattr(reduce_op, "name", None) not in ("maximum", "max"):
        _rules.fail(E.NkiRuleError, f"{I}: reduce_op supports only nl.maximum")
    if reduce_res is not None:
        if reduce_res.shape[0] != on_true.shape[0] or reduce_res.free_size != 1:
            _rules.fail(E.ShapeMismatchError, f"{I}: reduce_res must be ({on_true.shape[0]}, 1), "
                        f"got {tuple(reduce_res.shape)}")
        if not reduce_res.dtype.is_float:
            _rules.fail(E.DtypeLegalityError, f"{I}: reduce_res must be a float tile, got {reduce_res.dtype.name}")
    off = _operand(on_false, on_true, I, "on_false")
    reads = [predicate, on_true] + ([on_false] if isinstance(on_false, NkiTensor) else [])
    writes = [dst] + ([reduce_res] if reduce_res is not None else [])
    _issue(I, "vector", max(_mi(), on_true.free_size), reads, writes)
    pred = _flat(predicate) != 0
    if reverse_pred:
        pred = ~pred
    y = np.where(pred, _f32(on_true), off)
    _put(dst, y)
    if reduce_res is not None or reduce_cmd != type(reduce_cmd).idle:
        sim = _ctx.current()
        cmd = reduce_cmd if reduce_cmd != type(reduce_cmd).idle else type(reduce_cmd).reset_reduce
        regs = _reduce_regs(sim, "vector_regs", y.shape[0], cmd, y.max(axis=1, keepdims=True), np.maximum)
        if reduce_res is not None:
            _put(reduce_res, regs)


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=None, range_start=0, on_false_value=-3.4028235e38, name=None):
    """Keep elements whose free index + range_start satisfies both bound comparisons; max-reduce."""
    I = "range_select"
    sim = _ctx.current()
    if sim.profile.nki_target == "gen2":
        _rules.fail(E.NkiRuleError, f"{I} is available on NeuronCore-v3 and newer only")
    _T(dst, "dst", I), _T(on_true_tile, "on_true_tile", I)
    _rules.same_elems(I, dst, on_true_tile)
    c0, c1 = _op(comp_op0, I, ("compare",)), _op(comp_op1, I, ("compare",))
    b0, b1 = _operand(bound0, on_true_tile, I, "bound0"), _operand(bound1, on_true_tile, I, "bound1")
    reads = [on_true_tile] + [t for t in (bound0, bound1) if isinstance(t, NkiTensor)]
    _issue(I, "vector", max(_mi(), dst.free_size), reads, [dst] + ([reduce_res] if reduce_res is not None else []))
    idx = np.arange(on_true_tile.free_size, dtype=np.float32)[None, :] + np.float32(range_start)
    keep = (c0.fn(idx, b0) != 0) & (c1.fn(idx, b1) != 0)
    y = np.where(keep, _f32(on_true_tile), np.float32(on_false_value))
    _put(dst, y)
    if reduce_res is not None or reduce_cmd != type(reduce_cmd).idle:
        regs = _reduce_regs(sim, "vector_regs", y.shape[0], reduce_cmd, y.max(axis=1, keepdims=True), np.maximum)
        if reduce_res is not None:
            _put(reduce_res, regs)


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """GpSimd gather within each group of 16 partitions.

    Each core flattens its 16-partition slice of index partition-first and uses the indices
    to pick runs of num_elem_per_idx elements from its 16-partition slice of src_buffer
    (flattened the same way); the gathered runs fill dst's 16 partitions partition-first."""
    I = "local_gather"
    _T(dst, "dst", I), _T(src_buffer, "src_buffer", I), _T(index, "index", I)
    if not index.dtype.is_int:
        _rules.fail(E.DtypeLegalityError, f"{I}: index must be an integer tile, got {index.dtype.name}")
    P = src_buffer.shape[0]
    if P % 16 or index.shape[0] != P or dst.shape[0] != P:
        _rules.fail(E.ShapeMismatchError, f"{I}: src_buffer, index and dst must span the same multiple of 16 partitions")
    _issue(I, "gpsimd", 150 + dst.free_size, [src_buffer, index], [dst])
    k = int(num_elem_per_idx)
    src, idx, out = _flat(src_buffer), _flat(index), _flat(dst).copy()
    for c in range(P // 16):
        s = src[c * 16:(c + 1) * 16].T.reshape(-1, k) if (src.shape[1] % k == 0) else None
        if s is None:
            _rules.fail(E.ShapeMismatchError, f"{I}: elements per partition must be a multiple of num_elem_per_idx")
        ii = idx[c * 16:(c + 1) * 16].T.reshape(-1).astype(np.int64)
        if num_valid_indices is not None:
            ii = ii[:int(num_valid_indices)]
        if ii.size and (ii.min() < 0 or ii.max() >= s.shape[0]):
            _rules.fail(E.IndexOutOfBoundsError, f"{I}: gather index out of range [0, {s.shape[0]})")
        g = s[ii].reshape(-1)
        block = out[c * 16:(c + 1) * 16].T.reshape(-1)
        n = min(g.size, block.size)
        block[:n] = g[:n]
        out[c * 16:(c + 1) * 16] = block.reshape(out.shape[1], 16).T
    _put(dst, out)


def _rng(sim):
    if getattr(sim, "_rng", None) is None:
        sim._rng = np.random.default_rng(0)
    return sim._rng


def dropout(dst, data, prob, name=None):
    """Zero each element with probability prob (scalar or (P, 1) tile) on VectorE."""
    I = "dropout"
    _T(dst, "dst", I), _T(data, "data", I)
    _rules.same_elems(I, dst, data)
    if dst.dtype != data.dtype:
        _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype must equal data dtype")
    pr = _operand(prob, data, I, "prob")
    _issue(I, "vector", max(_mi(), data.free_size), [data] + ([prob] if isinstance(prob, NkiTensor) else []), [dst])
    keep = _rng(_ctx.current()).random(_flat(data).shape, dtype=np.float32) >= pr
    _put(dst, np.where(keep, _flat(data), 0))


def rng(dst, engine=engine.unknown, name=None):
    """Random bits (integer dst) or uniform [0, 1) values (float dst)."""
    I = "rng"
    _T(dst, "dst", I)
    _issue(I, _ENG.get(engine, "vector"), max(_mi(), dst.free_size), [], [dst])
    g = _rng(_ctx.current())
    if dst.dtype.is_float:
        _put(dst, g.random(dst.shape, dtype=np.float32))
    else:
        info = np.iinfo(dst.dtype.storage)
        dst.v[...] = g.integers(info.min, info.max, size=dst.shape, dtype=dst.dtype.storage, endpoint=True)


def set_rng_seed(src_seeds, name=None):
    sim = _ctx.current()
    _tensore.drain()
    src = src_seeds
    seed = int(np.asarray(src.v).reshape(-1)[0]) if isinstance(src, NkiTensor) else int(src)
    sim._rng = np.random.default_rng(seed)
