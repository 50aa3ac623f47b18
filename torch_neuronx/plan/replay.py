"""A traced single-device step replayed under FSDP2 (HSDP), Megatron tensor parallelism, or
both.

``StepTrace.replay_layout(fsdp=N, fsdp_units=[...])`` and
``StepTrace.replay_layout(tp=N, tp_plan={...})`` start from the ops the cost model charged
for a step traced on one device with ``plan.trace(device, module)`` (each op with the module it
ran under) and give the modelled step of one rank of the N-rank run. Nothing here prices work
by a formula of its own: a re-priced op is priced by ``cost_model.op_seconds`` (or
``copy_seconds``) at its sharded shapes, a collective by ``collective_seconds``, the model the
``"neuron"`` backend charges. What is added is what the real runs issue on the virtual devices
(docs/plan.md, "Replaying a traced step"; tests/plan/test_replay.py checks the sum against
real 2-rank runs):

FSDP=N (``fully_shard`` on each unit of ``fsdp_units``), per unit with parameters:
  each all-gather (forward, and again in backward for every unit but the root, which FSDP2
  keeps unsharded after forward): the copy-in ``_foreach_copy_`` of the local shards, the
  ``all_gather`` of N x shard bytes, and the copy-out: one ``copy_d2d`` of N x shard per
  parameter; in backward, the reduce-scatter copy-in ``cat`` of the gradients as N x shard
  rows (a gradient whose dim 0 does not divide by N first copied into a zeroed padded buffer)
  and the ``reduce_scatter`` of N x shard bytes; optimizer (``_foreach_*``) ops re-priced
  for the local shards (dim 0 padded to a multiple of N, as FSDP2 shards); less the device
  time two copy-ins hide on FSDP2's copy-in stream (``_overlap``).
HSDP (FSDP=S with replicate=R, ``fully_shard`` over a (R, S) mesh): FSDP=S's step, plus per
  unit in backward the ``all_reduce`` of its reduce-scattered shard over the R replicas.
Mixed precision (FSDP2's MixedPrecisionPolicy, with FSDP or HSDP): the traced ops re-priced
  in param_dtype, the collectives and copies in param_dtype/reduce_dtype, the casts added.
FSDP=N x TP=T (a (dp, tp) mesh, TP inside): TP=T's replay with the optimizer stepping the
  FSDP shards, plus FSDP=N over the TP-local parameters.
TP=N (``parallelize_module`` with Colwise/RowwiseParallel):
  every op of a parallel Linear, and every op between a column-parallel Linear and the next
  row-parallel one (forward; the reverse in backward), re-priced with the split dimension
  (the column-parallel out_features, the row-parallel in_features) divided by N; per
  row-parallel Linear in forward, DTensor's division of the replicated bias (a Partial sum)
  and the ``all_reduce`` of its output with the copy functional collectives make; per
  column-parallel Linear that computed an input gradient, the ``all_reduce`` (and copy) of
  that gradient; optimizer ops re-priced for the local shards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

_STYLES = ("colwise", "rowwise")


@dataclass
class Replay:
    """One rank's modelled step under a layout: ``seconds`` = ``device_seconds`` (the traced
    ops, re-priced where sharded, plus the copies the parallelism adds) +
    ``collective_seconds`` - ``overlap_seconds`` (device work on another stream that the
    timeline runs alongside); ``flops`` per device; ``ops`` the replayed device ops as
    (name, module, backward, seconds, flops); ``collectives`` as (op, nbytes, group_size,
    seconds)."""
    layout: str
    seconds: float = 0.0
    device_seconds: float = 0.0
    collective_seconds: float = 0.0
    overlap_seconds: float = 0.0
    flops: float = 0.0
    ops: list = field(default_factory=list)
    collectives: list = field(default_factory=list)

    def _op(self, name, module, backward, seconds, flops=0.0):
        self.ops.append((name, module, backward, seconds, flops))
        self.device_seconds += seconds
        self.flops += flops

    def _collective(self, op, nbytes, group, seconds):
        if seconds < 0:
            raise ValueError(f"replay: {op} of {nbytes} bytes priced at {seconds} s")
        self.collectives.append((op, nbytes, group, seconds))
        self.collective_seconds += seconds

    def __str__(self):
        return (f"replayed {self.layout}: {self.seconds * 1e3:.4f} ms (device "
                f"{self.device_seconds * 1e3:.4f} ms, collectives "
                f"{self.collective_seconds * 1e3:.4f} ms, {len(self.collectives)}, overlap "
                f"{self.overlap_seconds * 1e3:.4f} ms), "
                f"{self.flops / 1e9:.3f} GFLOP per device")


def _is_optimizer(name: str) -> bool:
    # torch.optim's foreach and fused paths: one launch over the parameter list, whose work
    # is per parameter element (the shapes the runtime keeps of a list op are truncated).
    return name.startswith("_foreach_") or name.startswith("_fused_")


def _shard_numel(shape, n: int) -> int:
    """Elements of rank 0's shard (FSDP2: dim 0 in chunks of ceil(dim0 / n) rows)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def _split_shapes(shapes, size: int, n: int):
    return tuple(tuple(d // n if d == size else d for d in s) for s in shapes)


def _out_numel(op: str, old_shapes, new_shapes, old_out: int, module: str) -> int:
    """The output elements of ``op`` at ``new_shapes``, from its recorded ``old_out``: a
    matmul's from its dims; an element-wise op's as the input of the same size; a reduction's
    as the dims of its largest input whose product it is (which must be unambiguous)."""
    from ..cost_model import _TENSORE, _matmul_dims
    if old_out == 0:
        return 0
    if op in _TENSORE:
        old, new = _matmul_dims(op, list(old_shapes)), _matmul_dims(op, list(new_shapes))
        if old is not None and old[0] * old[1] * old[3] == old_out:
            return new[0] * new[1] * new[3]
    for o, s in zip(old_shapes, new_shapes):
        if math.prod(o) == old_out:
            return math.prod(s)
    big = max(range(len(old_shapes)), key=lambda i: math.prod(old_shapes[i]), default=None)
    if big is not None:
        o, s = old_shapes[big], new_shapes[big]
        found = {math.prod(s[i] for i in range(len(o)) if mask >> i & 1)
                 for mask in range(1 << len(o))
                 if math.prod(o[i] for i in range(len(o)) if mask >> i & 1) == old_out}
        if len(found) == 1:
            return found.pop()
    raise ValueError(f"replay: cannot tell the output of {op} {list(old_shapes)} "
                     f"({old_out} elements) in module {module!r} at the sharded shapes "
                     f"{list(new_shapes)}")


def _reprice(charge, shapes, bytes_in: int, bytes_out: int, cfg, dtype=None) -> tuple:
    """(seconds, flops) of the traced op at new shapes and bytes (and dtype), by the cost
    model."""
    from ..cost_model import op_seconds
    seconds, _, flops = op_seconds(cfg[0], cfg[1], charge.name, list(shapes),
                                   dtype or charge.dtype, bytes_in, bytes_out, charge.count,
                                   charge.flags)
    return seconds, flops


def _split_op(o, size: int, n: int, cfg) -> tuple:
    """(seconds, flops) of traced op ``o`` with every dim equal to ``size`` divided by n."""
    c = o.charge
    if c.name == "fused_pointwise":
        # its shapes are (elements, ops): which of its operands are split is lost
        raise ValueError(f"replay: an Adaptive Eager fused kernel ran in tensor-parallel "
                         f"module {o.module!r} (or between a column- and a row-parallel "
                         f"Linear); trace with torch_neuronx.set_adaptive_eager(False) to "
                         f"replay tp")
    if c.shapes is None:
        raise ValueError(f"replay: {c.name} in tensor-parallel module {o.module!r} is not an "
                         f"op the cost model priced from shapes (engine {c.engine}); it cannot "
                         f"be re-priced for tp")
    new = _split_shapes(c.shapes, size, n)
    if new == c.shapes:
        return c.seconds, c.flops
    old_in = sum(math.prod(s) for s in c.shapes)
    new_in = sum(math.prod(s) for s in new)
    bytes_in = c.bytes_in * new_in // old_in if old_in else c.bytes_in
    item = c.dtype.itemsize
    bytes_out = _out_numel(c.name, c.shapes, new, c.bytes_out // item, o.module) * item
    return _reprice(c, new, bytes_in, bytes_out, cfg)


def _optimizer_op(o, ratio: float, cfg, params: dict) -> tuple:
    """(seconds, flops) of an optimizer list op over the local parameters: its bytes scaled
    by local / full parameter bytes. That holds for an op over every parameter (one parameter
    group, its state tensors shaped as the parameters): its bytes are then a whole multiple
    of the parameters' bytes, which is checked."""
    c = o.charge
    full = sum(math.prod(shape) * dtype.itemsize for shape, dtype in params.values())
    moved = c.bytes_in + c.bytes_out
    if full == 0 or moved % full:
        raise ValueError(f"replay: optimizer op {c.name} moved {moved} bytes, not a multiple "
                         f"of the {full} bytes of the parameters: it runs over some of them "
                         f"(several parameter groups?), which is not replayed")
    return _reprice(c, c.shapes, round(c.bytes_in * ratio), round(c.bytes_out * ratio), cfg)


def _check_plan(tp: int, tp_plan: dict, linears: dict) -> None:
    if not tp_plan:
        raise ValueError("replay: tp > 1 needs tp_plan, {module name: 'colwise' | 'rowwise'}")
    for name, style in tp_plan.items():
        if style not in _STYLES:
            raise ValueError(f"replay: tp_plan[{name!r}] = {style!r}; styles: {', '.join(_STYLES)}")
        if name not in linears:
            known = ", ".join(sorted(linears)) or "none"
            raise ValueError(f"replay: tp_plan names {name!r}, which is not an nn.Linear of the "
                             f"traced module (its Linear modules: {known})")
        fin, fout = linears[name]
        dim, size = ("out_features", fout) if style == "colwise" else ("in_features", fin)
        if size % tp:
            raise ValueError(f"replay: tp={tp} does not divide {name}.{dim}={size} "
                             f"({style}-parallel splits {dim}; Linear({fin}, {fout}))")
        if fin == fout:
            raise ValueError(f"replay: {name} is square (Linear({fin}, {fout})): the replay "
                             f"finds the split dimension by its size, which is ambiguous here")


def _local_bytes(params: dict, sharded) -> tuple:
    """(local, full) parameter bytes, with ``sharded(fqn, shape, numel)`` giving a
    parameter's local elements."""
    local = full = 0
    for fqn, (shape, dtype) in params.items():
        numel = math.prod(shape)
        full += numel * dtype.itemsize
        local += sharded(fqn, shape, numel) * dtype.itemsize
    return local, full


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
    from ..distributed.collectives_model import collective_seconds
    _check_plan(tp, tp_plan, trace.linears)
    out = Replay(f"tp={tp}")

    def sharded(fqn, shape, numel):
        local = _tp_local_shape(fqn, shape, tp_plan, tp)
        if fqn in fsdp_covered:
            return min(math.prod(local), _shard_numel(local, fsdp))
        return math.prod(local)
    local, full = _local_bytes(trace.params, sharded)
    ratio = local / full if full else 1.0
    comm = lambda op, nbytes: collective_seconds(op, nbytes, tp, nodes, cfg[0], cfg[1])  # noqa: E731
    from ..cost_model import copy_seconds, op_seconds

    # The sharded region: forward from a colwise Linear to the next rowwise one, backward
    # from a rowwise Linear to the next colwise one; its ops run on 1/tp of the split dim.
    region = {False: None, True: None}
    # (module, bytes) per launch: a module called twice all-reduces twice
    rowwise_fwd, colwise_grad_in = [], []
    for o in trace.ops:
        c = o.charge
        if c.engine == "collective":
            raise ValueError(f"replay: the traced step issued {c.name}; tp is replayed from a "
                             f"step traced without collectives")
        style = tp_plan.get(o.module)
        if _is_optimizer(c.name):
            seconds, flops = _optimizer_op(o, ratio, cfg, trace.params)
            out._op(c.name, o.module, o.backward, seconds, flops)
            continue
        if style is not None:
            fin, fout = trace.linears[o.module]
            size = fout if style == "colwise" else fin
            opens = (style == "colwise") != o.backward
            region[o.backward] = size if opens else None
        else:
            size = region[o.backward]
        seconds, flops = (c.seconds, c.flops) if size is None else _split_op(o, size, tp, cfg)
        out._op(c.name, o.module, o.backward, seconds, flops)
        if style == "rowwise" and not o.backward and c.engine == "tensor":
            rowwise_fwd += [(o.module, c.bytes_out // c.count)] * c.count
        if (style == "colwise" and o.backward and c.engine == "tensor"
                and _matmul_k(c) == trace.linears[o.module][1]):
            # the input gradient: the matmul that contracts out_features
            colwise_grad_in += [(o.module, c.bytes_out // c.count)] * c.count
    p, lnc = cfg
    for name, nbytes in rowwise_fwd:
        fin, fout = trace.linears[name]
        if trace.params.get(name + ".bias") is not None:
            # the replicated bias becomes a Partial sum: DTensor divides it by tp
            dtype = trace.params[name + ".bias"][1]
            b = fout * dtype.itemsize
            out._op("div", name, False, op_seconds(p, lnc, "div", [(fout,)], dtype, b, b)[0])
        out._op("copy_d2d", name, False, copy_seconds(p, lnc, "copy_d2d", nbytes))
        out._collective("all_reduce", nbytes, tp, comm("all_reduce", nbytes))
    for name, nbytes in colwise_grad_in:
        out._op("copy_d2d", name, True, copy_seconds(p, lnc, "copy_d2d", nbytes))
        out._collective("all_reduce", nbytes, tp, comm("all_reduce", nbytes))
    out.seconds = out.device_seconds + out.collective_seconds
    return out


def _matmul_k(c) -> int | None:
    from ..cost_model import _matmul_dims
    dims = _matmul_dims(c.name, list(c.shapes or ()))
    return dims[2] if dims else None


def _unit_params(params: dict, units) -> dict:
    """unit name -> [(shape, dtype)] of the parameters it shards (those of no nested unit)."""
    owned = {u: [] for u in units}
    for fqn, (shape, dtype) in params.items():
        owners = [u for u in units if u == "" or fqn.startswith(u + ".")]
        owned[max(owners, key=len)].append((shape, dtype)) if owners else None
    return owned


def _mp_dtypes(trace, mp_policy, covered, tp: int):
    """(param dtype, reduce dtype, the parameters' own dtype) of an FSDP2
    ``MixedPrecisionPolicy`` (None: no mixed precision)."""
    if mp_policy is None or (mp_policy.param_dtype is None and mp_policy.reduce_dtype is None):
        return None
    if tp > 1:
        raise ValueError("replay: mp_policy with tp is not replayed yet (checked against real "
                         "runs: FSDP and HSDP)")
    if getattr(mp_policy, "output_dtype", None) is not None:
        raise ValueError("replay: mp_policy.output_dtype is not replayed")
    own = {trace.params[f][1] for f in covered}
    if len(own) != 1:
        raise ValueError(f"replay: mp_policy needs the sharded parameters in one dtype, not "
                         f"{sorted(map(str, own))}")
    orig = own.pop()
    pd = mp_policy.param_dtype or orig
    return pd, mp_policy.reduce_dtype or pd, orig


def _float_bytes_in(c, orig) -> tuple | None:
    """(floating-point elements, other bytes) of an op's inputs: the record keeps one dtype,
    so int64 inputs (indices, targets) are told by the bytes they add. None when no single
    split explains the bytes (inputs beyond the three shapes a record keeps)."""
    numels = [math.prod(s) for s in c.shapes]
    total, per_launch = sum(numels), c.bytes_in / c.count
    if per_launch == total * orig.itemsize:
        return c.count * total, 0
    found = set()
    for mask in range(1, 1 << len(numels)):
        ints = sum(x for i, x in enumerate(numels) if mask >> i & 1)
        if (total - ints) * orig.itemsize + ints * 8 == per_launch:
            found.add((c.count * (total - ints), c.count * ints * 8))
    return found.pop() if len(found) == 1 else None


def _mp_op(o, pd, orig, cfg) -> tuple:
    """(seconds, flops) of a traced op computed in ``orig`` as it runs on parameters cast to
    ``pd``: its floating-point bytes scaled by the itemsizes (int64 inputs kept)."""
    from ..cost_model import copy_seconds
    c = o.charge
    if c.dtype != orig:
        return c.seconds, c.flops
    scale = pd.itemsize / orig.itemsize
    if c.name.startswith("copy_"):
        return copy_seconds(cfg[0], cfg[1], c.name, round(c.bytes_out * scale), c.count), 0.0
    if c.shapes is None:
        raise ValueError(f"replay: {c.name} in module {o.module!r} was not priced from shapes "
                         f"(engine {c.engine}); it cannot be re-priced in {pd} for mp_policy "
                         f"(an Adaptive Eager fused kernel: trace with "
                         f"torch_neuronx.set_adaptive_eager(False))")
    split = _float_bytes_in(c, orig)
    bytes_in = split[0] * pd.itemsize + split[1] if split else round(c.bytes_in * scale)
    return _reprice(c, c.shapes, bytes_in, round(c.bytes_out * scale), cfg, dtype=pd)


def replay_fsdp(trace, n: int, units, cfg, nodes: int, replicate: int = 1, tp: int = 1,
                tp_plan=None, mp_policy=None) -> Replay:
    """FSDP=n (HSDP with ``replicate`` > 1); with ``tp`` > 1 FSDP x TP as TorchTitan lays it
    out (mesh (dp=n, tp), TP inside): TP=tp's replay, then FSDP over the TP-local parameters.
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` (param_dtype, reduce_dtype)."""
    from ..cost_model import copy_seconds, op_seconds
    from ..distributed.collectives_model import collective_seconds
    if units is None and n > 1:
        raise ValueError("replay: fsdp > 1 needs fsdp_units, the names of the modules "
                         "fully_shard wraps ('' for the root)")
    units = units or []
    known = set(trace.modules)
    for u in units:
        if u != "" and u not in known:
            raise ValueError(f"replay: fsdp_units names {u!r}, which is not a submodule of the "
                             f"traced module")
    p, lnc = cfg
    covered = {fqn for fqn in trace.params
               if any(u == "" or fqn.startswith(u + ".") for u in units)}
    mp = _mp_dtypes(trace, mp_policy, covered, tp)
    if tp > 1:
        # The mesh is (dp, tp), ranks tp-major: a TP group spans ceil(nodes / n) nodes, an
        # FSDP group one rank on each of min(n, nodes).
        out = replay_tp(trace, tp, tp_plan, cfg, -(-nodes // n), fsdp=n, fsdp_covered=covered)
        out.layout = f"fsdp={n} tp={tp}"
        params = {fqn: (_tp_local_shape(fqn, shape, tp_plan, tp), dtype)
                  for fqn, (shape, dtype) in trace.params.items()}
        shard_nodes, replica_nodes = min(n, nodes), 1
        # the traced ops as TP runs them (replay_tp keeps them first, in trace order)
        window = [s for _, _, _, s, _ in out.ops[:len(trace.ops)]]
    else:
        out = Replay(f"fsdp={n}" + (f" replicate={replicate}" if replicate > 1 else ""))
        params = trace.params
        # HSDP's mesh is (replicate, shard), ranks shard-major: a shard group spans
        # ceil(nodes / replicate) nodes, a replica group one rank on each of
        # min(replicate, nodes)
        shard_nodes, replica_nodes = -(-nodes // replicate), min(replicate, nodes)

        def sharded(fqn, shape, numel):
            # a parameter of no unit stays replicated (FSDP2 leaves it alone)
            return min(numel, _shard_numel(shape, n)) if fqn in covered else numel
        local, full = _local_bytes(trace.params, sharded)
        ratio = local / full if full else 1.0
        for o in trace.ops:
            c = o.charge
            if c.engine == "collective":
                raise ValueError(f"replay: the traced step issued {c.name}; fsdp is replayed "
                                 f"from a step traced without collectives")
            if _is_optimizer(c.name):   # on the sharded parameters, in their own dtype
                seconds, flops = (_optimizer_op(o, ratio, cfg, trace.params) if ratio != 1.0
                                  else (c.seconds, c.flops))
            else:
                seconds, flops = _mp_op(o, *mp[::2], cfg) if mp else (c.seconds, c.flops)
            out._op(c.name, o.module, o.backward, seconds, flops)
        window = [op[3] for op in out.ops]
    input_cast = 0.0
    if mp and getattr(mp_policy, "cast_forward_inputs", True) and "" in units:
        # the root's pre-forward casts its floating-point inputs to param_dtype
        for shape, dtype in trace.root_inputs:
            if dtype.is_floating_point and dtype != mp[0]:
                seconds = copy_seconds(p, lnc, "copy_d2d", math.prod(shape) * mp[0].itemsize)
                input_cast += seconds
                out._op("copy_d2d", "", False, seconds)
    gathered = {}   # unit -> (shard elements per parameter, dtype, parameter shapes)
    for unit, owned in _unit_params(params, units).items():
        if not owned:
            continue
        calls = trace.forward_calls.get(unit, 0)
        if calls != 1:
            raise ValueError(f"replay: fsdp unit {unit!r} ran forward {calls} times in the "
                             f"traced step; FSDP2 all-gathers and reshards it per call, which "
                             f"is replayed for one call only")
        dtype = owned[0][1]
        if any(d != dtype for _, d in owned):
            raise ValueError(f"replay: fsdp unit {unit!r} mixes parameter dtypes; FSDP2 "
                             f"all-gathers one flat buffer per dtype, which is not replayed")
        gathered[unit] = ([_shard_numel(s, n) for s, _ in owned], dtype, [s for s, _ in owned])
    copy_in, copy_out = {}, {}

    def all_gather(unit, bw):
        shards, dtype, _ = gathered[unit]
        if mp and mp[0] != dtype:
            # two list copies, recorded as one op of two launches: the cast of the shards to
            # param_dtype, then the copy into the all-gather input
            dtype, total = mp[0], sum(shards)
            nbytes, launches = total * (mp[2].itemsize + 3 * mp[0].itemsize), 2
        else:
            dtype = mp[0] if mp else dtype
            nbytes, launches = 2 * sum(shards) * dtype.itemsize, 1   # dst and src
        item = dtype.itemsize
        copy_in[unit] = op_seconds(p, lnc, "_foreach_copy_", [(s,) for s in shards], dtype,
                                   nbytes, 0, launches)[0]
        out._op("_foreach_copy_", unit, bw, copy_in[unit])
        flat = n * sum(shards) * item
        out._collective("all_gather", flat, n, collective_seconds(
            "all_gather", flat, n, shard_nodes, p, lnc))
        copy_out[unit] = 0.0
        for s in shards:   # copy-out: each parameter's (n, shard) rows from the flat output
            seconds = copy_seconds(p, lnc, "copy_d2d", n * s * item)
            copy_out[unit] += seconds
            out._op("copy_d2d", unit, bw, seconds)

    def reduce_scatter(unit):
        shards, dtype, shapes = gathered[unit]
        # the gradients come in param_dtype, are reduced in reduce_dtype
        grad = mp[0] if mp else dtype
        dtype = mp[1] if mp else dtype
        item = dtype.itemsize
        flat = n * sum(shards) * item
        grads = n * sum(shards) * grad.itemsize
        for shape, s in zip(shapes, shards):
            if shape and shape[0] % n:
                # a gradient whose dim 0 does not split evenly is padded first: a zeroed
                # (n * shard) buffer and a copy of the gradient into it
                padded = (n * math.ceil(shape[0] / n), *shape[1:])
                out._op("zero_", unit, True, op_seconds(p, lnc, "zero_", [padded], dtype,
                                                        n * s * item, n * s * item)[0])
                out._op("copy_d2d", unit, True, copy_seconds(p, lnc, "copy_d2d",
                                                             math.prod(shape) * item))
        # copy-in: the gradients as (n, shard) rows into one flat input (the runtime counts
        # cat's output buffer among its inputs, as it records chunk_cat)
        out._op("cat", unit, True, op_seconds(p, lnc, "cat", [(n, s) for s in shards], dtype,
                                              flat + grads, flat)[0])
        out._collective("reduce_scatter", flat, n, collective_seconds(
            "reduce_scatter", flat, n, shard_nodes, p, lnc))
        if replicate > 1:
            # HSDP: the reduce-scattered shard is then all-reduced across the replicas
            # (averaged on the host, as the reduce-scatter is: no device op)
            shard = flat // n
            out._collective("all_reduce", shard, replicate, collective_seconds(
                "all_reduce", shard, replicate, replica_nodes, p, lnc))

    # In FSDP2's order: forward all-gathers (the root's first); in backward each unit
    # (the root keeps its parameters after forward) re-gathers, the next one's all-gather
    # prefetched before this one's reduce-scatter.
    order = _forward_order(trace, [u for u in gathered if u != ""])
    for u in ([""] if "" in gathered else []) + order:
        all_gather(u, False)
    back = order[::-1]
    for i, u in enumerate(back):
        if i == 0:
            all_gather(u, True)
        if i + 1 < len(back):
            all_gather(back[i + 1], True)
        reduce_scatter(u)
    if "" in gathered:
        reduce_scatter("")
    out.overlap_seconds = _overlap(trace, window, order, copy_in, copy_out.get(""), input_cast)
    out.seconds = out.device_seconds + out.collective_seconds - out.overlap_seconds
    return out


def _overlap(trace, seconds: list, order: list, copy_in: dict, root_copy_out,
             input_cast: float = 0.0) -> float:
    """The device time FSDP2's copy-ins hide. A unit's shards are copied in on the all-gather
    copy-in stream, and the timeline overlaps streams between host waits
    (cost_model._timeline). Most copy-ins sit between two host waits: the previous unit's
    reshard (freeing its parameters waits for the device), the collectives themselves and
    the stream waits around them. Two follow default-stream work without one:

    - forward, the first unit's: after the root's pre-forward stream waits, or, when the root
      holds parameters, after the root's all-gather wait, its copy-out and the root's forward
      up to that unit (the root does not reshard after forward);
    - backward, the first all-gather (of the last unit in forward order): after the root's
      post-forward event waits, alongside the work since (a loss computed outside the model,
      autograd's seed of the gradient) up to the pre-backward hook that issues it, which is
      the root's own when the root holds parameters (it prefetches that unit), otherwise that
      unit's.
    Each overlaps its copy-in by the shorter of the two. ``seconds``: each traced op's device
    time as the layout runs it (re-priced under TP or mixed precision); ``input_cast``: the
    root's cast of its inputs (mixed precision), in the forward window when the root holds
    no parameters (with parameters, it comes before the root's all-gather wait)."""
    ops = trace.ops
    if not order:
        return 0.0
    first, last = order[0], order[-1]
    # forward: from the start (or the root's copy-out) to the first unit's first op
    window = root_copy_out if root_copy_out is not None else input_cast
    for o, sec in zip(ops, seconds):
        if o.module is not None and _unit_of(o.module, order + [""]) == first:
            break
        if not o.backward and not _is_optimizer(o.charge.name):
            window += sec
    hidden = min(window, copy_in[first])
    # backward: from the end of the root's forward to the first backward op of a unit that
    # all-gathers (the root included when it holds parameters)
    fwd = [i for i, o in enumerate(ops) if not o.backward and o.module is not None]
    gathering = order + ([""] if root_copy_out is not None else [])
    window = 0.0
    start = fwd[-1] + 1 if fwd else len(ops)
    for o, sec in zip(ops[start:], seconds[start:]):
        if o.backward and _unit_of(o.module, gathering) is not None:
            return hidden + min(window, copy_in[last])
        if not _is_optimizer(o.charge.name):
            window += sec
    return hidden


def _forward_order(trace, units) -> list:
    """``units`` in the order their forward ran in the trace (first op in each)."""
    first = {}
    for i, o in enumerate(trace.ops):
        if not o.backward and o.module is not None:
            for u in units:
                if u not in first and (o.module == u or o.module.startswith(u + ".")):
                    first[u] = i
    missing = [u for u in units if u not in first]
    if missing:
        raise ValueError(f"replay: fsdp units {missing} ran no op in the traced forward")
    return sorted(units, key=first.get)


def _unit_of(module, units):
    """The innermost unit (of ``units``) holding ``module``, or None."""
    if module is None:
        return None
    owners = [u for u in units if u == "" or module == u or module.startswith(u + ".")]
    return max(owners, key=len) if owners else None
