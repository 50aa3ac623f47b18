"""HBM per device of a traced step replayed under a layout (docs/plan.md, "Memory of a
replayed step").

What the trace measured on one device (``plan.trace(device, module)``): the parameters,
their gradients and the optimizer's state per parameter, every tensor autograd saved for the
backward (with the module and the op it was saved at), and the rest the allocator held at
the start (inputs, buffers). A layout's rank holds its local share of each: the parameters
as the layout shards them (the same rule as the replayed optimizer), saved tensors at the
shapes the replay gives the ops around them (``replay_tp.tp_saved``), a pipeline stage its
own modules' for the micro-batches in flight. Their sum is not the peak: the backward frees
saved tensors as it creates gradients. The peak is found by walking the backward over the
trace's module boundaries, in reverse: at each boundary the gradients of the module's
parameters appear, the tensors saved after it are freed. Beside them the backward holds the
gradient flowing between ops, counted as two of the largest saved tensors (the op's
incoming and outgoing gradients; with gradient accumulation also the largest parameter's
gradient, computed apart before it is added), and the optimizer step its out-of-place
results (the traced optimizer ops' outputs that are not in place, such as AdamW's square
roots, at the rank's share of the parameters); FSDP adds its all-gathered units (the unit running and the
one prefetched), computes a unit's gradients whole until its reduce-scatter, and keeps each
reduce-scatter's flat input until the next one (``_Unit``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .replay import _is_optimizer, _within


@dataclass
class Memory:
    """One rank's HBM: the bytes each term holds at most (``parameters``, ``gradients``,
    ``optimizer`` state, ``activations`` saved for the backward, FSDP's ``gathered``
    parameters with the reduce-scatter input it keeps, ``transient``: the gradient flowing between backward ops or
    the optimizer's out-of-place results, ``other``: inputs and buffers), the step's
    ``peak`` (the walk's maximum, at most their sum) and the logical core's HBM
    ``capacity``."""
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    gathered: int
    transient: int
    other: int
    peak: int
    capacity: int

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def __str__(self):
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (f"HBM {self.peak / 2**20:.2f} / {self.capacity / 2**20:.0f} MiB {verdict} "
                f"(parameters {self.parameters / 2**20:.2f}, gradients "
                f"{self.gradients / 2**20:.2f}, optimizer {self.optimizer / 2**20:.2f}, "
                f"activations {self.activations / 2**20:.2f}, gathered "
                f"{self.gathered / 2**20:.2f}, transient {self.transient / 2**20:.2f}, other "
                f"{self.other / 2**20:.2f} MiB)")


def _module_of(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _check(trace) -> None:
    if not trace.first_op:
        raise ValueError("replay: the step's memory is recorded by plan.trace(device, module); "
                         "this trace has no module")


@dataclass(frozen=True)
class _Unit:
    """An FSDP unit as the memory walk sees it: the op index of its first forward (None:
    gathered the whole step, as the root, or every unit under pp), its parameters'
    all-gathered bytes, its parameters' fqns, its reduce-scatter's flat input (FSDP2 keeps
    it until the next unit's reduce-scatter, so that the allocator does not hand it to
    another stream's work early), and what that reduce-scatter adds when it starts: the
    flat input and the zeroed padded copies of gradients whose dim 0 does not split evenly,
    less the gathered parameters FSDP2 frees just before."""
    at: int | None
    gathered: int
    params: frozenset
    flat: int = 0
    scatter: int = 0


def replay_memory(trace, local_numel: dict, saved: list, cfg, units=(), unsharded=None,
                  inflight: float = 1.0, other: bool = True,
                  accumulate: bool = False) -> Memory:
    """``local_numel``: parameter fqn -> the elements the rank holds (absent: none);
    ``saved``: per saved tensor of the trace, the bytes the rank holds (0: none);
    ``units``: FSDP's ``_Unit``s, and ``unsharded``: fqn -> the bytes of an FSDP
    parameter's gradient before sharding (it is computed whole, and reduce-scattered when
    the backward leaves its unit); ``inflight``: the micro-batches whose saved tensors a
    pipeline stage holds at once, as a fraction of the traced batch; ``other``: whether the
    rank holds the trace's other bytes (inputs, buffers); ``accumulate``: gradients are
    accumulated over micro-batches."""
    _check(trace)
    p, lnc = cfg
    unsharded = unsharded or {}
    kept = trace.kept_grads
    params = grads = opt = 0
    grad_at = {}      # op index -> gradient bytes that appear there in the backward
    scatter_at = {}   # op index -> bytes the reduce-scatters there free (whole - shard)
    unit_of = {f: u for u in units for f in u.params}
    persistent = largest = traced_state = 0
    for fqn, (shape, dtype) in trace.params.items():
        numel = math.prod(shape)
        share = local_numel.get(fqn, 0) / numel if numel else 0.0
        g = trace.grad_bytes.get(fqn, 0)
        traced_state += numel * dtype.itemsize + g + trace.optimizer_bytes.get(fqn, 0)
        params += round(numel * dtype.itemsize * share)
        opt += round(trace.optimizer_bytes.get(fqn, 0) * share)
        local_g = round(g * share)
        grads += local_g
        whole_g = unsharded[fqn] if fqn in unsharded and share else local_g
        largest = max(largest, whole_g)
        if fqn in kept:
            persistent += local_g
            continue
        at = trace.first_op.get(_module_of(fqn), 0)
        grad_at[at] = grad_at.get(at, 0) + whole_g
        u = unit_of.get(fqn)
        if u is not None and u.at is not None:
            scatter_at[u.at] = scatter_at.get(u.at, 0) + whole_g - local_g
    # the rest the allocator held at the start: the step's inputs and the module's buffers
    rest = max(0, trace.memory_start - traced_state) if other else 0
    held = [round(b * inflight) for b in saved]
    free_at = {}
    for b, t in zip(held, trace.saved):
        free_at[t.at] = free_at.get(t.at, 0) + b
    activations = sum(held)
    flowing = 2 * max(held, default=0)
    if kept or accumulate:
        # a gradient added to one kept from before (or from an earlier micro-batch) is
        # computed apart first: the largest parameter's
        flowing += largest
    base = params + opt + rest
    whole = sum(u.gathered for u in units if u.at is None)
    sharded = sorted((u for u in units if u.at is not None), key=lambda u: u.at)

    def gathered(at, backward):
        """FSDP's all-gathered parameters at op index ``at``: the units gathered the whole
        step, the unit running and the one prefetched after it (before it, in backward)."""
        running = [i for i, u in enumerate(sharded) if u.at <= at]
        if not running:
            return whole
        i = running[-1]
        near = sharded[i - 1] if backward and i > 0 else (
            sharded[i + 1] if not backward and i + 1 < len(sharded) else None)
        return whole + sharded[i].gathered + (near.gathered if near else 0)

    last = max([len(trace.ops)] + list(grad_at) + list(free_at))
    most_gathered = gathered(last, False)
    peak = base + persistent + activations + most_gathered
    alive, g, kept_flat = activations, persistent, 0
    for at in sorted(set(grad_at) | set(free_at) | set(scatter_at), reverse=True):
        g += grad_at.get(at, 0)
        fs = gathered(at, True) + kept_flat
        most_gathered = max(most_gathered, fs)
        peak = max(peak, base + g + alive + flowing + fs)
        for u in (u for u in sharded if u.at == at):   # the unit's reduce-scatter
            peak = max(peak, base + g + alive + fs + u.scatter)
            kept_flat = u.flat
        g -= scatter_at.get(at, 0)
        alive -= free_at.get(at, 0)
    # the optimizer step: its out-of-place results (torch.optim's foreach ops), on the rank's
    # share of the parameters
    full = sum(math.prod(s) * d.itemsize for s, d in trace.params.values())
    temps = sum(o.charge.bytes_out for o in trace.ops if _is_optimizer(o.charge.name)
                and not o.charge.name.endswith("_")) * params // max(1, full)
    peak = max(peak, base + g + temps)
    return Memory(params, grads, opt, activations, most_gathered, max(flowing, temps), rest,
                  peak, p.core_hbm_bytes(lnc))


def _once(trace) -> list:
    """Each saved tensor's bytes, a storage several ops saved counted once."""
    first = {}
    for i, t in enumerate(trace.saved):
        first.setdefault(t.storage, i)
    return [t.nbytes if first[t.storage] == i else 0 for i, t in enumerate(trace.saved)]


def layout_memory(trace, cfg, *, fsdp=1, fsdp_units=None, replicate=1, tp=1, tp_plan=None,
                  pp=1, pp_stages=None, schedule="gpipe", microbatches=1, mp_policy=None) -> list:
    """Each rank kind's ``Memory`` under a layout that ``replay_layout`` replays: one, or
    with pp one per stage. A data-parallel replica (``replicate``) holds what an FSDP rank
    of its shard group holds."""
    from .replay import _shard_numel
    from .replay_fsdp import _check_units, _unit_of
    from .replay_pp import stage_of
    from .replay_tp import _tp_local_shape, tp_saved
    _check(trace)
    sharding = fsdp > 1 or (replicate > 1 and fsdp_units is not None)
    names, covered = _check_units(trace, fsdp, fsdp_units) if sharding else ([], set())
    local, unsharded = {}, {}
    members = {u: set() for u in names}
    gathered, flat, padding = {u: 0 for u in names}, {u: 0 for u in names}, {u: 0 for u in names}
    # FSDP2 gathers the parameters and computes their gradients in param_dtype, reduces in
    # reduce_dtype
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or param_dtype
    for fqn, (shape, dtype) in trace.params.items():
        s = _tp_local_shape(fqn, shape, tp_plan, tp) if tp > 1 else tuple(shape)
        n = math.prod(s)
        local[fqn] = n
        if fqn in covered:
            shard = _shard_numel(s, fsdp)
            local[fqn] = min(n, shard)
            unsharded[fqn] = n * (param_dtype or dtype).itemsize
            u = _unit_of(_module_of(fqn), names)
            members[u].add(fqn)
            gathered[u] += fsdp * shard * (param_dtype or dtype).itemsize
            rows = fsdp * shard * (reduce_dtype or dtype).itemsize
            flat[u] += rows
            padding[u] += rows if s and s[0] % fsdp else 0
    saved = tp_saved(trace, tp, tp_plan) if tp > 1 else _once(trace)
    if param_dtype is not None:   # the units compute in param_dtype
        saved = [b * param_dtype.itemsize // t.dtype.itemsize
                 if t.dtype.is_floating_point and t.dtype.itemsize > param_dtype.itemsize else b
                 for b, t in zip(saved, trace.saved)]
    # the root stays gathered from its forward to the end of the backward, and so does
    # every unit under pp (not resharded after forward)
    units = [_Unit(None if u == "" or pp > 1 else trace.first_op.get(u, 0), gathered[u],
                   frozenset(members[u]), flat[u], flat[u] + padding[u] - gathered[u])
             for u in names]
    if pp == 1:
        return [replay_memory(trace, local, saved, cfg, units, unsharded)]
    stages = [[n] if isinstance(n, str) else list(n) for n in pp_stages]

    out = []
    for s, stage in enumerate(stages):
        mine = {f: n for f, n in local.items() if _within(_module_of(f), stage)}
        # the loss (outside the model) on the last stage
        held = [b if (stage_of(t.module, stages, "a tensor saved for the backward in {where}")
                      if t.module is not None else pp - 1) == s else 0
                for b, t in zip(saved, trace.saved)]
        # a stage holds the saved tensors of the micro-batches whose backward has not run:
        # all of them under GPipe, at most pp - s under 1F1B (each 1/m of the traced batch)
        flight = microbatches if schedule == "gpipe" else min(microbatches, pp - s)
        out.append(replay_memory(trace, mine, held, cfg,
                                 [u for u in units if u.params and u.params <= set(mine)],
                                 unsharded, flight / microbatches, other=s == 0,
                                 accumulate=microbatches > 1))
    return out


def ep_memory(trace, cfg, experts: list, ep: int, fsdp: bool = False) -> list:
    """Each expert-parallel rank's ``Memory`` (``experts``: the expert modules in order, E / ep
    contiguous ones per rank): the non-expert parameters whole (``fsdp``: FSDP2's shards over
    the ep ranks, the root gathered the whole step) and its own experts', the
    tensors saved outside the experts as traced, and its experts' once per source rank
    (each runs on a chunk of tokens from every rank, routed as the traced step), their
    gradients accumulated over the chunks."""
    from .replay import _shard_numel
    per = len(experts) // ep

    def expert_of(name):
        return next((e for e in experts if name is not None and _within(name, [e])), None)
    # outside the experts a storage counts once; an expert's input is its rows of the tokens
    # sorted by expert (one storage in the trace, each rank's received chunks under ep):
    # what an expert saves counts as its own view, once per expert
    seen, saved = set(), []
    for t in trace.saved:
        e = expert_of(t.module)
        key = (t.storage, e)
        saved.append(0 if key in seen else
                     t.nbytes if e is None else math.prod(t.shape) * t.dtype.itemsize)
        seen.add(key)
    dense = [f for f in trace.params if expert_of(_module_of(f)) is None] if fsdp else []
    units, unsharded, shard = [], {}, {}
    if dense:
        # as layout_memory's root unit: gathered the whole step, its reduce-scatter's flat
        # input as large as the gathered parameters, plus padded copies of uneven gradients
        gathered = padding = 0
        for f in dense:
            shape, dtype = trace.params[f]
            shard[f] = _shard_numel(shape, ep)
            unsharded[f] = math.prod(shape) * dtype.itemsize
            gathered += ep * shard[f] * dtype.itemsize
            padding += ep * shard[f] * dtype.itemsize if shape and shape[0] % ep else 0
        units = [_Unit(None, gathered, frozenset(dense), gathered, padding)]
    out = []
    for r in range(ep):
        held = set(experts[r * per:(r + 1) * per])
        local = {f: shard.get(f, math.prod(shape)) for f, (shape, _) in trace.params.items()
                 if expert_of(_module_of(f)) in held | {None}}
        mine = [b * ep if expert_of(t.module) in held else 0 if expert_of(t.module) else b
                for b, t in zip(saved, trace.saved)]
        out.append(replay_memory(trace, local, mine, cfg, units, unsharded, accumulate=True))
    return out
