"""Expert parallelism (MoE) replayed from a step traced on one device: each of N ranks holds
E / N of the experts (contiguous, in the order named), the routed tokens are dispatched with
``all_to_all_single`` after the per-expert counts are exchanged (TorchTitan's order) and
combined back with the reverse all_to_all; the non-expert parameters are data parallel
(docs/plan.md, "Replaying a traced step").

Every rank is taken to route its tokens as the traced step did, so expert e, of c_e traced
tokens, receives c_e tokens from each of the N ranks and runs once per source chunk (no
regrouping copy): its traced ops N times, and N - 1 gradient ``add``s per parameter. The ops
outside the experts run as traced, but for the ``cat`` of the expert outputs (forward) and
of the received chunks' gradients (backward), re-priced for the rank's chunks, and what the
counts exchange adds: the per-rank ``sum`` of the counts and its copy to the host. The
collectives: the counts (E int64), the dispatch (the traced tokens sorted by expert), the
combine (the rank's received tokens), both again in backward, and one ``all_reduce`` per
non-expert gradient. A rank's busy time is what its own modelled clock reports; the step
waits for the slowest rank (the all_to_alls synchronise them), the others' wait is their
``bubble_seconds``.
"""
from __future__ import annotations

import fnmatch
import math

import torch

from .replay import Replay, _is_optimizer, _optimizer_op


def _experts(trace, ep: int, names) -> list:
    """The expert module names, in order: ``names`` a list of names or a glob over the traced
    module's submodules (the outermost matches)."""
    if names is None:
        raise ValueError(f"replay: ep={ep} needs ep_experts, the expert modules' names (a list "
                         "or a glob such as 'experts.*')")
    if isinstance(names, str):
        found = [m for m in trace.modules if m and fnmatch.fnmatchcase(m, names)]
        found = [m for m in found if not any(m.startswith(f + ".") for f in found)]
        if not found:
            raise ValueError(f"replay: ep_experts={names!r} matches no submodule of the traced "
                             "module")
    else:
        found = list(names)
        for m in found:
            if m not in trace.modules or m == "":
                raise ValueError(f"replay: ep_experts names {m!r}, which is not a submodule of "
                                 "the traced module")
    if len(found) % ep:
        raise ValueError(f"replay: ep={ep} does not divide the {len(found)} experts "
                         f"({', '.join(found)})")
    for m in found:
        if trace.forward_calls.get(m, 0) != 1:
            raise ValueError(f"replay: expert {m!r} ran forward {trace.forward_calls.get(m, 0)} "
                             "times; replayed for one call")
    return found


def _tokens(trace, expert: str) -> tuple:
    """(tokens, features, dtype) of what the expert returned in the traced step."""
    outs = trace.module_outputs.get(expert) or []
    if len(outs) != 1 or len(outs[0][0]) != 2:
        raise ValueError(f"replay: expert {expert!r} returned {outs}; one (tokens, features) "
                         "tensor is replayed")
    (c, d), dtype = outs[0]
    return c, d, dtype


def _owner(o, experts: list, counts: dict) -> list | None:
    """The experts an op ran for (None: outside the experts). Forward, the module it ran
    under; backward, ModTracker's module is not reliable between sibling experts, so the
    experts whose token count is one of the op's dims (experts of equal counts run equal
    ops: the op is theirs in equal shares)."""
    if o.module is None:
        return None
    mine = [e for e in experts if o.module == e or o.module.startswith(e + ".")]
    if not mine:
        return None
    if not o.backward:
        return mine
    dims = {d for s in o.charge.shapes or () for d in s}
    values = {c for c in counts.values() if c in dims}
    if len(values) != 1:
        raise ValueError(f"replay: cannot tell which expert's backward ran {o.charge.name} "
                         f"{list(o.charge.shapes or ())}: its dims match the token counts "
                         f"{sorted(values)} of the experts {counts}")
    c = values.pop()
    return [e for e in experts if counts[e] == c]


def _fsdp_dense(trace, ep: int, fsdp: int, units, experts: list) -> dict:
    """With ``fsdp`` > 1, FSDP2 over the same ranks as EP (TorchTitan's dp_shard = ep) on the
    root, the experts ignored (EP holds them): the non-expert parameters it shards."""
    if fsdp != ep:
        raise ValueError(f"replay: ep={ep} with fsdp={fsdp}: FSDP2 over the same ranks as "
                         f"expert parallelism (fsdp = ep) is replayed")
    if list(units or []) != [""]:
        raise ValueError(f"replay: ep with fsdp replays FSDP2 on the root only "
                         f"(fsdp_units=[''], the experts ignored: expert parallelism holds "
                         f"them), not fsdp_units={units!r}")
    return {f: v for f, v in trace.params.items() if not any(f.startswith(e + ".")
                                                              for e in experts)}


def replay_ep(trace, ep: int, names, cfg, nodes: int, fsdp: int = 1,
              fsdp_units=None) -> Replay:
    """One Replay per rank (``.stages``); returned: the slowest rank's. ``fsdp`` = ep with
    ``fsdp_units`` [""]: FSDP2 shards the non-expert parameters over the same ranks (their
    all-gather in forward and reduce-scatter in backward replace the all-reduces)."""
    from ..cost_model import copy_seconds, op_seconds
    from ..distributed.collectives_model import collective_seconds
    from .replay import _shard_shape
    from .replay_fsdp import _FsdpComm, _FsdpGroups
    experts = _experts(trace, ep, names)
    dense = _fsdp_dense(trace, ep, fsdp, fsdp_units, experts) if fsdp > 1 else None
    comm = (_FsdpComm(trace, [""], dense, _FsdpGroups(fsdp, nodes, 1, 1), cfg, None)
            if dense is not None else None)
    p, lnc = cfg
    info = {e: _tokens(trace, e) for e in experts}
    counts = {e: info[e][0] for e in experts}
    local = len(experts) // ep
    # the counts exchange runs in the MoE block: the parent of the experts' container
    parent = experts[0].rpartition(".")[0].rpartition(".")[0]
    total = sum(counts.values())
    _, d, dtype = info[experts[0]]
    row = d * dtype.itemsize
    out = []
    for r in range(ep):
        held = experts[r * local:(r + 1) * local]
        rep = Replay(f"ep={ep}" + (f" fsdp={fsdp}" if dense is not None else "") + f" rank={r}")
        owned = {f for f in trace.params
                 if not any(f.startswith(e + ".") for e in experts)
                 or any(f.startswith(e + ".") for e in held)}

        def mine(f, shape, n, owned=owned, r=r):
            if f not in owned:
                return 0
            if dense is not None and f in dense and shape:
                # FSDP2's shard of rank r: dim 0 in chunks of ceil(d0 / fsdp) rows
                chunk = _shard_shape(shape, fsdp)[0]
                return max(0, min(chunk, shape[0] - r * chunk)) * (n // shape[0])
            return n
        chunks = [(counts[e], d) for _ in range(ep) for e in held]
        recv = sum(c for c, _ in chunks)

        def coll(op, nbytes):
            rep._collective(op, nbytes, ep, collective_seconds(op, nbytes, ep, nodes, p, lnc))
        if comm is not None:   # the root's all-gather, in its pre-forward
            comm.all_gather(rep, "", False)
        coll("all_to_all", len(experts) * 8)   # the counts
        coll("all_to_all", total * row)        # dispatch
        # the split sizes: the counts summed per destination rank, copied to the host
        rep._op("sum", parent, False, op_seconds(p, lnc, "sum", [(ep, local)], torch.int64,
                                                 ep * local * 8, ep * 8)[0])
        rep._op("copy_d2h", parent, False, copy_seconds(p, lnc, "copy_d2h", ep * 8))
        combined = False
        for o in trace.ops:
            c = o.charge
            if c.engine == "collective":
                raise ValueError(f"replay: the traced step issued {c.name}; ep is replayed "
                                 "from a step traced without collectives")
            if _is_optimizer(c.name):
                rep._op(c.name, o.module, o.backward,
                        *_optimizer_op(o, mine, cfg, trace))
                continue
            who = _owner(o, experts, counts)
            if who is not None:
                share = sum(e in held for e in who) / len(who)
                for _ in range(ep if share else 0):
                    rep._op(c.name, o.module, o.backward, c.seconds * share, c.flops * share)
                continue
            if c.name == "cat" and [s[0] for s in c.shapes] == [counts[e] for e in experts][:3]:
                # the expert outputs' cat (forward), the received chunks' gradients (backward)
                nb = c.bytes_in * recv // total
                seconds = op_seconds(p, lnc, "cat", chunks[:3], c.dtype, nb, nb)[0]
                rep._op(c.name, o.module, o.backward, seconds)
                if not o.backward and not combined:
                    coll("all_to_all", recv * row)   # combine
                    combined = True
                continue
            rep._op(c.name, o.module, o.backward, c.seconds, c.flops)
        if not combined:
            raise ValueError("replay: found no cat of the expert outputs in the traced step "
                             f"(a cat whose inputs have the experts' token counts "
                             f"{list(counts.values())[:3]} rows); ep replays a block that "
                             "concatenates its experts' outputs")
        coll("all_to_all", total * row)    # the combine's gradient
        coll("all_to_all", recv * row)     # the dispatch's gradient
        for f, (shape, dt) in trace.params.items():
            if any(f.startswith(e + ".") for e in held):
                nb = math.prod(shape) * dt.itemsize
                for _ in range(ep - 1):
                    rep._op("add", f, True, op_seconds(p, lnc, "add", [shape, shape], dt,
                                                       2 * nb, nb)[0])
        if comm is not None:   # the root's reduce-scatter, in its post-backward
            comm.reduce_scatter(rep, "")
        else:
            for f, (shape, dt) in trace.params.items():
                if not any(f.startswith(e + ".") for e in experts):
                    coll("all_reduce", math.prod(shape) * dt.itemsize)
        out.append(rep)
    busy = [r.device_seconds + r.collective_seconds for r in out]
    for r, b in zip(out, busy):
        r.seconds = max(busy)
        r.bubble_seconds = max(busy) - b
        r.stages = out
    return out[busy.index(max(busy))]
