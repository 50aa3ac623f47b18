"""One step traced on one device: what the device's cost model charged for it, and the
collectives it issued.

``with plan.trace() as t: step()`` records the modelled time, FLOPs, HBM bytes and launches
of the work the step ran (``torch_neuronx.modelled_time``) and every collective the
``"neuron"`` backend charged (op, bytes, group size). ``t.replay(group_size)`` is the what-if
of the same step with each collective's group resized: the device work as traced, the
collectives re-priced by the backend's collective model. A data-parallel step traced on one
rank thus predicts the step on N ranks (tests/plan checks it against a real 2-rank run).

``with plan.trace(device, model) as t: step()`` also keeps each op the cost model charged
with the submodule of ``model`` it ran under (``t.ops``), and ``t.replay_layout(fsdp=N, ...)``
/ ``t.replay_layout(tp=N, ...)`` / ``t.replay_layout(pp=N, ...)`` / ``t.replay_layout(ep=N, ...)`` replays a single-device step
under FSDP2, tensor, pipeline or expert parallelism (``plan/replay*.py``; tests/plan/test_replay.py checks it against real runs).
Blocks compiled one by one (``torch.compile(block)``) have their graphs charged to them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class TracedOp:
    """One op signature as the cost model charged it during the traced step (``charge``: a
    ``cost_model.OpCharge``), and the module it ran under: the innermost module's name
    relative to the traced root ("" for the root, None outside it, e.g. a loss computed
    after the root's forward; None for every op when no module was traced), and whether it
    ran in the backward pass."""
    charge: object
    module: str | None = None
    backward: bool = False


class SavedTensor(NamedTuple):
    """A tensor autograd saved for the backward in the traced step: its storage's bytes, its
    shape and dtype, the module it was saved under, the number of ops charged before it, and
    its storage (several ops may save one storage; a saved storage lives until the backward,
    so no other saved tensor reuses its address in the step)."""
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    module: str | None
    at: int
    storage: int


@dataclass
class StepTrace:
    seconds: float = 0.0
    flops: float = 0.0
    hbm_bytes: int = 0
    launches: int = 0
    link_bytes: int = 0
    collectives: list = field(default_factory=list)   # (op, nbytes, group_size, nodes, seconds)
    ops: list = field(default_factory=list)           # TracedOp, in the order they were charged
    # Of the traced module (``trace(device, module)``): parameter fqn -> (shape, dtype),
    # nn.Linear fqn -> (in_features, out_features), every submodule's name, and how many
    # times each ran forward in the step.
    params: dict = field(default_factory=dict)
    linears: dict = field(default_factory=dict)
    modules: list = field(default_factory=list)
    forward_calls: dict = field(default_factory=dict)   # submodule name -> forward calls
    root_inputs: list = field(default_factory=list)     # (shape, dtype) of the root's tensor args
    # submodule name -> [(shape, dtype)] of the tensors its first forward call returned
    module_outputs: dict = field(default_factory=dict)
    # Memory (``trace(device, module)``): the allocator's bytes at the start and its peak in
    # the step; every tensor autograd saved for the backward (``SavedTensor``; not the
    # parameters' nor the root's inputs); per parameter fqn its gradient's bytes (at the end of the step,
    # and at the first backward boundary: gradients kept through the forward) and its
    # optimizer state's (``trace(..., optimizer=)``); each submodule's number of ops charged
    # before its first forward.
    memory_start: int = 0
    memory_peak: int = 0
    saved: list = field(default_factory=list)
    grad_bytes: dict = field(default_factory=dict)
    kept_grads: dict = field(default_factory=dict)
    optimizer_bytes: dict = field(default_factory=dict)
    first_op: dict = field(default_factory=dict)
    # ``trace(..., optimizer=)``: the parameter fqns of each of its parameter groups (the
    # replays shard each group's list ops by that group's parameters); None: not traced
    param_groups: list | None = None

    @classmethod
    def from_profile(cls, path, device: int = 0) -> "StepTrace":
        """The step a ``NeuronProfiler`` export holds (``path``: its ``trace_<n>`` Parquet
        directory), as device ``device``'s hardware rows give it: modelled seconds, FLOPs,
        HBM and link bytes, and every collective with its group. Profile exactly one step,
        with ``activities=[CPU, PrivateUse1]`` (the Kineto plugin's rows carry what the cost
        model charged; the cost model's intervals, without it, do not). The trace has no
        modules: ``replay(N)`` / ``replay_layout(dp=N)`` re-price its collectives, as for
        ``plan.trace()``; the sharded layouts need ``plan.trace(device, module)``."""
        import os

        import pyarrow.parquet as pq
        meta = dict(zip(*pq.read_table(os.path.join(path, "Metadata.parquet"))
                        .to_pydict().values()))
        if meta.get("hardware_source") != "kineto":
            raise ValueError(f"StepTrace.from_profile: {path} was profiled without the Kineto "
                             f"plugin (hardware_source={meta.get('hardware_source')!r}); "
                             f"profile the step with activities=[ProfilerActivity.CPU, "
                             f"ProfilerActivity.PrivateUse1]")
        version = tuple(int(v) for v in meta.get("profile_schema_version", "0").split(".")[:2])
        if version < (1, 7):
            raise ValueError(f"StepTrace.from_profile: {path} has schema "
                             f"{meta.get('profile_schema_version')}; collectives' groups are "
                             f"recorded from 1.7.0 on: profile the step again")
        ev = pq.read_table(os.path.join(path, "SystemProfileEvents.parquet"),
                           filters=[("source", "==", "hardware"), ("device", "==", device)],
                           columns=["name", "engine", "modelled_ns", "flops", "hbm_bytes",
                                    "link_bytes", "group_size", "nodes", "launches"]).to_pydict()
        if not ev["name"]:
            raise ValueError(f"StepTrace.from_profile: {path} has no hardware events of "
                             f"device {device} (capture_enabled_for_nc left it out?)")
        out = cls()
        for name, engine, ns, flops, hbm, link, group, nodes, launches in zip(*ev.values()):
            out.seconds += ns * 1e-9
            out.flops += flops
            # the modelled totals count no HBM traffic for copies (the profile's rows do for
            # a device-to-device copy)
            out.hbm_bytes += hbm if engine != "dma" else 0
            out.link_bytes += link
            out.launches += launches
            if engine == "collective":
                out.collectives.append((name.split("::", 1)[-1], link, group, nodes, ns * 1e-9))
        return out

    def replay(self, group_size: int, nodes: int = 1, profile=None, lnc: int | None = None) -> float:
        """Modelled seconds of the traced step with its collectives over ``group_size`` ranks
        on ``nodes`` nodes (the traced chip and LNC unless given)."""
        from .. import _state
        from ..distributed.collectives_model import collective_seconds
        cfg = _state.config()
        profile = _chip(profile) or cfg.profile
        lnc = lnc or cfg.lnc
        traced = sum(c[4] for c in self.collectives)
        resized = sum(collective_seconds(op, nbytes, group_size, nodes, profile, lnc)
                      for op, nbytes, _, _, _ in self.collectives)
        return self.seconds - traced + resized

    def replay_layout(self, *, fsdp: int = 1, fsdp_units=None, replicate: int = 1,
                      mp_policy=None, tp: int = 1, tp_plan=None, dp: int = 1, pp: int = 1,
                      pp_stages=None, schedule: str = "gpipe", microbatches: int = 1,
                      ep: int = 1, ep_experts=None, nodes: int = 1, profile=None, lnc: int | None = None):
        """One rank's modelled step (a ``plan.replay.Replay``) when the traced step runs under
        FSDP2 over ``fsdp`` ranks (``fully_shard`` on each module named in ``fsdp_units``,
        "" for the root), tensor parallelism over ``tp`` ranks (``tp_plan``: Linear module
        name -> "colwise" | "rowwise", as ``parallelize_module``'s plan, or a norm's name ->
        "sequence" for TorchTitan's sequence parallelism), or data parallelism
        over ``dp`` ranks, on ``nodes`` nodes. ``replicate=R`` with ``fsdp=S`` is HSDP
        (``fully_shard`` over a (R, S) mesh: sharded over S, replicated over R; R x S ranks);
        ``fsdp=N`` with ``tp=T`` is 2-D FSDP x TP on a (N, T) mesh (N x T ranks), with
        ``replicate=R`` too 3-D on a (R, N, T) mesh; ``replicate=R`` with fsdp=1 is FSDP2
        over a (R, 1) mesh (data parallelism as FSDP2 spells it), with or without tp;
        ``mp_policy`` is FSDP2's ``MixedPrecisionPolicy`` (param_dtype, reduce_dtype) with
        fsdp. ``pp`` is torch.distributed.pipelining with one stage per rank (``pp_stages``:
        the module names of each stage), ``schedule`` "gpipe" or "1f1b" over
        ``microbatches``, with ``tp`` TP or ``fsdp`` FSDP2 (on ``fsdp_units``, not resharded
        after forward) inside each stage. ``ep`` is expert parallelism (``ep_experts``: the expert modules'
        names, a list or a glob such as "experts.*"; the per-rank Replays in ``.stages``,
        returned the slowest). fsdp and tp replay a single-device step traced with ``trace(device, module)``; dp a
        DDP step traced on one rank (its collectives re-priced, as ``replay``). Other
        combinations are refused; docs/plan.md says what is charged."""
        from .. import _state
        from .replay import Replay
        from .replay_tp import replay_tp
        from .replay_fsdp import replay_fsdp
        for name, degree in (("fsdp", fsdp), ("replicate", replicate), ("tp", tp), ("dp", dp),
                             ("pp", pp), ("ep", ep), ("microbatches", microbatches)):
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"replay_layout: {name}={degree!r} must be a positive int")
        degrees = {k: v for k, v in (("fsdp", fsdp), ("replicate", replicate), ("tp", tp),
                                     ("dp", dp), ("pp", pp), ("ep", ep)) if v > 1}
        if set(degrees) == {"replicate"} and fsdp_units is None:
            raise ValueError(f"replay_layout: replicate={replicate} is HSDP's replica degree: "
                             "with fsdp_units it is FSDP2 over a (replicate, 1) mesh; for "
                             "DDP use dp")
        if len(degrees) > 1 and set(degrees) not in ({"fsdp", "replicate"}, {"fsdp", "tp"},
                                                     {"fsdp", "replicate", "tp"},
                                                     {"replicate", "tp"}, {"pp", "tp"},
                                                     {"pp", "fsdp"}, {"pp", "fsdp", "tp"},
                                                     {"pp", "replicate"},
                                                     {"pp", "replicate", "tp"},
                                                     {"pp", "fsdp", "replicate"},
                                                     {"pp", "fsdp", "replicate", "tp"},
                                                     {"ep", "fsdp"}):
            several = " with ".join(f"{k}={v}" for k, v in degrees.items())
            raise ValueError(f"replay_layout: {several} is not replayed yet; replayed: fsdp, "
                             "tp, dp, pp or ep alone, replicate (with fsdp: HSDP), fsdp or "
                             "HSDP with pp, each with or without tp, and ep with fsdp")
        if mp_policy is not None and fsdp == 1 and replicate == 1:
            raise ValueError("replay_layout: mp_policy is FSDP2's MixedPrecisionPolicy and "
                             "needs fsdp > 1")
        cfg = _state.config()
        cfg = (_chip(profile) or cfg.profile, lnc or cfg.lnc)
        if dp > 1:
            if not self.collectives:
                raise ValueError(f"replay_layout: dp={dp} re-prices the traced step's "
                                 "data-parallel collectives, and it issued none; trace the "
                                 "step under DDP on one rank")
            out = Replay(f"dp={dp}")
            out.device_seconds = self.seconds - sum(c[4] for c in self.collectives)
            out.flops = self.flops
            from ..distributed.collectives_model import collective_seconds
            for op, nbytes, _, _, _ in self.collectives:
                out._collective(op, nbytes, dp, collective_seconds(op, nbytes, dp, nodes, *cfg))
            out.seconds = out.device_seconds + out.collective_seconds
            out.profile, out.lnc = cfg
            return out
        if not self.modules:
            raise ValueError("replay_layout: the step was traced without its module; trace "
                             "it with plan.trace(device, module)")
        if ep > 1:
            from .replay_ep import replay_ep
            out = replay_ep(self, ep, ep_experts, cfg, nodes, fsdp, fsdp_units)
        elif pp > 1:
            from .replay_pp import replay_pp
            out = replay_pp(self, pp, pp_stages, schedule, microbatches, cfg, nodes, tp,
                            tp_plan, fsdp, fsdp_units, replicate)
        elif tp > 1 and fsdp == 1 and replicate == 1:
            out = replay_tp(self, tp, tp_plan, cfg, nodes)
        else:
            out = replay_fsdp(self, fsdp, fsdp_units, cfg, nodes, replicate, tp, tp_plan,
                              mp_policy)
        for r in out.stages or [out]:
            r.profile, r.lnc = cfg
        from .memory import ep_memory, layout_memory
        if ep > 1:
            from .replay_ep import _experts
            mems = ep_memory(self, cfg, _experts(self, ep, ep_experts), ep,
                             fsdp > 1)
        else:
            mems = layout_memory(self, cfg, fsdp=fsdp, fsdp_units=fsdp_units,
                                 replicate=replicate, tp=tp, tp_plan=tp_plan, pp=pp,
                                 pp_stages=pp_stages, schedule=schedule,
                                 microbatches=microbatches, mp_policy=mp_policy)
        for r, m in zip(out.stages or [out], mems):
            r.memory = m
        return out


    def sweep(self, devices: int, tokens: int, *, tp_plan=None, fsdp_units=None,
              pp_blocks=None, ep_experts=None, nodes: int = 1, profile=None,
              lnc: int | None = None) -> list:
        """The layouts of ``devices`` devices that the plans allow (tp with ``tp_plan``,
        FSDP2 / HSDP / replicas with ``fsdp_units``, 1F1B pp with ``pp_blocks``, the blocks
        split evenly into stages, ep over every device with ``ep_experts``), each replayed
        (``replay_layout``) and ranked: fitting
        first, by tokens/s over the devices (``tokens``: the traced step's), refused ones
        last with the reason (``plan.replay_sweep.Ranked``)."""
        from .replay_sweep import sweep
        return sweep(self, devices, tokens, tp_plan=tp_plan, fsdp_units=fsdp_units,
                     pp_blocks=pp_blocks, ep_experts=ep_experts, nodes=nodes,
                     profile=profile, lnc=lnc)


def _chip(profile):
    """A chip profile given as ``neuronhw``'s ChipProfile or its name ("trn2"); None: the
    device's."""
    import neuronhw
    if profile is None or isinstance(profile, neuronhw.ChipProfile):
        return profile
    if isinstance(profile, str):
        return neuronhw.get_profile(profile)
    raise ValueError(f"replay: profile={profile!r} is neither a neuronhw.ChipProfile (such as "
                     f"neuronhw.TRN2) nor a chip name (trn1, trn2, trn3)")


def _tracker(flush, moved, root, calls: dict, root_inputs: list, outputs: dict, first=None):
    """A ModTracker that charges the device's work to the modules it ran under: the runtime
    aggregates op records between drains, so each module boundary first drains (``flush``),
    then notes the new set of active modules (``moved``); ``calls`` counts each module's
    forward calls, ``outputs`` keeps what each returned first (a pipeline stage sends it),
    ``first(mod, inputs)`` is called at a module's first forward, after the drain."""
    from torch.distributed._tools.mod_tracker import ModTracker

    class _Tracker(ModTracker):
        def _fw_pre_hook(self, mod, input):
            if _inside_compiled():
                return None
            calls[mod] = calls.get(mod, 0) + 1
            if mod is root and calls[mod] == 1:
                root_inputs.extend((tuple(a.shape), a.dtype) for a in input
                                   if isinstance(a, torch.Tensor))
            with _eager_call():
                out = super()._fw_pre_hook(mod, input)
            if first is not None and calls[mod] == 1:
                first(mod, input)
            return out

        def _fw_post_hook(self, mod, input, output):
            if _inside_compiled():
                return None
            if mod not in outputs:
                leaves = torch.utils._pytree.tree_leaves(output)
                outputs[mod] = [(tuple(a.shape), a.dtype) for a in leaves
                                if isinstance(a, torch.Tensor)]
            with _eager_call():
                return super()._fw_post_hook(mod, input, output)

        def _get_append_fn(self, w_mod, name, is_bw):
            return _around(super()._get_append_fn(w_mod, name, is_bw))

        def _get_pop_fn(self, w_mod, name, is_bw):
            return _around(super()._get_pop_fn(w_mod, name, is_bw))

    def _around(inner):
        def fn(*args):
            flush()
            out = inner(*args)
            moved()
            return out
        return fn

    t = _Tracker()
    t._get_mod_name(root)   # names every submodule "<RootType>.<fqn>" up front
    return t


def _inside_compiled() -> bool:
    # A module called inside a compiled region (its hook traced by Dynamo, so it never runs):
    # its work is the compiled graph's, charged to the nearest module called eagerly.
    return torch.compiler.is_compiling()


@contextlib.contextmanager
def _eager_call():
    """ModTracker skips every hook under ``torch.compile(module)``'s wrapper, the wrapper's
    own included; but the wrapper's hooks run eagerly around its compiled graphs
    (TorchTitan's per-block compile), so they are module boundaries like any other: the
    compiled block's forward and backward graphs are charged to it."""
    frame = torch._dynamo.eval_frame
    was = frame._in_optimized_module
    frame._in_optimized_module = False
    try:
        yield
    finally:
        frame._in_optimized_module = was


def _innermost(parents, root_name: str):
    """The name (relative to the root, "" for the root itself) of the deepest active module,
    or None outside the root (a loss computed after its forward, say)."""
    names = [p for p in parents if p == root_name or p.startswith(root_name + ".")]
    if not names:
        return None
    deepest = max(names, key=lambda n: n.count("."))
    return deepest[len(root_name) + 1:] if deepest != root_name else ""


def _plain(t) -> bool:
    """A tensor with storage of its own (not a DTensor or another wrapper subclass, whose
    memory is its local tensor's)."""
    return isinstance(t, torch.Tensor) and (type(t) in (torch.Tensor, torch.nn.Parameter))


def _tensor_bytes(tensors, dev) -> int:
    """Bytes of the distinct storages of ``tensors`` (None skipped) on device ``dev``."""
    seen = {}
    for t in tensors:
        if _plain(t) and t.device == dev:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def trace(device=None, module: torch.nn.Module | None = None, optimizer=None):
    """Trace one step on ``device``: totals, collectives, every op the cost model charged
    (``StepTrace.ops``), and the allocator's bytes at the start and its peak in the step
    (the device's peak statistic is reset when the trace starts). With ``module``, each op
    also names the innermost submodule of ``module`` it ran under, forward or backward (the
    op records are drained at every module boundary; the device is not waited for, so the
    step and its time are unchanged), and the step's memory is recorded: the tensors
    autograd saves for the backward (seen by a ``saved_tensors_hooks`` pair that keeps
    them as they are; autograd re-attaches their history, so a double backward is
    unchanged), the gradients, and with ``optimizer``
    (a ``torch.optim.Optimizer`` over the module's parameters) its per-parameter state,
    which the memory replay then shards with the parameters."""
    from .. import cost_model
    from ..cost_model import modelled_time
    from ..distributed import collectives_model
    from ..neuron import _index
    idx = _index(device)
    dev = torch.device("neuron", idx)
    torch.neuron.synchronize(device)
    modelled_time(device, reset=True)
    out = StepTrace()
    out.memory_start = torch.neuron.memory_allocated(dev)
    torch.neuron.reset_peak_memory_stats(dev)
    # the module (None: outside the traced module) and backward flag that the device's
    # pending work is charged to: the state after the last module boundary
    where = [None, False]

    def on_collective(dev, op, nbytes, size, nodes, seconds):
        if dev == idx:
            out.collectives.append((op, nbytes, size, nodes, seconds))

    def on_op(charge):
        if charge.device == idx:
            out.ops.append(TracedOp(charge, where[0], where[1]))

    tracker = None
    if module is not None:
        root_name = type(module).__name__

        def flush():
            # ops are recorded when launched, on this thread: no need to wait for the device
            # (a wait would start a timeline epoch and close fusion windows, changing the
            # step); a fusion window open at the boundary is recorded when it closes.
            cost_model._drain()

        calls, outputs, bw_seen = {}, {}, []
        names = {m: n for n, m in module.named_modules()}
        named = dict(module.named_parameters())
        # storages autograd saves that are not activations: parameters, the root's inputs
        skip = {p.untyped_storage().data_ptr() for p in named.values() if _plain(p)}

        def first(mod, inputs):
            out.first_op[names.get(mod)] = len(out.ops)
            if mod is module:
                skip.update(a.untyped_storage().data_ptr() for a in inputs if _plain(a))

        def moved():
            where[0] = _innermost(tracker.parents, root_name)
            if tracker.is_bw and not bw_seen:   # the first backward boundary
                bw_seen.append(True)
                out.kept_grads = {n: _tensor_bytes([p.grad], dev) for n, p in named.items()
                                  if p.grad is not None}
            where[1] = tracker.is_bw

        def pack(x):
            if _plain(x) and x.device == dev:
                st = x.untyped_storage()
                if st.data_ptr() not in skip:
                    out.saved.append(SavedTensor(st.nbytes(), tuple(x.shape), x.dtype,
                                                 where[0], len(out.ops), st.data_ptr()))
            # the hooks' contract: what pack returns must not hold the tensor itself (a
            # reference cycle through an output's grad_fn)
            return x.detach()

        tracker = _tracker(flush, moved, module, calls, out.root_inputs, outputs, first)
        out.params = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters()}
        out.linears = {n: (m.in_features, m.out_features) for n, m in module.named_modules()
                       if isinstance(m, torch.nn.Linear)}
        out.modules = [n for n, _ in module.named_modules()]
    collectives_model.listeners.append(on_collective)
    cost_model._op_listeners.append(on_op)
    try:
        if tracker is not None:
            with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                yield out
                torch.neuron.synchronize(device)
                cost_model._drain()
        else:
            yield out
            torch.neuron.synchronize(device)
        t = modelled_time(device, reset=True)   # drains the rest while on_op still listens
    finally:
        collectives_model.listeners.remove(on_collective)
        cost_model._op_listeners.remove(on_op)
    out.memory_peak = torch.neuron.max_memory_allocated(dev)
    if module is not None:
        out.grad_bytes = {n: _tensor_bytes([p.grad], dev) for n, p in named.items()
                          if p.grad is not None}
        if optimizer is not None:
            by_param = {p: n for n, p in named.items()}
            out.param_groups = []
            for group in optimizer.param_groups:
                out.param_groups.append([])
                for p in group["params"]:
                    if p not in by_param:
                        raise ValueError("plan.trace: the optimizer steps a parameter that is "
                                         "not the traced module's")
                    out.param_groups[-1].append(by_param[p])
                    out.optimizer_bytes[by_param[p]] = _tensor_bytes(
                        optimizer.state.get(p, {}).values(), dev)
        out.forward_calls = {n: calls.get(m, 0) for n, m in module.named_modules()}
        out.module_outputs = {n: outputs[m] for n, m in module.named_modules() if m in outputs}
    out.seconds, out.flops, out.hbm_bytes, out.launches, out.link_bytes = (
        t.seconds, t.flops, t.hbm_bytes, t.launches, t.link_bytes)
