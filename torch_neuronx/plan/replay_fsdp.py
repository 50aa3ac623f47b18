"""FSDP2 (and HSDP, FSDP x TP, mixed precision) replayed from a step traced on one device:
the traced ops as an FSDP rank runs them, plus FSDP2's all-gathers, reduce-scatters and the
copies around them (docs/plan.md, "Replaying a traced step").

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
FSDP=N x TP=T (a (dp, tp) mesh, TP inside; with replicate=R a (R, N, T) mesh): TP=T's
  replay with the optimizer stepping the FSDP shards, plus FSDP=N (HSDP) over the TP-local
  parameters.
A shard degree of 1 (replicate=R alone, FSDP2 over a (R, 1) mesh: data parallelism as
  FSDP2 spells it, with or without TP): no all-gather and no copy-in, the shards copied out as
  they are; the reduce-scatter a copy of its input; the all-reduce over the replicas.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .replay import (Replay, _is_optimizer, _local_bytes, _optimizer_op, _reprice,
                     _shard_numel)
from .replay_tp import _tp_local_shape, replay_tp


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


def _mp_op(o, pd, orig, cfg) -> tuple:
    """(seconds, flops) of a traced op computed in ``orig`` as it runs on parameters cast to
    ``pd``: its floating-point bytes scaled by the itemsizes (int64 inputs kept)."""
    from ..cost_model import copy_seconds, recast_bytes
    c = o.charge
    if c.dtype is None and c.engine in ("fused", "nki"):
        # a compiled graph or an NKI kernel: its cost is its own kernels', whose dtypes the
        # charge does not keep, so it would be kept at the traced dtype's cost
        raise ValueError(f"replay: {c.name} in module {o.module!r} was not priced from shapes "
                         f"(engine {c.engine}); it cannot be re-priced in {pd} for mp_policy "
                         f"(trace the step eagerly, or with the parameters in {pd})")
    if c.dtype != orig:
        return c.seconds, c.flops
    if c.name.startswith("copy_"):
        _, nbytes = recast_bytes(None, c.count, c.bytes_in, c.bytes_out, orig, pd)
        return copy_seconds(cfg[0], cfg[1], c.name, nbytes, c.count), 0.0
    if c.shapes is None:
        raise ValueError(f"replay: {c.name} in module {o.module!r} was not priced from shapes "
                         f"(engine {c.engine}); it cannot be re-priced in {pd} for mp_policy "
                         f"(an Adaptive Eager fused kernel: trace with "
                         f"torch_neuronx.set_adaptive_eager(False))")
    bytes_in, bytes_out = recast_bytes(c.shapes, c.count, c.bytes_in, c.bytes_out, orig, pd)
    return _reprice(c, c.shapes, bytes_in, bytes_out, cfg, dtype=pd)


def replay_fsdp(trace, n: int, units, cfg, nodes: int, replicate: int = 1, tp: int = 1,
                tp_plan=None, mp_policy=None) -> Replay:
    """FSDP=n (HSDP with ``replicate`` > 1); with ``tp`` > 1 FSDP x TP as TorchTitan lays it
    out (mesh (dp=n, tp), TP inside); ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``. Each
    layout is the traced ops as its ranks run them (TP's replay, or the traced ops with the
    optimizer on the shards, re-priced in param_dtype under mixed precision) plus FSDP's
    collectives and copies over the parameters those ranks hold."""
    if n == 1 and not units:
        raise ValueError("replay: replicate > 1 with fsdp=1 is FSDP2 over a (replicate, 1) "
                         "mesh and needs fsdp_units, the names of the modules fully_shard "
                         "wraps ('' for the root)")
    if n == 1 and mp_policy is not None:
        raise ValueError("replay: mp_policy with a shard degree of 1 is not replayed (FSDP2 "
                         "casts without all-gathering)")
    units, covered = _check_units(trace, n, units)
    mp = _mp_dtypes(trace, mp_policy, covered, tp)
    if tp > 1:
        if "sequence" in (tp_plan or {}).values():
            raise ValueError("replay: fsdp with sequence-parallel tp is not replayed yet "
                             "(checked against real runs: tp with sequence parallelism alone)")
        # The mesh is (replicate, shard, tp), ranks tp-major: a TP group spans
        # ceil(nodes / (replicate x n)) nodes, an FSDP group one rank on each of
        # min(n, ceil(nodes / replicate)), a replica group one on each of min(replicate, nodes).
        out = replay_tp(trace, tp, tp_plan, cfg, -(-nodes // (n * replicate)), fsdp=n,
                        fsdp_covered=covered)
        out.layout = (f"fsdp={n}" + (f" replicate={replicate}" if replicate > 1 else "")
                      + f" tp={tp}")
        params = {fqn: (_tp_local_shape(fqn, shape, tp_plan, tp), dtype)
                  for fqn, (shape, dtype) in trace.params.items()}
        groups = _FsdpGroups(n, min(n, -(-nodes // replicate)), replicate, min(replicate, nodes))
    else:
        out = _traced_ops(trace, n, covered, cfg, mp)
        out.layout = f"fsdp={n}" + (f" replicate={replicate}" if replicate > 1 else "")
        params = trace.params
        # HSDP's mesh is (replicate, shard), ranks shard-major: a shard group spans
        # ceil(nodes / replicate) nodes, a replica group one rank on each of
        # min(replicate, nodes)
        groups = _FsdpGroups(n, -(-nodes // replicate), replicate, min(replicate, nodes))
    _add_fsdp(out, trace, units, params, groups, cfg, mp,
              mp is not None and getattr(mp_policy, "cast_forward_inputs", True))
    return out


@dataclass(frozen=True)
class _FsdpGroups:
    """FSDP's shard degree and the nodes its group spans; HSDP's replica degree and nodes."""
    shard: int
    shard_nodes: int
    replicate: int
    replica_nodes: int


def _check_units(trace, n: int, units) -> tuple:
    """(units, the parameters they cover), with the units checked against the trace."""
    if units is None and n > 1:
        raise ValueError("replay: fsdp > 1 needs fsdp_units, the names of the modules "
                         "fully_shard wraps ('' for the root)")
    units = units or []
    known = set(trace.modules)
    for u in units:
        if u != "" and u not in known:
            raise ValueError(f"replay: fsdp_units names {u!r}, which is not a submodule of the "
                             f"traced module")
    covered = {fqn for fqn in trace.params
               if any(u == "" or fqn.startswith(u + ".") for u in units)}
    return units, covered


def _traced_ops(trace, n: int, covered, cfg, mp) -> Replay:
    """The traced ops as an FSDP=n rank runs them: as traced (re-priced in param_dtype under
    mixed precision ``mp``), the optimizer's on the local shards of ``covered``."""
    out = Replay("")

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
            seconds, flops = (_optimizer_op(o, sharded, cfg, trace) if ratio != 1.0
                              else (c.seconds, c.flops))
        else:
            seconds, flops = _mp_op(o, *mp[::2], cfg) if mp else (c.seconds, c.flops)
        out._op(c.name, o.module, o.backward, seconds, flops)
    return out


def _add_fsdp(out: Replay, trace, units, params: dict, groups: _FsdpGroups, cfg, mp,
              cast_inputs: bool) -> None:
    """Adds to ``out`` (whose first ops are the traced ones as the layout runs them) FSDP2's
    collectives and copies over ``params`` (the parameters a rank holds before sharding), in
    FSDP2's order, and the device time its copy-ins hide; sets ``out.seconds``."""
    from ..cost_model import copy_seconds
    window = [op[3] for op in out.ops[:len(trace.ops)]]
    input_cast = 0.0
    if cast_inputs and "" in units:
        # the root's pre-forward casts its floating-point inputs to param_dtype
        for shape, dtype in trace.root_inputs:
            if dtype.is_floating_point and dtype != mp[0]:
                seconds = copy_seconds(*cfg, "copy_d2d", math.prod(shape) * mp[0].itemsize)
                input_cast += seconds
                out._op("copy_d2d", "", False, seconds)
    comm = _FsdpComm(trace, units, params, groups, cfg, mp)
    # In FSDP2's order: forward all-gathers (the root's first); in backward each unit
    # (the root keeps its parameters after forward) re-gathers, the next one's all-gather
    # prefetched before this one's reduce-scatter.
    order = _forward_order(trace, [u for u in comm.gathered if u != ""])
    for u in ([""] if "" in comm.gathered else []) + order:
        comm.all_gather(out, u, False)
    back = order[::-1]
    for i, u in enumerate(back):
        if i == 0:
            comm.all_gather(out, u, True)
        if i + 1 < len(back):
            comm.all_gather(out, back[i + 1], True)
        comm.reduce_scatter(out, u)
    if "" in comm.gathered:
        comm.reduce_scatter(out, "")
    out.overlap_seconds = _overlap(trace, window, order, comm.copy_in, comm.copy_out.get(""),
                                   input_cast)
    out.seconds = out.device_seconds + out.collective_seconds - out.overlap_seconds
    return out


class _FsdpComm:
    """FSDP2's per-unit collectives and the copies around them, over ``params`` (the
    parameters a rank holds before sharding): ``gathered`` unit -> (shard elements per
    parameter, dtype, parameter shapes); ``copy_in``/``copy_out`` the seconds of each unit's
    last all-gather's copies."""

    def __init__(self, trace, units, params: dict, groups: _FsdpGroups, cfg, mp):
        self.groups, self.cfg, self.mp, self.n = groups, cfg, mp, groups.shard
        self.copy_in, self.copy_out, self.gathered = {}, {}, {}
        for unit, owned in _unit_params(params, units).items():
            if not owned:
                continue
            calls = trace.forward_calls.get(unit, 0)
            if calls != 1:
                raise ValueError(f"replay: fsdp unit {unit!r} ran forward {calls} times in the "
                                 f"traced step; FSDP2 all-gathers and reshards it per call, "
                                 f"which is replayed for one call only" + (
                                     " (a module called inside a torch.compile graph "
                                     "runs no hooks, its work is the graph's: compile each "
                                     "unit on its own, torch.compile(block) as TorchTitan "
                                     "does, or trace the step eagerly)" if calls == 0 else ""))
            dtype = owned[0][1]
            if any(d != dtype for _, d in owned):
                raise ValueError(f"replay: fsdp unit {unit!r} mixes parameter dtypes; FSDP2 "
                                 f"all-gathers one flat buffer per dtype, which is not replayed")
            self.gathered[unit] = ([_shard_numel(s, self.n) for s, _ in owned], dtype,
                                   [s for s, _ in owned])

    def all_gather(self, out: Replay, unit: str, bw: bool) -> None:
        """Adds one all-gather of ``unit`` to ``out``: copy-in, collective, copy-outs."""
        from ..cost_model import copy_seconds, op_seconds
        from ..distributed.collectives_model import collective_seconds
        n, mp, cfg = self.n, self.mp, self.cfg
        shards, dtype, _ = self.gathered[unit]
        if mp and mp[0] != dtype:
            # two list copies, recorded as one op of two launches: the cast of the shards to
            # param_dtype, then the copy into the all-gather input
            dtype, total = mp[0], sum(shards)
            nbytes, launches = total * (mp[2].itemsize + 3 * mp[0].itemsize), 2
        else:
            dtype = mp[0] if mp else dtype
            nbytes, launches = 2 * sum(shards) * dtype.itemsize, 1   # dst and src
        item = dtype.itemsize
        self.copy_in[unit] = 0.0
        if n > 1:   # a shard group of one rank gathers nothing: its shards are copied out
            self.copy_in[unit] = op_seconds(*cfg, "_foreach_copy_", [(s,) for s in shards],
                                            dtype, nbytes, 0, launches)[0]
            out._op("_foreach_copy_", unit, bw, self.copy_in[unit])
            flat = n * sum(shards) * item
            out._collective("all_gather", flat, n, collective_seconds(
                "all_gather", flat, n, self.groups.shard_nodes, *cfg))
        self.copy_out[unit] = 0.0
        for s in shards:   # copy-out: each parameter's (n, shard) rows from the flat output
            seconds = copy_seconds(*cfg, "copy_d2d", n * s * item)
            self.copy_out[unit] += seconds
            out._op("copy_d2d", unit, bw, seconds)

    def reduce_scatter(self, out: Replay, unit: str) -> None:
        """Adds one reduce-scatter of ``unit``'s gradients to ``out`` (and HSDP's
        all-reduce of the shard)."""
        from ..cost_model import copy_seconds, op_seconds
        from ..distributed.collectives_model import collective_seconds
        n, mp, cfg, groups = self.n, self.mp, self.cfg, self.groups
        shards, dtype, shapes = self.gathered[unit]
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
                out._op("zero_", unit, True, op_seconds(*cfg, "zero_", [padded], dtype,
                                                        n * s * item, n * s * item)[0])
                out._op("copy_d2d", unit, True, copy_seconds(*cfg, "copy_d2d",
                                                             math.prod(shape) * item))
        # copy-in: the gradients as (n, shard) rows into one flat input (the runtime counts
        # cat's output buffer among its inputs, as it records chunk_cat)
        out._op("cat", unit, True, op_seconds(*cfg, "cat", [(n, s) for s in shards], dtype,
                                              flat + grads, flat)[0])
        if n > 1:
            out._collective("reduce_scatter", flat, n, collective_seconds(
                "reduce_scatter", flat, n, groups.shard_nodes, *cfg))
        else:   # one rank: the reduce-scatter is a copy of its input to its output
            out._op("copy_d2d", unit, True, copy_seconds(*cfg, "copy_d2d", flat))
        if groups.replicate > 1:
            # HSDP: the reduce-scattered shard is then all-reduced across the replicas
            # (averaged on the host, as the reduce-scatter is: no device op)
            shard = flat // n
            out._collective("all_reduce", shard, groups.replicate, collective_seconds(
                "all_reduce", shard, groups.replicate, groups.replica_nodes, *cfg))


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
