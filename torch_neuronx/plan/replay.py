"""A traced single-device step replayed under a parallel layout: the ``Replay`` result and
the re-pricing of traced ops at sharded shapes that every layout shares (tensor parallelism:
``replay_tp.py``; FSDP2 and its variants: ``replay_fsdp.py``; pipeline parallelism:
``replay_pp.py``; expert parallelism: ``replay_ep.py``).

``StepTrace.replay_layout(...)`` starts from the ops the cost model charged for a step traced
on one device with ``plan.trace(device, module)`` (each op with the module it ran under) and
gives the modelled step of one rank of the N-rank run. Nothing here prices work by a formula
of its own: a re-priced op is priced by ``cost_model.op_seconds`` (or ``copy_seconds``) at its
sharded shapes, a collective by ``collective_seconds``, the model the ``"neuron"`` backend
charges. What is added is what the real runs issue on the virtual devices (docs/plan.md,
"Replaying a traced step"; tests/plan/test_replay.py checks the sums against real runs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

@dataclass
class Replay:
    """One rank's modelled step under a layout: ``seconds`` = ``device_seconds`` (the traced
    ops, re-priced where sharded, plus the copies the parallelism adds) +
    ``collective_seconds`` - ``overlap_seconds`` (device work on another stream that the
    timeline runs alongside) + ``bubble_seconds`` (pipeline parallelism: the time the rank
    waits for other stages, which its own modelled clock does not count); ``flops`` per
    device; ``ops`` the replayed device ops as (name, module, backward, seconds, flops);
    ``collectives`` as (op, nbytes, group_size, seconds); ``stages`` every pipeline stage's
    Replay (pp only)."""
    layout: str
    seconds: float = 0.0
    device_seconds: float = 0.0
    collective_seconds: float = 0.0
    overlap_seconds: float = 0.0
    bubble_seconds: float = 0.0
    flops: float = 0.0
    ops: list = field(default_factory=list)
    collectives: list = field(default_factory=list)
    stages: list = field(default_factory=list, repr=False)
    profile: object = field(default=None, repr=False)   # the chip it was priced for
    lnc: int = 1
    memory: object = field(default=None, repr=False)    # plan.memory.Memory (None: dp)

    @property
    def breakdown(self) -> dict:
        """The step's terms, which sum to ``seconds``: ``compute`` (the device ops but the
        optimizer's, with the copies the layout adds), ``optimizer``, ``communication`` (the
        collectives less the device work that overlaps them) and ``bubble``."""
        opt = sum(op[3] for op in self.ops if _is_optimizer(op[0]))
        return {"compute": self.device_seconds - opt, "optimizer": opt,
                "communication": self.collective_seconds - self.overlap_seconds,
                "bubble": self.bubble_seconds}

    def tokens_per_second(self, tokens: int) -> float:
        """Throughput when a step processes ``tokens`` tokens in all (every replica's)."""
        return tokens / self.seconds

    def mfu(self, dtype: str = "bfloat16") -> float:
        """This rank's FLOPs over the step time at the logical core's peak for ``dtype``
        (``neuronhw``'s dense TFLOPS), as the planner's estimates count it."""
        return self.flops / (self.seconds * self.profile.peak_flops(dtype, self.lnc))

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
                f"{self.overlap_seconds * 1e3:.4f} ms, bubble "
                f"{self.bubble_seconds * 1e3:.4f} ms), "
                f"{self.flops / 1e9:.3f} GFLOP per device")


def _is_optimizer(name: str) -> bool:
    # torch.optim's foreach and fused paths: one launch over the parameter list, whose work
    # is per parameter element (the shapes the runtime keeps of a list op are truncated).
    return name.startswith("_foreach_") or name.startswith("_fused_")


def _within(module: str, names) -> bool:
    """Whether ``module`` is one of ``names`` or inside one."""
    return any(module == n or module.startswith(n + ".") for n in names)


def _shard_shape(shape, n: int) -> tuple:
    """Rank 0's shard of a parameter (FSDP2: dim 0 in chunks of ceil(dim0 / n) rows; a
    scalar whole)."""
    return (math.ceil(shape[0] / n), *shape[1:]) if shape else tuple(shape)


def _shard_numel(shape, n: int) -> int:
    """Elements of rank 0's shard (``_shard_shape``)."""
    return math.prod(_shard_shape(shape, n))


def _split_shapes(shapes, size: int, n: int):
    return tuple(tuple(d // n if d == size else d for d in s) for s in shapes)


# Ops of several outputs, their elements from the recorded input shapes (the norm over the
# last dim): layer norm's output, mean and rstd; its backward's weight and bias gradients,
# with or without the input's (an input that needs none).
# Flash attention (shapes q, k, v): its output (q's with v's head dim) and the logsumexp
# per query; its backward (shapes grad_out, q, k) the gradients of q, k and v (v shaped as k).
# And ops whose output is no single input's size.
_SEVERAL_OUTPUTS = {
    "native_layer_norm": (lambda s: math.prod(s[0]) + 2 * math.prod(s[0][:-1]),),
    "native_layer_norm_backward": (lambda s: math.prod(s[0]) + 2 * s[0][-1],
                                   lambda s: 2 * s[0][-1]),
    "_scaled_dot_product_flash_attention_for_cpu": (
        lambda s: math.prod(s[0][:-1]) * (s[2][-1] + 1),),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        lambda s: math.prod(s[1]) + 2 * math.prod(s[2]),),
    # a concatenation of the recorded inputs (all of them: at most three)
    "cat": (lambda s: sum(math.prod(x) for x in s),),
    "stack": (lambda s: sum(math.prod(x) for x in s),),
}


# Inputs of an op beyond the three shapes a record keeps, in elements: layer norm backward's
# rstd (shaped as its mean), weight and bias.
_UNRECORDED_INPUTS = {
    "native_layer_norm_backward": lambda s: math.prod(s[2]) + 2 * s[0][-1],
}


def _out_numel(op: str, old_shapes, new_shapes, old_out: int, module: str) -> int:
    """The output elements of ``op`` at ``new_shapes``, from its recorded ``old_out``: a
    matmul's from its dims; an element-wise op's as the input of the same size; a reduction's
    as the dims of its largest input whose product it is (unambiguous, or the only trailing
    dims among the candidates)."""
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
    found = {f(new_shapes) for f in _SEVERAL_OUTPUTS.get(op, ()) if f(old_shapes) == old_out}
    if len(found) == 1:
        return found.pop()
    big = max(range(len(old_shapes)), key=lambda i: math.prod(old_shapes[i]), default=None)
    if big is not None:
        o, s = old_shapes[big], new_shapes[big]
        masks = [mask for mask in range(1 << len(o))
                 if math.prod(o[i] for i in range(len(o)) if mask >> i & 1) == old_out]
        found = {math.prod(s[i] for i in range(len(o)) if mask >> i & 1) for mask in masks}
        if len(found) > 1:
            # a reduction over leading dims (a bias gradient's over tokens) keeps the
            # trailing ones: prefer the one candidate that is a suffix of the dims
            suffix = [m for m in masks if m and (m + (m & -m)) == 1 << len(o)]
            found = {math.prod(s[i] for i in range(len(o)) if m >> i & 1) for m in suffix}
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


def _split_op(o, size: int, n: int, cfg, shapes=None) -> tuple:
    """(seconds, flops) of traced op ``o`` with every dim equal to ``size`` divided by n, or
    at the sharded ``shapes`` when given."""
    c = _local_charge(o, _split_shapes(o.charge.shapes or (), size, n) if shapes is None
                      else shapes, cfg)
    return c.seconds, c.flops


def _priced(o):
    """``o``'s charge, when the cost model priced it from shapes that a layout can shard."""
    c = o.charge
    if c.name == "fused_pointwise":
        # its shapes are (elements, ops): which of its operands are split is lost
        raise ValueError(f"replay: an Adaptive Eager fused kernel ran in sharded module "
                         f"{o.module!r} (or between a column- and a row-parallel Linear); "
                         f"trace with torch_neuronx.set_adaptive_eager(False) to replay it")
    if c.name == "compiled_graph":
        raise ValueError(f"replay: a torch.compile graph ran in module {o.module!r}, which "
                         f"this layout shards or splits into micro-batches; a graph's cost "
                         f"is its own kernels', not re-priced from shapes: trace the step "
                         f"eagerly for this layout (FSDP, HSDP and DP replay compiled blocks)")
    if c.shapes is None:
        raise ValueError(f"replay: {c.name} in sharded module {o.module!r} is not an op the "
                         f"cost model priced from shapes (engine {c.engine}); it cannot be "
                         f"re-priced at sharded shapes")
    return c


def _local_charge(o, new, cfg):
    """Traced op ``o``'s charge (a ``cost_model.OpCharge``) at the sharded shapes ``new``:
    its bytes scaled, re-priced by the cost model."""
    c = _priced(o)
    new = tuple(new)
    if new == c.shapes:
        return c
    old_in = sum(math.prod(s) for s in c.shapes)
    new_in = sum(math.prod(s) for s in new)
    unrecorded = _UNRECORDED_INPUTS.get(c.name)
    if unrecorded and (old_in + unrecorded(c.shapes)) * c.dtype.itemsize * c.count == c.bytes_in:
        # inputs beyond the three shapes the record keeps
        bytes_in = (new_in + unrecorded(new)) * c.dtype.itemsize * c.count
    else:
        bytes_in = c.bytes_in * new_in // old_in if old_in else c.bytes_in
    item = c.dtype.itemsize
    # the record sums its launches' bytes; each launch has the recorded shapes
    per_launch = c.bytes_out // c.count // item
    bytes_out = c.count * _out_numel(c.name, c.shapes, new, per_launch, o.module) * item
    if c.name.startswith("copy_"):   # a DMA copy, priced by its bytes
        from ..cost_model import copy_seconds
        seconds, flops = copy_seconds(cfg[0], cfg[1], c.name, bytes_in, c.count), 0.0
    else:
        seconds, flops = _reprice(c, new, bytes_in, bytes_out, cfg)
    return replace(c, shapes=new, bytes_in=bytes_in, bytes_out=bytes_out, seconds=seconds,
                   flops=flops)


def _optimizer_op(o, sharded, cfg, trace) -> tuple:
    """(seconds, flops) of an optimizer list op over the local parameters
    (``sharded(fqn, shape, numel)``: a parameter's local elements): its bytes scaled by local /
    full bytes of the parameters it runs over. torch.optim issues one list op per parameter
    group and dtype; the op's group is the one (of the optimizer traced with
    ``trace(..., optimizer=)``; else all the parameters as one group) whose leading parameter
    shapes are the op's recorded shapes and whose bytes divide the op's (its state tensors
    are shaped as the parameters)."""
    c = o.charge
    groups = trace.param_groups or [list(trace.params)]
    moved = c.bytes_in + c.bytes_out
    shapes = [tuple(s) for s in c.shapes or ()]
    ratios = set()
    for group in groups:
        for dtype in dict.fromkeys(trace.params[f][1] for f in group):
            # torch.optim's list ops run over the parameters that have a gradient
            fqns = [f for f in group if trace.params[f][1] == dtype
                    and (not trace.grad_bytes or f in trace.grad_bytes)]
            lead = [tuple(trace.params[f][0]) for f in fqns[:len(shapes)]]
            full = sum(math.prod(trace.params[f][0]) for f in fqns) * dtype.itemsize
            # the record keeps the first shapes of its flattened lists: a short group's
            # are followed by its gradients' or states'
            if lead == shapes[:len(lead)] and full and moved % full == 0:
                local = sum(sharded(f, trace.params[f][0], math.prod(trace.params[f][0]))
                            for f in fqns) * dtype.itemsize
                ratios.add(local / full)
    if len(ratios) != 1:
        what = (f"{len(groups)} parameter groups" if trace.param_groups else
                "the parameters as one group (several groups: trace with optimizer=)")
        raise ValueError(f"replay: optimizer op {c.name} over shapes {shapes} moved {moved} "
                         f"bytes, which " + ("matches no" if not ratios else
                                             "matches several differently sharded")
                         + f" parameter group of {what}")
    ratio = ratios.pop()
    if ratio == 1.0:
        return c.seconds, c.flops
    if ratio == 0.0:   # none of the group's parameters is local: the rank issues no op
        return 0.0, 0.0
    return _reprice(c, c.shapes, round(c.bytes_in * ratio), round(c.bytes_out * ratio), cfg)


def _local_bytes(params: dict, sharded) -> tuple:
    """(local, full) parameter bytes, with ``sharded(fqn, shape, numel)`` giving a
    parameter's local elements."""
    local = full = 0
    for fqn, (shape, dtype) in params.items():
        numel = math.prod(shape)
        full += numel * dtype.itemsize
        local += sharded(fqn, shape, numel) * dtype.itemsize
    return local, full


def _root_dim0(trace, n: int, what: str) -> int:
    """Dim 0 of the root's first input, which ``what`` (a degree of ``n``) splits: the
    sequence for sequence parallelism, the batch for pipeline micro-batches."""
    if not trace.root_inputs:
        raise ValueError(f"replay: {what} splits dim 0 of the root's input, and the traced "
                         f"root took no tensor")
    size = trace.root_inputs[0][0][0]
    if size % n:
        raise ValueError(f"replay: {what}={n} does not divide dim 0 ({size}) of the root's "
                         f"input {trace.root_inputs[0][0]}")
    return size
