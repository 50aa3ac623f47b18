"""Megatron tensor parallelism replayed from a step traced on one device (docs/plan.md,
"Replaying a traced step"; the shared re-pricing: ``replay.py``).

TP=N (``parallelize_module`` with Colwise/RowwiseParallel):
  every op of a parallel Linear re-priced with its split feature (the column-parallel
  out_features, the row-parallel in_features) divided by N, found by the role each dim plays
  in its matmul (forward, input gradient, weight gradient), and every op between a
  column-parallel Linear and the next row-parallel one (forward; the reverse in backward)
  with every dim equal to a split size, or attention's heads, divided by N; per
  row-parallel Linear in forward, DTensor's division of the replicated bias (a Partial sum)
  and the ``all_reduce`` of its output with the copy functional collectives make; per
  column-parallel Linear that computed an input gradient, the ``all_reduce`` (and copy) of
  that gradient; optimizer ops re-priced for the local shards.
TP=N with sequence parallelism ("sequence" norms in the plan, TorchTitan's layout): the ops
  outside those regions on 1/N of the tokens; the all-reduces become a reduce-scatter, an
  all-gather precedes each colwise Linear in forward and each rowwise one's input gradient
  in backward; the norms' replicated gradients are all-reduced at the end.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .replay import (Replay, _is_optimizer, _local_charge, _optimizer_op,
                     _priced, _root_dim0, _shard_numel, _split_shapes)

_STYLES = ("colwise", "rowwise", "sequence")


def _heads_of(name: str, s: tuple, sizes: frozenset) -> list:
    """The dims of shape ``s`` (an operand of op ``name``, in a region of split ``sizes``) that
    are attention heads by their own: dim 1 of flash attention's (batch, heads, tokens,
    head_dim) operands, or a dim other than the last (in a 4-D shape dim 1 or 2) whose
    product with the last (the head dim) is a split size, as attention's (batch, heads,
    tokens, head_dim) or (batch, tokens, heads, head_dim)."""
    if name.startswith("_scaled_dot_product") and len(s) == 4:
        return [1]
    if len(s) < 3:
        return []
    # in a 4-D shape the heads are dim 1 or 2 (after or before attention's transpose),
    # never the batch
    return [i for i in ((1, 2) if len(s) == 4 else range(len(s) - 1)) if s[i] * s[-1] in sizes]


def _region_heads(ops) -> dict:
    """Split sizes -> the head counts the region ops of those sizes show by their own
    (``_heads_of``), from ``ops`` as (op, sizes): the whole trace is read first, because
    the runtime's records of one module's span are not in issue order."""
    heads = {}
    for o, sizes in ops:
        for s in o.charge.shapes or ():
            if not any(d in sizes for d in s):
                heads.setdefault(sizes, set()).update(s[i] for i in _heads_of(o.charge.name, s, sizes))
    return heads


def _region_shape(name: str, module, s: tuple, sizes: frozenset, n: int, heads: set,
                  anywhere: bool = True) -> tuple:
    """Shape ``s`` (an operand of op ``name`` in ``module``, between a column- and a
    row-parallel Linear) on one rank. A 4-D shape is split on its heads (``_heads_of``, or
    else a dim 1 or 2 equal to a head count such regions show, ``heads``: rotary halves,
    scores), as attention lays it out; another shape, or a 4-D one without heads, on its
    last dim when that is a split size (its features: a sequence as long as a projection is
    wide stays whole), or else (``anywhere``) on every dim equal to a split size. Unchanged
    when none applies."""
    found = _heads_of(name, s, sizes) if len(s) == 4 else []
    if not found and len(s) == 4:
        found = [i for i in (1, 2) if s[i] in heads]
    if len(found) > 1:
        raise ValueError(f"replay: {name} {list(s)} in the tensor-parallel region of module "
                         f"{module!r}: dims {found} could each be the heads of a split size "
                         f"{sorted(sizes)}; the replay cannot tell which tp splits")
    for i in found:
        if s[i] % n:
            raise ValueError(f"replay: tp={n} does not divide the {s[i]} heads (dim {i} of "
                             f"{s}) of {name} in the tensor-parallel region of module "
                             f"{module!r}")
    if not found and s and s[-1] in sizes:
        found = [len(s) - 1]
    elif not found and anywhere:
        found = [i for i, d in enumerate(s) if d in sizes]
    return tuple(d // n if i in found else d for i, d in enumerate(s))


def _region_shapes(o, sizes: frozenset, n: int, heads: set) -> tuple:
    """The shapes of an op between a column- and a row-parallel Linear on one rank
    (``_region_shape``; an operand that broadcasts against the widest one split as it); an
    op none of whose shapes splits is refused."""
    _priced(o)
    shapes = tuple(o.charge.shapes)
    big = max(shapes, key=len, default=())
    split = _region_shape(o.charge.name, o.module, big, sizes, n, heads)
    new = []
    for s in shapes:
        lead = len(big) - len(s)
        if all(d in (1, big[lead + j]) for j, d in enumerate(s)):
            # broadcast against the op's widest operand (a rotary table (sequence,
            # head_dim), or (1, 1, sequence, head_dim), against (batch, heads, sequence,
            # head_dim)): split where it is, whole where it broadcasts
            new.append(tuple(split[lead + j] if d != 1 else 1 for j, d in enumerate(s)))
        else:
            new.append(_region_shape(o.charge.name, o.module, s, sizes, n, heads))
    new = tuple(new)
    if new == tuple(o.charge.shapes) and any(math.prod(s) > 1 for s in new):
        raise ValueError(f"replay: {o.charge.name} {list(o.charge.shapes)} ran in the "
                         f"tensor-parallel region of module {o.module!r} with no dim of a split "
                         f"size {sorted(sizes)} (nor heads of one): the replay cannot tell how "
                         f"tp shards it")
    return new


# Non-matmul ops of a parallel Linear on its output's side in backward: the bias gradient's
# reduction over tokens and the copies laying out the incoming gradient (from per-head
# layouts); the others (accumulating its input's gradient) act on the input side.
_OUTPUT_SIDE = {"sum"}


def _features(s) -> int:
    """A shape's feature count: its last dim, or (heads, head_dim) as their product."""
    return s[-2] * s[-1] if len(s) == 4 else s[-1]


def _side(o, fin: int, fout: int) -> str:
    """"output" or "input": the side of its Linear a non-matmul op works on, checked against
    its shapes' features (the last dim, or a 4-D shape's last two)."""
    c = o.charge
    last = {s[-1] for s in c.shapes if s}
    feats = {_features(s) for s in c.shapes if s}
    if o.backward:
        side = "output" if c.name in _OUTPUT_SIDE or c.name.startswith("copy_") else "input"
    else:
        side = "output" if fin != fout and fout in last | feats else "input"
    if {fout if side == "output" else fin} not in (last, feats):
        raise ValueError(f"replay: {c.name} {list(c.shapes)} in Linear({fin}, {fout}) "
                         f"{o.module!r} works on neither its input nor its output features; "
                         f"the replay cannot tell how tp shards it")
    return side


def _linear_role(o, fin: int, fout: int) -> str:
    """Which matmul of an nn.Linear a TensorE op is: "forward" (x @ W^T: M tokens, K in, N
    out), "grad_in" (g @ W: K out, N in), "grad_weight" (g^T @ x, as autograd computes it
    for the transposed view W^T: M out, K tokens, N in), or "either" when the token count
    equals out_features (both gradients then have the same shapes); for a non-matmul op the
    side it works on, "output" or "input" (``_side``)."""
    from ..cost_model import _matmul_dims
    c = _priced(o)
    dims = _matmul_dims(c.name, list(c.shapes)) if c.engine == "tensor" else None
    if dims is None:
        return _side(o, fin, fout)
    _, m, k, nn = dims
    if not o.backward:
        if (k, nn) != (fin, fout):
            raise ValueError(f"replay: {c.name} {list(c.shapes)} in Linear({fin}, {fout}) "
                             f"{o.module!r} is not its forward matmul (x @ W^T)")
        return "forward"
    roles = [r for r, ok in (("grad_in", (k, nn) == (fout, fin)),
                             ("grad_weight", (m, nn) == (fout, fin))) if ok]
    if not roles:
        raise ValueError(f"replay: {c.name} {list(c.shapes)} in the backward of Linear({fin}, "
                         f"{fout}) {o.module!r} is neither gradient matmul; the replay cannot "
                         f"tell which dim tp splits")
    return roles[0] if len(roles) == 1 else "either"


def _backward_owner(o, style: str, linears: dict, tp_plan: dict) -> tuple:
    """(op, style) with the op charged to the parallel Linear whose gradient matmul it is.
    In backward the module tracker can charge an op to a sibling that ran next to it (q's
    projection's to k's), so a matmul that fits no gradient of its module is given to the
    sibling parallel Linear (same parent, of the same style if one fits) it fits, when that is
    unambiguous."""
    fin, fout = linears[o.module]
    try:
        _linear_role(o, fin, fout)
        return o, style
    except ValueError:
        parent = o.module.rpartition(".")[0]
        fits = []
        for name, st in tp_plan.items():
            if name.rpartition(".")[0] != parent or st == "sequence" or name == o.module:
                continue
            try:
                _linear_role(replace(o, module=name), *linears[name])
            except ValueError:
                continue
            fits.append((linears[name], st, name))
        # prefer the siblings of the same style (q's, k's and v's projections run side by
        # side in backward)
        fits = [f for f in fits if f[1] == style] or fits
        if len({(shape, st) for shape, st, _ in fits}) != 1:
            raise
        return replace(o, module=fits[0][2]), fits[0][1]


def _linear_parts(o, role: str) -> list:
    """[(op, role)] of a Linear's op record. The runtime merges the launches of one signature
    between two module boundaries into one record, so when both gradients have the same
    shapes ("either"), a Linear's backward is one record: one launch is its weight gradient,
    which every backward computes; two, its input's too (halved, each priced apart)."""
    if role != "either":
        return [(o, role)]
    c = o.charge
    if c.count == 1:
        return [(o, "grad_weight")]
    if c.count != 2:
        raise ValueError(f"replay: {c.count} launches of {c.name} {list(c.shapes)} in the "
                         f"backward of {o.module!r}, each either gradient (the token count "
                         f"equals out_features); the replay cannot tell them apart")
    half = replace(o, charge=replace(c, count=1, seconds=c.seconds / 2, flops=c.flops / 2,
                                     bytes_in=c.bytes_in // 2, bytes_out=c.bytes_out // 2,
                                     hbm_bytes=c.hbm_bytes // 2))
    return [(half, "grad_in"), (half, "grad_weight")]


def _linear_shapes(o, role, style: str, fin: int, fout: int, n: int, tokens=None) -> tuple:
    """The shapes of an op of a column- (out_features split) or row-parallel (in_features
    split) Linear on one rank, by the role each dim plays in its matmul; a non-matmul op's
    split on the side it works on (``_side``) when that side is split; with sequence
    parallelism (``tokens`` the sequence length) a column-parallel Linear's input side is
    sequence-sharded too."""
    c = o.charge
    shapes = [list(s) for s in c.shapes]
    if role in ("output", "input"):
        size = fout if role == "output" else fin
        for s in shapes:
            if not s:
                continue
            if (role == "output") == (style == "colwise"):   # the split side
                if s[-1] == size or len(s) != 4:
                    s[-1] //= n
                else:   # per head: tp splits the heads
                    s[-2] //= n
            if tokens is not None and style == "colwise" and role == "input":
                s[:-1] = [d // n if d == tokens else d for d in s[:-1]]
        return tuple(tuple(s) for s in shapes)
    bias = 1 if c.name.startswith("add") else 0   # addmm's bias comes first
    a, b = shapes[bias], shapes[bias + 1]
    # (operand, dim) of the split feature: colwise splits out, rowwise in
    where = {("forward", "colwise"): [(b, 1)] + ([(shapes[0], -1)] if bias else []),
             ("forward", "rowwise"): [(a, 1), (b, 0)],
             ("grad_in", "colwise"): [(a, 1), (b, 0)],
             ("grad_in", "rowwise"): [(b, 1)],
             ("grad_weight", "colwise"): [(a, 0)],
             ("grad_weight", "rowwise"): [(b, 1)]}[role, style]
    for s, d in where:
        s[d] //= n
    return tuple(tuple(s) for s in shapes)


def _check_plan(tp: int, tp_plan: dict, linears: dict, modules, calls: dict) -> None:
    if not tp_plan:
        raise ValueError("replay: tp > 1 needs tp_plan, {module name: 'colwise' | 'rowwise' "
                         "| 'sequence'}")
    for name, style in tp_plan.items():
        if style not in _STYLES:
            raise ValueError(f"replay: tp_plan[{name!r}] = {style!r}; styles: {', '.join(_STYLES)}")
        if style == "sequence":
            if name not in modules:
                raise ValueError(f"replay: tp_plan names {name!r}, which is not a submodule of "
                                 f"the traced module")
            continue
        if name not in linears:
            known = ", ".join(sorted(linears)) or "none"
            raise ValueError(f"replay: tp_plan names {name!r}, which is not an nn.Linear of the "
                             f"traced module (its Linear modules: {known})")
        if not calls.get(name):
            raise ValueError(f"replay: tp_plan names {name!r}, which ran no forward in the "
                             f"traced step (a module called inside a torch.compile graph runs "
                             f"no hooks, and tensor parallelism re-prices each op at its "
                             f"sharded shapes, which a graph's cost is not: trace the step "
                             f"eagerly)")
        fin, fout = linears[name]
        dim, size = ("out_features", fout) if style == "colwise" else ("in_features", fin)
        if size % tp:
            raise ValueError(f"replay: tp={tp} does not divide {name}.{dim}={size} "
                             f"({style}-parallel splits {dim}; Linear({fin}, {fout}))")


def _tp_local_shape(fqn: str, shape: tuple, tp_plan: dict, tp: int) -> tuple:
    """A parameter's local shape under the TP plan: a column-parallel Linear's weight and bias
    split on dim 0 (out_features), a row-parallel one's weight on dim 1 (in_features)."""
    mod, _, pname = fqn.rpartition(".")
    style = tp_plan.get(mod)
    if style == "colwise":
        return (shape[0] // tp, *shape[1:])
    if style == "rowwise" and pname == "weight":
        return (shape[0], shape[1] // tp, *shape[2:])
    return tuple(shape)


def replay_tp(trace, tp: int, tp_plan: dict, cfg, nodes: int, fsdp: int = 1,
              fsdp_covered=frozenset()) -> Replay:
    """TP=tp; with ``fsdp`` > 1 the TP part of a 2-D run: the optimizer also steps only the
    FSDP shards (of the TP-local parameters in ``fsdp_covered``)."""
    _check_plan(tp, tp_plan, trace.linears, trace.modules, trace.forward_calls)
    sp = "sequence" in tp_plan.values()
    out = Replay(f"tp={tp}" + (" sp" if sp else ""))

    def sharded(fqn, shape, numel):
        local = _tp_local_shape(fqn, shape, tp_plan, tp)
        if fqn in fsdp_covered:
            return min(math.prod(local), _shard_numel(local, fsdp))
        return math.prod(local)
    # (what, module, bytes, dtype) per launch, in issue order: a module called twice
    # communicates twice
    comms = []
    for kind, x in tp_stream(trace, tp, tp_plan, cfg):
        if kind == "comm":
            comms.append(x)
        elif _is_optimizer(x.charge.name):
            out._op(x.charge.name, x.module, x.backward, *_optimizer_op(x, sharded, cfg,
                                                                          trace))
        else:
            out._op(x.charge.name, x.module, x.backward, x.charge.seconds, x.charge.flops)
    tokens, seq_dim = _root_sequence(trace, tp) if sp else (None, None)
    sharded_seq = None if not sp or seq_dim == 0 else (trace.root_inputs[0][0][0], tokens)
    _tp_comms(out, trace, comms, sp, tp_plan, tp, nodes, cfg, sharded_seq)
    out.seconds = out.device_seconds + out.collective_seconds
    return out


def _tp_walk(trace, tp_plan: dict):
    """Each traced op as (op, style, sizes): a parallel Linear's with its style (charged to
    the Linear whose gradient it is, ``_backward_owner``) and, in forward, the split sizes
    of the region that follows it (None after a rowwise one; in backward None); another op
    with style None and the split sizes of the region it ran in (None outside). The sharded
    region: forward from a colwise Linear to the next rowwise one, backward from a rowwise
    Linear to the next colwise one (several colwise Linear layers may open one, as
    attention's q, k and v projections; backward's is forward's, found by its rowwise
    Linear). Autograd may run a colwise Linear's backward before other backward ops of its
    region (SwiGLU's up projection before the activation's backward): an op of a leaf module
    whose forward ops all ran in one region is that region's in backward too (not a parent
    module's: ModTracker may charge a later backward op, such as the embedding's, to the
    module last active)."""
    region = {False: None, True: None}
    opened = set()      # forward: the split sizes since the last rowwise Linear
    paired = {}         # rowwise Linear -> its forward region's split sizes
    ran_in = {}         # leaf module -> the forward regions of its ops
    parents = {m.rpartition(".")[0] for m in trace.modules if m}
    for o in trace.ops:
        c = o.charge
        if c.engine == "collective":
            raise ValueError(f"replay: the traced step issued {c.name}; tp is replayed from a "
                             f"step traced without collectives")
        style = tp_plan.get(o.module)
        style = None if style == "sequence" or _is_optimizer(c.name) else style
        if style is None:
            if _is_optimizer(c.name):
                yield o, None, None
                continue
            here = region[o.backward]
            if not o.backward:
                if o.module is not None and o.module not in parents:
                    ran_in.setdefault(o.module, set()).add(here)
            elif here is None and len(ran_in.get(o.module, ())) == 1:
                here = next(iter(ran_in[o.module]))
            yield o, None, here
            continue
        if o.backward:
            o, style = _backward_owner(o, style, trace.linears, tp_plan)
        fin, fout = trace.linears[o.module]
        if not o.backward:
            if style == "colwise":
                opened.add(fout)
                region[False] = frozenset(opened)
            else:
                paired[o.module] = frozenset(opened | {fin})
                opened.clear()
                region[False] = None
        else:
            region[True] = paired.get(o.module, frozenset({fin})) \
                if style == "rowwise" else None
        yield o, style, region[False] if not o.backward else None


def tp_stream(trace, tp: int, tp_plan: dict, cfg):
    """One TP rank's work in issue order: ("op", a TracedOp whose charge is re-priced at the
    rank's shapes; the optimizer's as traced) and ("comm", (what, module, bytes per launch,
    dtype)) after the op that issues it: "row_fwd" (a row-parallel forward's all-reduce, or
    reduce-scatter with sp), "col_grad_in" (a column-parallel input gradient's), "all_gather"
    (sp: a column-parallel input) and "row_grad_out" (sp: a row-parallel output's gradient)."""
    _check_plan(tp, tp_plan, trace.linears, trace.modules, trace.forward_calls)
    # sequence parallelism (a "sequence" module in the plan, TorchTitan's layout): the ops
    # outside the column-to-row-parallel regions run on 1/tp of the sequence, all-reduces
    # become all-gathers and reduce-scatters
    sp = "sequence" in tp_plan.values()
    tokens, _ = _root_sequence(trace, tp) if sp else (None, None)
    walk = list(_tp_walk(trace, tp_plan))
    heads = _region_heads((o, sizes) for o, style, sizes in walk if style is None and sizes)
    for o, style, sizes in walk:
        c = o.charge
        if _is_optimizer(c.name):
            yield "op", o
            continue
        if style is None:
            if sizes is not None:
                new = _region_shapes(o, sizes, tp, heads.get(sizes, set()))
            elif sp:   # outside the regions: the rank's share of the sequence
                new = _split_shapes(c.shapes or (), tokens, tp)
            else:
                new = c.shapes
            yield "op", (o if new == c.shapes else replace(o, charge=_local_charge(o, new, cfg)))
            continue
        fin, fout = trace.linears[o.module]
        for part, role in _linear_parts(o, _linear_role(o, fin, fout)):
            shapes = _linear_shapes(part, role, style, fin, fout, tp, tokens)
            if role == "output" and c.name.startswith("copy_") and any(
                    len(s) == 4 and s[-2] == 1 < t[-2] for s, t in zip(shapes, c.shapes)):
                # the incoming gradient laid out (batch, tokens, heads, head_dim) from
                # attention's (batch, heads, ...): with one local head the transpose leaves
                # it contiguous, and PyTorch copies nothing
                continue
            yield "op", replace(part, charge=_local_charge(part, shapes, cfg))
            n_launch = part.charge.count
            per_launch = part.charge.bytes_out // n_launch
            what = None
            if style == "rowwise" and role == "forward":
                what, nbytes = "row_fwd", per_launch
            if sp and style == "colwise" and role == "forward":
                # the sequence-sharded input is all-gathered (tokens x in_features)
                what, nbytes = "all_gather", per_launch // fout * fin
            if sp and style == "rowwise" and role == "grad_in":
                # and in backward the gradient of the sequence-sharded output
                what, nbytes = "row_grad_out", per_launch // fin * fout
            if style == "colwise" and role == "grad_in":
                what, nbytes = "col_grad_in", per_launch
            if what is not None:
                for _ in range(n_launch):
                    yield "comm", (what, o.module, nbytes, c.dtype)


def tp_saved(trace, tp: int, tp_plan: dict) -> list:
    """The bytes a TP rank holds of each tensor the traced step saved for the backward
    (``trace.saved``): one saved in a tensor-parallel region (the region in force at the op
    it was saved at) with its dims of a split size, or else its heads, divided by tp, as
    the ops around it; one outside whole, or on its share of the sequence with sequence
    parallelism (but a column-parallel Linear's input, saved all-gathered, a copy per
    Linear). A shape whose heads the rules cannot tell apart is counted whole."""
    _check_plan(tp, tp_plan, trace.linears, trace.modules, trace.forward_calls)
    tokens = _root_sequence(trace, tp)[0] if "sequence" in tp_plan.values() else None
    walk = list(_tp_walk(trace, tp_plan))
    heads = _region_heads((o, sizes) for o, style, sizes in walk if style is None and sizes)
    before, cur = [], None   # the forward region in force before each op
    for o, style, sizes in walk:
        before.append(cur)
        if not o.backward:
            cur = sizes
    before.append(cur)
    out, seen = [], set()
    for t in trace.saved:
        s, sizes = t.shape, before[t.at]
        # a storage several ops saved is held once; but with sequence parallelism each
        # column-parallel Linear all-gathers its input for itself and saves that copy
        gathered = tokens is not None and tp_plan.get(t.module) == "colwise"
        key = (t.storage, t.module) if gathered else t.storage
        if key in seen:
            out.append(0)
            continue
        seen.add(key)
        if sizes is None:
            local = _split_shapes((s,), tokens, tp)[0] if tokens and not gathered else s
        else:
            try:
                # features or heads only: a saved operand of lower rank (a rotary table)
                # is not seen beside the operand it broadcast against
                local = _region_shape("a saved tensor", t.module, s, sizes, tp,
                                      heads.get(sizes, set()), anywhere=False)
            except ValueError:   # heads the rules cannot tell apart: counted whole
                local = s
        out.append(t.nbytes * math.prod(local) // max(1, math.prod(s)))
    return out


def _root_sequence(trace, n: int) -> tuple:
    """(length, dim) of the sequence that sequence parallelism splits: dim 0 of the root's
    first input when it is (tokens, features), dim 1 when it is (batch, sequence, ...), as
    ``SequenceParallel``'s default ``sequence_dim=1``."""
    if trace.root_inputs and len(trace.root_inputs[0][0]) == 2:
        return _root_dim0(trace, n, "tp with sequence parallelism"), 0
    if not trace.root_inputs or len(trace.root_inputs[0][0]) < 2:
        raise ValueError("replay: tp with sequence parallelism splits the sequence of the "
                         "root's input, and the traced root took no tensor of 2 or more dims")
    size = trace.root_inputs[0][0][1]
    if size % n:
        raise ValueError(f"replay: tp with sequence parallelism={n} does not divide the "
                         f"sequence (dim 1, {size}) of the root's input "
                         f"{trace.root_inputs[0][0]}")
    return size, 1


def _tp_comms(out: Replay, trace, comms: list, sp: bool, tp_plan: dict, tp: int, nodes: int,
              cfg, sharded_seq=None) -> None:
    """TP's collectives in issue order and the device work around them (``_tp_comm``); with
    sp, at the end, the all-reduce (and copy) of each gradient of a sequence-parallel
    module's (replicated) parameters."""
    from ..cost_model import copy_seconds
    for comm in comms:
        _tp_comm(out, trace, comm, sp, tp, nodes, cfg, sharded_seq)
    for fqn, (shape, dtype) in trace.params.items():
        if tp_plan.get(fqn.rpartition(".")[0]) == "sequence":
            nbytes = math.prod(shape) * dtype.itemsize
            out._op("copy_d2d", fqn, True, copy_seconds(cfg[0], cfg[1], "copy_d2d", nbytes))
            _tp_collective(out, "all_reduce", nbytes, dtype, fqn, True, tp, nodes, cfg,
                           sharded_seq)


def _tp_comm(out: Replay, trace, comm, sp: bool, tp: int, nodes: int, cfg, sharded_seq=None,
             parts: int = 1) -> None:
    """One of ``tp_stream``'s comms (of 1/``parts`` of its bytes: a pipeline micro-batch's)
    and the device work around it: a row-parallel forward's bias division (a replicated bias
    becomes a Partial sum) and all-reduce of the output (reduce-scatter with sp), a
    column-parallel input gradient's all-reduce (reduce-scatter with sp); functional
    all-reduces copy their output. With sp, the all-gathers."""
    from ..cost_model import copy_seconds, op_seconds
    p, lnc = cfg
    what, name, nbytes, dtype = comm
    nbytes //= parts
    backward = what in ("col_grad_in", "row_grad_out")
    if what in ("all_gather", "row_grad_out"):
        _tp_collective(out, "all_gather", nbytes, dtype, name, backward, tp, nodes, cfg,
                       sharded_seq)
        return
    if what == "row_fwd" and trace.params.get(name + ".bias") is not None:
        bdtype = trace.params[name + ".bias"][1]
        b = trace.linears[name][1] * bdtype.itemsize
        out._op("div", name, False, op_seconds(p, lnc, "div", [(b // bdtype.itemsize,)],
                                               bdtype, b, b)[0])
    if sp:
        _tp_collective(out, "reduce_scatter", nbytes, dtype, name, backward, tp, nodes, cfg,
                       sharded_seq)
    else:
        out._op("copy_d2d", name, backward, copy_seconds(p, lnc, "copy_d2d", nbytes))
        _tp_collective(out, "all_reduce", nbytes, dtype, name, backward, tp, nodes, cfg,
                       sharded_seq)


def _tp_collective(out: Replay, op: str, nbytes: int, dtype, name, backward: bool, tp: int,
                   nodes: int, cfg, sharded_seq) -> None:
    """A TP collective, priced as the backend charges it. A sequence on dim 1
    (``sharded_seq`` = (batch, sequence length)) is not the dim the collectives concatenate
    or scatter (dim 0): DTensor ``cat``s the tp chunks along it, after each all-gather and
    before each reduce-scatter."""
    from ..cost_model import op_seconds
    from ..distributed.collectives_model import collective_seconds
    p, lnc = cfg
    out._collective(op, nbytes, tp, collective_seconds(op, nbytes, tp, nodes, p, lnc))
    if sharded_seq is not None and op != "all_reduce":
        batch, seq = sharded_seq
        chunk = (batch, seq // tp, nbytes // dtype.itemsize // (batch * seq))
        # the runtime keeps the first three shapes of a list
        out._op("cat", name, backward, op_seconds(p, lnc, "cat", [chunk] * min(tp, 3), dtype,
                                                  nbytes, nbytes)[0])
