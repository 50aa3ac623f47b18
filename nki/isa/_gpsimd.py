"""GpSimd instructions: index patterns, selects, gathers, nonzero/segment scans and random
numbers (with the VectorE ones: dropout, rand2)."""
from __future__ import annotations

import builtins

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
    """GpSimd gather within each group of 16 partitions (one GpSimd core's).

    Each core flattens its 16-partition slice of ``index`` partition-first into one list of
    positions; every partition of the core then gathers, at each position i, the run of
    ``num_elem_per_idx`` elements src_row[i * num_elem_per_idx : (i + 1) * num_elem_per_idx]
    of its own row, so a partition of ``dst`` holds n_indices x num_elem_per_idx elements
    (AWS's example: src (128, 512, 4), index (128, 4), dst (128, 4, 16, 4); AWS's moe_tkg
    gathers each expert's rows so)."""
    I = "local_gather"
    _T(dst, "dst", I), _T(src_buffer, "src_buffer", I), _T(index, "index", I)
    if not index.dtype.is_int:
        _rules.fail(E.DtypeLegalityError, f"{I}: index must be an integer tile, got {index.dtype.name}")
    P = src_buffer.shape[0]
    if P % 16 or index.shape[0] != P or dst.shape[0] != P:
        _rules.fail(E.ShapeMismatchError, f"{I}: src_buffer, index and dst must span the same multiple of 16 partitions")
    k = int(num_elem_per_idx)
    src, idx, out = _flat(src_buffer), _flat(index), _flat(dst).copy()
    if src.shape[1] % k:
        _rules.fail(E.ShapeMismatchError, f"{I}: elements per partition ({src.shape[1]}) must be a "
                                          f"multiple of num_elem_per_idx ({k})")
    per_core = 16 * idx.shape[1]
    n = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 <= n <= per_core:
        _rules.fail(E.ShapeMismatchError, f"{I}: num_valid_indices {n} exceeds the {per_core} "
                                          f"indices of a core's 16-partition slice")
    if n * k > out.shape[1]:
        _rules.fail(E.ShapeMismatchError, f"{I}: {n} indices x {k} elements per partition do not "
                                          f"fit dst's {out.shape[1]} elements per partition")
    _issue(I, "gpsimd", 150 + n * k, [src_buffer, index], [dst])
    rows = src.reshape(P, -1, k)                       # [partition, position, run]
    for c in range(P // 16):
        ii = idx[c * 16:(c + 1) * 16].T.reshape(-1)[:n].astype(np.int64)
        if ii.size and (ii.min() < 0 or ii.max() >= rows.shape[1]):
            _rules.fail(E.IndexOutOfBoundsError,
                        f"{I}: gather index out of range [0, {rows.shape[1]})")
        out[c * 16:(c + 1) * 16, :n * k] = rows[c * 16:(c + 1) * 16, ii, :].reshape(16, -1)
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
    eng = _ENG.get(engine, "vector")
    _issue(I, eng, max(_mi(), dst.free_size), [], [dst])
    sim = _ctx.current()
    if eng in getattr(sim, "_xorwow_loaded", ()) and not dst.dtype.is_float:
        # After rand_set_state the engine draws from its XORWOW states; a narrow dtype keeps
        # the least significant bits of each 32-bit draw.
        dst.v[...] = _draw(sim, eng, dst).astype(dst.dtype.storage).reshape(dst.shape)
        return
    g = _rng(sim)
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
    # The VectorE XORWOW states (rand2) restart from the seed too.
    _states(sim, "vector")[...] = _splitmix(seed & 0xFFFFFFFF, _LANES * 24).reshape(_LANES, 24)


def _require(instr, sim, gen, what=""):
    if int(sim.profile.nki_target[3:]) < gen:
        _rules.fail(E.NkiRuleError, f"{instr}{what} needs NeuronCore-v{gen} or newer; the target is "
                    f"{sim.target} ({sim.profile.nki_target})")


def nc_n_gather(dst, data, indices, name=None):
    """dst[p, j] = data[p, indices[p, j]] with data's free dims flattened, on GpSimd."""
    I = "nc_n_gather"
    _T(dst, "dst", I), _T(data, "data", I), _T(indices, "indices", I)
    if indices.dtype.name != "uint32":
        _rules.fail(E.DtypeLegalityError, f"{I}: indices must be uint32, got {indices.dtype.name}")
    if dst.dtype != data.dtype:
        _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype {dst.dtype.name} must equal data dtype "
                    f"{data.dtype.name}")
    P = data.shape[0]
    if indices.shape[0] != P or dst.shape[0] != P or dst.free_size != indices.free_size:
        _rules.fail(E.ShapeMismatchError, f"{I}: data {tuple(data.shape)}, indices {tuple(indices.shape)} and dst "
                    f"{tuple(dst.shape)} need one partition count, and dst one element per index")
    n = data.free_size
    idx = _flat(indices).astype(np.int64)
    if idx.size and idx.max() >= n:
        _rules.fail(E.IndexOutOfBoundsError, f"{I}: index {int(idx.max())} out of range [0, {n}) of data "
                    f"{tuple(data.shape)}")
    # AWS: one ISA instruction group per 512 data elements per partition; each is charged as
    # a GpSimd pass over the indices (an estimate, like local_gather's).
    _issue(I, "gpsimd", -(-n // 512) * (150 + dst.free_size), [data, indices], [dst])
    dst.v[...] = np.take_along_axis(_flat(data), idx, axis=1).reshape(dst.shape)


def topk(val_dst, idx_dst, src, n, name=None):
    """The K largest of the n bf16 elements of each 16-partition snake (element s at partition
    s % 16, column s // 16 of the group), on GpSimd: K = val_dst's free size; every partition
    of the group receives the group's K values in ascending order (val_dst, bf16) and their
    snake positions (idx_dst, uint32). Among equal values the lower position is taken first."""
    I = "topk"
    _T(val_dst, "val_dst", I), _T(idx_dst, "idx_dst", I), _T(src, "src", I)
    for t, w in ((src, "src"), (val_dst, "val_dst"), (idx_dst, "idx_dst")):
        if t.kind != "sbuf":
            _rules.fail(E.MemoryLegalityError, f"{I}: {w} must be in SBUF, got {t.kind.upper()}")
    if src.dtype.name != "bfloat16" or val_dst.dtype.name != "bfloat16":
        _rules.fail(E.DtypeLegalityError, f"{I}: src and val_dst must be bfloat16, got "
                    f"{src.dtype.name} and {val_dst.dtype.name}")
    if idx_dst.dtype.name != "uint32":
        _rules.fail(E.DtypeLegalityError, f"{I}: idx_dst must be uint32, got {idx_dst.dtype.name}")
    P, K, n = src.shape[0], val_dst.free_size, int(n)
    if P % 16 or val_dst.shape[0] != P or tuple(idx_dst.shape) != tuple(val_dst.shape):
        _rules.fail(E.ShapeMismatchError, f"{I}: the partition count ({P}) must be a multiple of 16, "
                    f"and val_dst {tuple(val_dst.shape)} / idx_dst {tuple(idx_dst.shape)} [{P}, K] alike")
    if not 8 <= n < 65536 or not 1 <= K < 32768 or K > n:
        _rules.fail(E.NkiRuleError, f"{I}: needs 8 <= n < 65536 and 1 <= K <= n (K < 32768); got n={n}, "
                    f"K={K}")
    if src.free_size < -(-n // 16):
        _rules.fail(E.ShapeMismatchError, f"{I}: src {tuple(src.shape)} holds {src.free_size} columns; a "
                    f"snake of {n} elements needs {-(-n // 16)}")
    _issue(I, "gpsimd", 4 * n + K, [src], [val_dst, idx_dst])
    x = _f32(src)
    groups = x.reshape(P // 16, 16, -1).transpose(0, 2, 1).reshape(P // 16, -1)[:, :n]
    # Descending by value, ascending by position among equals; the top K, then ascending.
    order = np.argsort(-groups, axis=1, kind="stable")[:, :K][:, ::-1]
    vals = np.take_along_axis(groups, order, axis=1)
    _put(val_dst, np.repeat(vals, 16, axis=0))
    idx_dst.v[...] = np.repeat(order, 16, axis=0).astype(np.uint32).reshape(idx_dst.shape)


def sequence_bounds(dst, segment_ids, name=None):
    """For each element of a (1, n) tile of segment ids, the [start, end) of its run of equal
    ids: dst (1, 2, n) holds the starts then the ends; id 0 is padding (start n, end -1)."""
    I = "sequence_bounds"
    _T(dst, "dst", I), _T(segment_ids, "segment_ids", I)
    for t, w in ((dst, "dst"), (segment_ids, "segment_ids")):
        if t.dtype.name not in ("float32", "int32"):
            _rules.fail(E.DtypeLegalityError, f"{I}: {w} must be float32 or int32, got {t.dtype.name}")
    n = segment_ids.free_size
    if segment_ids.shape[0] != 1 or dst.shape[0] != 1 or dst.free_size != 2 * n:
        _rules.fail(E.ShapeMismatchError, f"{I}: segment_ids must be (1, n) and dst (1, 2, n); got "
                    f"{tuple(segment_ids.shape)} and {tuple(dst.shape)}")
    _issue(I, "gpsimd", 150 + 2 * n, [segment_ids], [dst])
    s = _flat(segment_ids)[0]
    i = np.arange(n)
    first = np.r_[True, s[1:] != s[:-1]]
    last = np.r_[s[1:] != s[:-1], True]
    start = np.maximum.accumulate(np.where(first, i, 0))
    end = np.minimum.accumulate(np.where(last, i + 1, n)[::-1])[::-1]
    pad = s == 0
    _put(dst, np.stack([np.where(pad, n, start), np.where(pad, -1, end)]))


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """Per GpSimd core (partitions 0, 16, ..., 112 of the tiles only): the indices (+ offset)
    of src's nonzero elements, then padding_val, then their count, on GpSimd (trn2+)."""
    I = "nonzero_with_count"
    _require(I, _ctx.current(), 3)
    _T(dst, "dst", I), _T(src, "src", I)
    if src.dtype.name not in ("float32", "int32"):
        _rules.fail(E.DtypeLegalityError, f"{I}: src must be float32 or int32, got {src.dtype.name}")
    if dst.dtype.name != "int32":
        _rules.fail(E.DtypeLegalityError, f"{I}: dst must be int32, got {dst.dtype.name}")
    if dst.shape[0] != src.shape[0] or dst.free_size != src.free_size + 1:
        _rules.fail(E.ShapeMismatchError, f"{I}: dst {tuple(dst.shape)} must have src's {src.shape[0]} "
                    f"partitions and {src.free_size + 1} elements per partition (src {tuple(src.shape)} + count)")
    for v, w in ((index_offset, "index_offset"), (padding_val, "padding_val")):
        if not isinstance(v, (int, np.integer)) or not -2**31 <= int(v) < 2**31:
            _rules.fail(E.DtypeLegalityError, f"{I}: {w} must be an int32, got {v!r}")
    _issue(I, "gpsimd", 150 + src.free_size, [src], [dst])
    rows = np.arange(0, src.shape[0], 16)
    nz = _flat(src)[rows] != 0
    count = nz.sum(axis=1)
    order = np.argsort(~nz, axis=1, kind="stable")   # nonzero positions first, in order
    pos = np.arange(nz.shape[1])
    vals = np.where(pos < count[:, None], order + int(index_offset), int(padding_val))
    out = np.concatenate([vals, count[:, None]], axis=1).astype(np.int32)
    dst.v[rows] = out.reshape((len(rows),) + tuple(dst.shape[1:]))


# XORWOW PRNG (AWS trn3 arch guide): per compute lane, GpSimd keeps one state of 6 uint32
# words and VectorE (NeuronCore-v4) four, used in turn for consecutive elements. A state is
# read as (x0, x1, x2, x3, x4, counter), Marsaglia's xorwow.
_STATE_WORDS = {"gpsimd": 6, "vector": 24}
_LANES = 128


def _splitmix(seed, n):
    z = (np.uint64(seed) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).astype(np.uint32)


def _states(sim, eng):
    st = getattr(sim, "_xorwow", None)
    if st is None:
        st = sim._xorwow = {}
    if eng not in st:
        w = _STATE_WORDS[eng]
        st[eng] = _splitmix({"gpsimd": 1, "vector": 2}[eng], _LANES * w).reshape(_LANES, w)
    return st[eng]


def _xorwow(s):
    """One step of the states s[..., 0:6] (in place); their 32-bit outputs."""
    t, x0 = s[..., 4].copy(), s[..., 0].copy()
    s[..., 1:5] = s[..., 0:4].copy()
    t ^= t >> 2
    t ^= t << 1
    t ^= x0 ^ (x0 << 4)
    s[..., 0] = t
    s[..., 5] += np.uint32(362437)
    return t + s[..., 5]


def _draw(sim, eng, t: NkiTensor) -> np.ndarray:
    """(P, n) random uint32 for tile t's partitions (lanes), advancing their states."""
    lanes = _states(sim, eng)[t.pstart:t.pstart + t.shape[0]]
    k = _STATE_WORDS[eng] // 6
    s = lanes.reshape(lanes.shape[0], k, 6)
    n = t.free_size
    out = np.empty((lanes.shape[0], -(-n // k) * k), np.uint32)
    for r in range(0, n, k):            # s views the states: each step updates them
        m = min(k, n - r)
        out[:, r:r + m] = _xorwow(s[:, :m])
    return out[:, :n]


def _rand_engine(instr, sim, engine_):
    eng = _ENG.get(engine_)
    if eng not in ("gpsimd", "vector"):
        _rules.fail(E.NkiRuleError, f"{instr}: engine must be nki.isa.engine.gpsimd or vector, got {engine_}")
    _require(instr, sim, 4 if eng == "vector" else 3, f" on {eng}")
    return eng


def _check_state_tile(instr, t, eng, what):
    if t.dtype.name != "uint32":
        _rules.fail(E.DtypeLegalityError, f"{instr}: {what} must be uint32, got {t.dtype.name}")
    if t.free_size != _STATE_WORDS[eng]:
        _rules.fail(E.ShapeMismatchError, f"{instr}: {what} {tuple(t.shape)} must hold {_STATE_WORDS[eng]} "
                    f"XORWOW state words per partition on {eng}")


def rand_set_state(src_seeds, engine=engine.gpsimd, name=None):
    """Load each lane's XORWOW state from the matching partition of src_seeds (uint32, SBUF)."""
    I = "rand_set_state"
    sim = _ctx.current()
    eng = _rand_engine(I, sim, engine)
    _T(src_seeds, "src_seeds", I)
    if src_seeds.kind != "sbuf":
        _rules.fail(E.MemoryLegalityError, f"{I}: src_seeds must be in SBUF, {src_seeds.name!r} is in "
                    f"{src_seeds.kind.upper()}")
    _check_state_tile(I, src_seeds, eng, "src_seeds")
    _issue(I, eng, max(_mi(), src_seeds.free_size), [src_seeds], [])
    p0 = src_seeds.pstart
    _states(sim, eng)[p0:p0 + src_seeds.shape[0]] = _flat(src_seeds).astype(np.uint32)
    sim._xorwow_loaded = getattr(sim, "_xorwow_loaded", set()) | {eng}


def rand_get_state(dst, engine=engine.gpsimd, name=None):
    """Store each lane's XORWOW state into the matching partition of dst (uint32)."""
    I = "rand_get_state"
    sim = _ctx.current()
    eng = _rand_engine(I, sim, engine)
    _T(dst, "dst", I)
    _check_state_tile(I, dst, eng, "dst")
    _issue(I, eng, max(_mi(), dst.free_size), [], [dst])
    p0 = dst.pstart
    dst.v[...] = _states(sim, eng)[p0:p0 + dst.shape[0]].reshape(dst.shape)


_RAND2_DTYPES = {"float8_e4m3", "float8_e5m2", "float16", "bfloat16", "float32", "tfloat32", "int8",
                 "int16", "int32", "uint8", "uint16", "uint32"}


def rand2(dst, min, max, name=None):  # noqa: A002  (AWS's parameter names)
    """Uniform random values in [min, max) from VectorE's XORWOW states (trn3 only); min and
    max are scalars or (P, 1) float32 vectors. A 32-bit draw's top 24 bits make the fraction."""
    I = "rand2"
    sim = _ctx.current()
    _require(I, sim, 4)
    _T(dst, "dst", I)
    if dst.dtype.name not in _RAND2_DTYPES:
        _rules.fail(E.DtypeLegalityError, f"{I}: dst dtype {dst.dtype.name} is not supported")
    for x, w in ((min, "min"), (max, "max")):
        if isinstance(x, NkiTensor) and x.dtype.name != "float32":
            _rules.fail(E.DtypeLegalityError, f"{I}: {w} must be float32, got {x.dtype.name}")
    lo, hi = _operand(min, dst, I, "min"), _operand(max, dst, I, "max")
    reads = [t for t in (min, max) if isinstance(t, NkiTensor)]
    if not reads and not lo < hi:
        _rules.fail(E.NkiRuleError, f"{I}: min ({float(lo)}) must be less than max ({float(hi)})")
    # The four states per lane make 4 values a cycle; streaming dst (1 a cycle) bounds it.
    _issue(I, "vector", builtins.max(_mi(), dst.free_size), reads, [dst])
    u = (_draw(sim, "vector", dst) >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)
    _put(dst, lo + u * (hi - lo))
