"""Pipeline parallelism replayed from a step traced on one device: ``torch.distributed.pipelining``
with one ``PipelineStage`` per rank and ``ScheduleGPipe`` or ``Schedule1F1B`` over M
micro-batches (docs/plan.md, "Replaying a traced step").

Each stage runs the traced ops of its modules (split by module boundary; the loss, computed
outside the model, on the last stage) once per micro-batch, re-priced by the cost model with
the batch dimension divided by M, and adds what the real ranks issue: the ``send``/``recv``
of the activation (forward) and of its gradient (backward) per micro-batch, the ``add_``
accumulating each gradient over micro-batches 2..M, the ``div_`` by M of every gradient
(``scale_grads``), the last stage's ``cat`` of the M outputs, and the optimizer over the
stage's parameters. That sum is the stage's busy time, what its rank's modelled clock
reports. The step is the schedule's makespan: the stages' actions run in the schedule's
order, a micro-batch's forward on stage s after it left stage s - 1, its backward after it
left stage s + 1; ``bubble_seconds`` is a stage's idle time in it.

With TP inside each stage (a (pp, tp) mesh), a stage's ops are its TP rank's
(``replay_tp.tp_stream``), and each TP collective is issued per micro-batch. With FSDP inside
each stage (a (pp, dp) mesh, not resharded after forward), each unit is all-gathered once
before the first forward and reduce-scattered once after the last backward.
"""
from __future__ import annotations

import math

from .replay import (Replay, _is_optimizer, _optimizer_op, _root_dim0,
                     _shard_shape, _split_op, _within)
from .replay_tp import _tp_comm, _tp_local_shape, tp_stream

SCHEDULES = ("gpipe", "1f1b")


def stage_of(module, units: list, what: str) -> int | None:
    """The pipeline stage (``units``: each stage's module names) holding ``module``, None for
    None (outside the model); ``what`` (an op, a saved tensor, an FSDP unit; "{where}" in it
    is the module) is named when no stage holds it."""
    if module is None:
        return None
    for s, names in enumerate(units):
        if module != "" and _within(module, names):
            return s
    where = "the root module itself" if module == "" else f"module {module!r}"
    raise ValueError(f"replay: {what.format(where=where)} is in no pipeline stage "
                     f"(pp_stages={units}); the replay splits stages by module boundary")


def _check(trace, pp: int, stages, schedule: str, m: int) -> tuple:
    """(stage units as lists, the batch size split into micro-batches)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"replay: schedule={schedule!r}; replayed: {', '.join(SCHEDULES)}")
    if stages is None or len(stages) != pp:
        raise ValueError(f"replay: pp={pp} needs pp_stages, one module name (or list of names) "
                         f"per stage, got {stages!r}")
    units = [[s] if isinstance(s, str) else list(s) for s in stages]
    for s, names in enumerate(units):
        if not names:
            raise ValueError(f"replay: pipeline stage {s} holds no module (pp_stages={stages})")
    for u in (u for names in units for u in names):
        if u not in trace.modules or u == "":
            raise ValueError(f"replay: pp_stages names {u!r}, which is not a submodule of the "
                             f"traced module")
    if schedule == "1f1b" and m < pp:
        raise ValueError(f"replay: Schedule1F1B needs microbatches >= pp, got {m} < {pp}")
    batch = _root_dim0(trace, m, "microbatches")
    for u in (names[-1] for names in units):
        if trace.forward_calls.get(u, 0) != 1:
            raise ValueError(f"replay: pipeline stage module {u!r} ran forward "
                             f"{trace.forward_calls.get(u, 0)} times; replayed for one call")
    return units, batch


def _p2p_bytes(trace, unit: str, m: int) -> int:
    """Bytes a stage ending in ``unit`` sends per micro-batch: its output, split on dim 0."""
    outs = trace.module_outputs.get(unit) or []
    if len(outs) != 1:
        raise ValueError(f"replay: pipeline stage module {unit!r} returned {len(outs)} "
                         f"tensors; one activation between stages is replayed")
    shape, dtype = outs[0]
    return math.prod(shape) // m * dtype.itemsize


def replay_pp(trace, pp: int, stages, schedule: str, m: int, cfg, nodes: int, tp: int = 1,
              tp_plan=None, fsdp: int = 1, fsdp_units=None, replicate: int = 1) -> Replay:
    """One Replay per stage (``.stages``); returned: the stage with the longest busy time.
    With ``tp`` > 1, TP inside each stage (a (pp, tp) mesh, TorchTitan's order): a stage's
    ops are its TP rank's (``tp_stream``), each TP collective issued per micro-batch. With
    ``fsdp`` > 1, FSDP2 inside each stage (a (pp, dp) mesh) on ``fsdp_units``, not
    resharded after forward (TorchTitan's default under PP): each unit all-gathered before
    the first micro-batch's forward, its accumulated gradients reduce-scattered after the
    last one's backward, the gradient scaling and the optimizer on the shards; with
    ``replicate`` > 1 HSDP, on a (pp, replicate, shard) mesh (each reduce-scattered shard
    then all-reduced over the replicas; a shard degree of 1 is FSDP2's replicas). With TP
    too: on a (pp, [replicate,] dp, tp) mesh, FSDP over the TP-local parameters."""
    from ..cost_model import op_seconds
    from ..distributed.collectives_model import collective_seconds
    from .replay_fsdp import _check_units, _FsdpComm, _FsdpGroups, _forward_order
    units, batch = _check(trace, pp, stages, schedule, m)
    if tp > 1 and "sequence" in (tp_plan or {}).values():
        raise ValueError("replay: pp with sequence-parallel tp is not replayed yet (checked "
                         "against real runs: pp with tp)")
    sharding = fsdp > 1 or replicate > 1
    if replicate > 1 and not fsdp_units:
        raise ValueError(f"replay: pp with replicate={replicate} is HSDP inside the stages and "
                         "needs fsdp_units")
    fsdp_units, covered = (_check_units(trace, fsdp, fsdp_units) if sharding
                           else ([], set()))
    # each stage shards its own modules
    unit_stage = {u: stage_of(u, units, f"fsdp unit {u!r}") for u in fsdp_units}
    p, lnc = cfg
    # a p2p goes through the pipeline group: the backend charges it as the group's (its
    # price is one link's, over EFA when the group spans nodes); the mesh is (pp, replicate,
    # dp, tp), so a TP group spans ceil(nodes / (pp x replicate x dp)) nodes, an FSDP group
    # one rank on each of min(dp, ceil(nodes / (pp x replicate))), a replica group one on
    # each of min(replicate, ceil(nodes / pp)), a pipeline group one on each of min(pp, nodes)
    p2p = lambda op, nbytes: collective_seconds(  # noqa: E731
        op, nbytes, pp, min(pp, nodes), p, lnc)
    tp_nodes = -(-nodes // (pp * replicate * fsdp))
    link = [_p2p_bytes(trace, names[-1], m) for names in units[:-1]]
    params = {f: (_tp_local_shape(f, shape, tp_plan, tp) if tp > 1 else shape, dtype)
              for f, (shape, dtype) in trace.params.items()}
    groups = _FsdpGroups(fsdp, min(fsdp, -(-nodes // (pp * replicate))), replicate,
                         min(replicate, -(-nodes // pp)))
    fsdp_comm = _FsdpComm(trace, fsdp_units, params, groups, cfg, None) if sharding else None
    fsdp_order = _forward_order(trace, fsdp_units) if sharding else []
    # the parameters a rank steps and scales: FSDP's shards of its units' parameters
    held = {f: (_shard_shape(shape, fsdp) if f in covered else shape, dtype)
            for f, (shape, dtype) in params.items()}
    # the rank's work in issue order: ("op", TracedOp) and, with tp, ("comm", comm) after
    # the op that issues it
    work = list(tp_stream(trace, tp, tp_plan, cfg)) if tp > 1 else [("op", o) for o in trace.ops]
    out = []
    for s, names in enumerate(units):
        r = Replay(f"pp={pp}" + (f" replicate={replicate}" if replicate > 1 else "")
                   + (f" fsdp={fsdp}" if fsdp > 1 else "")
                   + (f" tp={tp}" if tp > 1 else "")
                   + f" {schedule} microbatches={m} stage={s}")
        owned = {f for f in trace.params if any(f.startswith(u + ".") for u in names)}
        def mine(f, _, n, owned=owned):
            return math.prod(held[f][0]) if f in owned else 0
        fwd, bwd, tail = [], [], []   # per micro-batch forward and backward, then once
        here = False   # whether the last op was this stage's (a comm follows its op)
        for kind, o in work:
            if kind == "comm":
                if here:
                    (bwd if o[0] in ("col_grad_in", "row_grad_out") else fwd).append(
                        ("comm", o))
                continue
            c = o.charge
            if c.engine == "collective":
                raise ValueError(f"replay: the traced step issued {c.name}; pp is replayed "
                                 f"from a step traced without collectives")
            if _is_optimizer(c.name):
                tail.append((o, *_optimizer_op(o, mine, cfg, trace)))
                here = False
                continue
            where = stage_of(o.module, units, f"{c.name}, which ran in {{where}},")
            here = where == s or (where is None and s == pp - 1)   # the loss: last stage
            if here:
                (bwd if o.backward else fwd).append((o, *_split_op(o, batch, m, cfg)))
        grads = []   # each gradient accumulated over micro-batches 2..m, then divided by m
        for f in sorted(owned):
            shape, dtype = params[f]
            nb = math.prod(shape) * dtype.itemsize
            grads.append(("add_", f, [shape, shape], dtype, 2 * nb, nb))
            if m > 1:   # scale_grads: on the gradient a rank holds (FSDP: its shard)
                shard = held[f][0]
                sb = math.prod(shard) * dtype.itemsize
                tail.append((None, "div_", f, op_seconds(p, lnc, "div_", [shard], dtype,
                                                          sb, sb)[0]))
        if s == pp - 1 and m > 1:
            # the schedule merges the M outputs of the last stage (the runtime keeps 3 shapes)
            shape, dtype = trace.module_outputs[""][0]
            mb = (shape[0] // m, *shape[1:])
            nb = math.prod(shape) * dtype.itemsize
            tail.append((None, "cat", "", op_seconds(p, lnc, "cat", [mb] * min(m, 3), dtype,
                                                      nb, nb)[0]))
        def comm(x, r=r):
            _tp_comm(r, trace, x, False, tp, tp_nodes, cfg, parts=m)
        mine = [u for u in fsdp_order if unit_stage[u] == s]
        r._actions = _actions(r, s, pp, m, schedule, fwd, bwd, grads, link, p2p, cfg, comm,
                              lambda r=r, mine=mine: [fsdp_comm.all_gather(r, u, False)
                                                      for u in mine])
        for u in mine[::-1]:
            # FSDP's post-backward, after the last micro-batch's backward (and its send)
            fsdp_comm.reduce_scatter(r, u)
        for o, *rest in tail:
            if o is None:
                name, module, seconds = rest
                r._op(name, module, True, seconds)
            else:
                r._op(o.charge.name, o.module, o.backward, *rest)
        out.append(r)
    makespan = _makespan(out, pp, m, schedule)
    for r in out:
        busy = r.device_seconds + r.collective_seconds
        r.bubble_seconds = makespan - busy
        r.seconds = makespan
        r.stages = out
        del r._actions
    return max(out, key=lambda r: r.device_seconds + r.collective_seconds)


def _actions(r: Replay, s: int, pp: int, m: int, schedule: str, fwd, bwd, grads, link, p2p,
             cfg, comm, gather) -> dict:
    """Adds stage ``s``'s per-micro-batch work to ``r`` in the schedule's order (``comm``
    adds a TP collective's, ``gather`` FSDP's all-gathers before the first forward's
    compute); returns each action's seconds, ("F" | "B", micro-batch) -> seconds."""
    from ..cost_model import op_seconds
    p, lnc = cfg
    seconds = {}
    for kind, i in _order(schedule, s, pp, m):
        t0 = r.device_seconds + r.collective_seconds
        # forward: receive the activation, compute, send it on; backward: receive the
        # gradient of the output, compute (accumulating into the gradients after the first
        # micro-batch), send the gradient of the input back
        recv, send = (s - 1, s) if kind == "F" else (s, s - 1)
        if 0 <= recv < pp - 1:
            r._collective("recv", link[recv], pp, p2p("recv", link[recv]))
        if (kind, i) == ("F", 0):
            gather()
        for o, *rest in (fwd if kind == "F" else bwd):
            if o == "comm":
                comm(rest[0])
            else:
                r._op(o.charge.name, o.module, kind == "B", *rest)
        if kind == "B" and i > 0:
            for name, fqn, shapes, dtype, nin, nout in grads:
                r._op(name, fqn, True, op_seconds(p, lnc, name, shapes, dtype, nin, nout)[0])
        if 0 <= send < pp - 1:
            r._collective("send", link[send], pp, p2p("send", link[send]))
        seconds[kind, i] = r.device_seconds + r.collective_seconds - t0
    return seconds


def _order(schedule: str, s: int, pp: int, m: int) -> list:
    """Stage ``s``'s actions in the order torch.distributed.pipelining runs them."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    # Schedule1F1B: min(m, pp - s) forwards, then one backward and one forward until the
    # forwards are done, then the remaining backwards
    warm = min(m, pp - s)
    order = [("F", i) for i in range(warm)]
    f = warm
    for b in range(m):
        order.append(("B", b))
        if f < m:
            order.append(("F", f))
            f += 1
    return order


def _makespan(stages: list, pp: int, m: int, schedule: str) -> float:
    """The step's end: each stage runs its actions in order, a forward after the previous
    stage's forward of that micro-batch ended, a backward after the next stage's backward
    (the last stage's after its own forward); then its work outside the micro-batches."""
    end = {}
    pending = {s: _order(schedule, s, pp, m) for s in range(pp)}
    clock = [0.0] * pp
    while any(pending.values()):
        moved = False
        for s in range(pp):
            while pending[s]:
                kind, i = pending[s][0]
                dep = ((s - 1, "F", i) if kind == "F" and s > 0 else
                       (s + 1, "B", i) if kind == "B" and s < pp - 1 else None)
                if dep is not None and dep not in end:
                    break
                start = max(clock[s], end[dep] if dep else 0.0)
                clock[s] = end[s, kind, i] = start + stages[s]._actions[kind, i]
                pending[s].pop(0)
                moved = True
        if not moved:
            raise RuntimeError(f"replay: the {schedule} schedule deadlocked (pp={pp}, m={m})")
    busy = [r.device_seconds + r.collective_seconds for r in stages]
    actions = [sum(r._actions.values()) for r in stages]
    return max(c + b - a for c, b, a in zip(clock, busy, actions))
