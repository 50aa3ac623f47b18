"""``ProcessGroupNeuron``: the "neuron" c10d backend.

Transport: gloo over TCP, so a job spans machines exactly as a CPU job does. Device memory
is host memory, so gloo reads and writes the neuron tensors in place through zero-copy CPU
aliases (a CPU storage over the device allocation); nothing is staged or copied for a
contiguous tensor.

Why a ``ProcessGroup`` subclass and not a ``Backend``: the C++ ``c10d::Backend`` cannot be
subclassed from Python, while ``dist.ProcessGroup`` has a pybind trampoline. A Python process
group replaces the whole group (c10d stops dispatching per device), so this one serves both
neuron and CPU tensors.

Ordering (stream semantics): the device executes every op in issue order on the host, so by
the time a collective is issued, the work that produced its inputs has finished; the
collective's outputs are complete when its work's ``wait()`` (or its future) returns, and
``wait()`` orders later device work after it. This is what a CUDA collective gives after
``work.wait()`` makes the current stream wait on the communication stream.

Safety: arguments are checked first (``checks``), then every rank agrees on its call with
its peers (``agreement``), so mistakes give clear errors instead of hangs. The CPU tensors
gloo works on are in ``staging``; the ``dist.Work`` objects in ``work``.
"""
from __future__ import annotations

import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from . import checks, collectives_model
from .agreement import PeerAgreement
from .staging import HostTensors
from .work import CombinedWork, NeuronWork

ReduceOp = dist.ReduceOp
_RED = ReduceOp.RedOpType
_SUM, _AVG, _PREMUL_SUM = int(_RED.SUM), int(_RED.AVG), int(_RED.PREMUL_SUM)
_BITWISE = {int(_RED.BAND), int(_RED.BOR), int(_RED.BXOR)}
_GLOO_REDUCTIONS = {int(_RED.PRODUCT), int(_RED.MIN), int(_RED.MAX)} | _BITWISE

# dtypes gloo reduces (and moves); other dtypes are moved as bytes and cannot be reduced.
_GLOO_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                torch.uint8, torch.int32, torch.int64, torch.bool}
_RED_NAMES = {int(k): str(k).rsplit(".", 1)[-1] for k in _RED.__members__.values()}
# NCCL reduces complex tensors as their real views, for the ops where that is exact.
_COMPLEX_REDUCTIONS = {_SUM, _AVG, _PREMUL_SUM}
# NCCL reduces bool as uint8 and maps SUM to MAX (a logical or); PRODUCT is then a logical and.
_BOOL_REDUCTIONS = {_SUM: int(_RED.MAX), int(_RED.PRODUCT): int(_RED.MIN)}


def _real(h: torch.Tensor) -> torch.Tensor:
    """The host tensor gloo reduces: complex as its real view (pairs of reals)."""
    return torch.view_as_real(h) if h.is_complex() else h


def _red_kind(op) -> int:
    return int(getattr(op, "op", op))


def _red_name(op) -> str:
    return _RED_NAMES[_red_kind(op)]


_ADD_TIME = None


def _add_time():
    """``cost_model._add_time`` (imported on first use: the cost model imports the runtime)."""
    global _ADD_TIME
    if _ADD_TIME is None:
        from ..cost_model import _add_time as add
        _ADD_TIME = add
    return _ADD_TIME


class ProcessGroupNeuron(dist.ProcessGroup):
    """c10d process group of the "neuron" backend: gloo on zero-copy aliases of device memory."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, global_ranks=None,
                 group_name: str = ""):
        super().__init__(rank, size)
        if timeout is None or timeout.total_seconds() <= 0:
            timeout = timedelta(minutes=30)
        self._timeout = timeout
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._group_name = group_name or ""
        self._group_desc = ""
        self._global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self._device_index = torch.neuron.current_device()
        self._agreement = PeerAgreement(self)
        # how this group agrees before each collective: "off", "shm" or "gloo"
        self.check_transport = self._agreement.transport
        self._coalesced = None
        self._nodes = self._count_nodes()
        self._modelled = {}   # (op, bytes) -> modelled seconds

    # --- identity -------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "neuron"

    def name(self) -> str:
        return "neuron"

    def _get_backend_name(self) -> str:
        return "neuron"

    # torch.distributed asks a group for its per-device backend object
    # (`init_process_group(device_id=...)`, DeviceMesh, FSDP2); this group is that object for
    # both device types it serves, and answers as a backend without communicator splitting
    # or its own tensor allocator does.
    supports_splitting = False

    def _get_backend(self, device) -> "ProcessGroupNeuron":
        kind = torch.device(device).type
        if kind not in ("neuron", "cpu"):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    def supports_tensor_alloc(self, device) -> bool:
        return False

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._gloo.set_timeout(timeout)

    def _set_default_timeout(self, timeout: timedelta) -> None:
        self.set_timeout(timeout)

    @property
    def options(self):
        return self._gloo.options

    def _count_nodes(self) -> int:
        # torchrun numbers ranks node by node, LOCAL_WORLD_SIZE per node.
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if not local or int(local) <= 0:
            return 1
        return len({r // int(local) for r in self._global_ranks})

    def __repr__(self):
        return (f"ProcessGroupNeuron(rank={self.rank()}, size={self.size()}, "
                f"name={self._group_name!r}, device=neuron:{self._device_index})")

    # --- helpers --------------------------------------------------------------------------
    def _model(self, kind: str, op: str, nbytes: int) -> None:
        if kind != "neuron":
            return
        cached = self._modelled.get((op, nbytes))
        if cached is None:
            from .. import _state
            cfg = _state.config()   # read once per process: the cached times stay valid
            seconds = collectives_model.collective_seconds(op, nbytes, self.size(), self._nodes,
                                                           cfg.profile, cfg.lnc)
            cached = (f"c10d::{op}", seconds)
            if len(self._modelled) < 4096:
                self._modelled[(op, nbytes)] = cached
        _add_time()(self._device_index, cached[0], cached[1], engine="collective",
                    link_bytes=nbytes, group_size=self.size(), nodes=self._nodes)
        for listen in collectives_model.listeners:
            listen(self._device_index, op, nbytes, self.size(), self._nodes, cached[1])

    def _work(self, op: str, works: list, result: list, host: HostTensors) -> NeuronWork:
        w = NeuronWork(self, op, works, result, host)
        if self._coalesced is not None:
            self._coalesced.append(w)
        return w

    def _reduce_setup(self, op: str, red, dtype: torch.dtype, host: HostTensors, inputs: list,
                      outputs: list, inputs_are_outputs: bool):
        """Map ``red`` to an op gloo has (AVG -> SUM then divide, PREMUL_SUM -> scale then
        SUM), rewriting ``inputs`` (host tensors) when they must be scaled. Complex tensors
        reduce as their real views (the callers view them with ``_real``), as NCCL does."""
        kind = _red_kind(red)
        if dtype.is_complex:
            if kind not in _COMPLEX_REDUCTIONS:
                raise ValueError(f"neuron backend: {op} does not support {_red_name(kind)} on "
                                 f"complex tensors (SUM, AVG and PREMUL_SUM are supported)")
        elif dtype not in _GLOO_DTYPES:
            raise TypeError(f"neuron backend: {op} cannot reduce dtype {dtype}; reduce in "
                            "float32/bfloat16/float16/float64, complex or an integer dtype")
        if dtype == torch.bool:
            if kind == _AVG:
                raise TypeError(f"neuron backend: {op} cannot use ReduceOp.AVG with boolean inputs")
            kind = _BOOL_REDUCTIONS.get(kind, kind)
        if kind == _SUM:
            return ReduceOp.SUM, inputs
        if kind == _AVG:
            size = self.size()
            for o in outputs:
                if o.is_floating_point() or o.is_complex():
                    host.fixups.append(lambda o=o: o.div_(size))
                else:
                    host.fixups.append(lambda o=o: o.div_(size, rounding_mode="trunc"))
            return ReduceOp.SUM, inputs
        if kind == _PREMUL_SUM:
            factor = red.factor
            if isinstance(factor, torch.Tensor):
                factor = factor.to("cpu")
            if inputs_are_outputs:
                for i in inputs:
                    i.mul_(factor)
                return ReduceOp.SUM, inputs
            return ReduceOp.SUM, [i * factor for i in inputs]
        if kind in _GLOO_REDUCTIONS:
            if kind in _BITWISE and dtype.is_floating_point:
                raise TypeError(f"neuron backend: {op} with {_red_name(kind)} needs an integer or "
                                f"bool tensor, got {dtype}")
            return ReduceOp(_RED(kind)), inputs
        raise ValueError(f"neuron backend: {op} does not support reduce op {red}")

    @staticmethod
    def _opts(cls, opts, **fields):
        new = cls()
        if opts is not None and hasattr(opts, "timeout"):
            new.timeout = opts.timeout
        for k, v in fields.items():
            setattr(new, k, v)
        return new

    # --- collectives ----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = _c10d.AllreduceOptions()
        elif isinstance(opts, (ReduceOp, _RED)):
            opts = self._opts(_c10d.AllreduceOptions, None, reduceOp=ReduceOp(opts) if isinstance(opts, _RED) else opts)
        kind = checks.tensors(self, "all_reduce", tensors)
        red = opts.reduceOp
        red_kind = _red_kind(red)
        # host views first: a rank that waits in the agreement issues right after it returns
        host = HostTensors()
        hs = [host.get(t, write=True) for t in tensors]
        self._agreement.verify("all_reduce", ",".join(checks.count(t) for t in tensors) + "|"
                     + _RED_NAMES[red_kind])
        gred, hs = self._reduce_setup("all_reduce", red, tensors[0].dtype, host, hs, hs, True)
        hs = [_real(h) for h in hs]
        if _red_kind(gred) != red_kind:
            opts = self._opts(_c10d.AllreduceOptions, opts, reduceOp=gred)
        works = [self._gloo.allreduce([h], opts) for h in hs]
        self._model(kind, "all_reduce", sum(t.nbytes for t in tensors))
        return self._work("all_reduce", works, list(tensors), host)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.AllreduceCoalescedOptions()
        o = self._opts(_c10d.AllreduceOptions, opts, reduceOp=opts.reduceOp)
        return self.allreduce(list(tensors), o)

    def broadcast(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None or isinstance(opts, int):
            root = 0 if opts is None else opts
            opts = _c10d.BroadcastOptions()
            opts.rootRank = root
        kind = checks.tensors(self, "broadcast", tensors)
        checks.root(self, "broadcast", opts.rootRank)
        self._agreement.verify("broadcast", ",".join(checks.count(t) for t in tensors) + f"|root={opts.rootRank}")
        host = HostTensors()
        raw = any(t.dtype not in _GLOO_DTYPES for t in tensors)
        hs = [host.get(t, write=True, as_bytes=raw) for t in tensors]
        works = [self._gloo.broadcast([h], self._opts(_c10d.BroadcastOptions, opts, rootRank=opts.rootRank))
                 for h in hs]
        self._model(kind, "broadcast", sum(t.nbytes for t in tensors))
        return self._work("broadcast", works, list(tensors), host)

    def reduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else _c10d.ReduceOptions()
        kind = checks.tensors(self, "reduce", tensors)
        checks.root(self, "reduce", opts.rootRank)
        self._agreement.verify("reduce", ",".join(checks.count(t) for t in tensors)
                     + f"|{_red_name(opts.reduceOp)}|root={opts.rootRank}")
        host = HostTensors()
        hs = [host.get(t, write=True) for t in tensors]
        outs = hs if self.rank() == opts.rootRank else []
        gred, hs = self._reduce_setup("reduce", opts.reduceOp, tensors[0].dtype, host, hs, outs, True)
        hs = [_real(h) for h in hs]
        works = [self._gloo.reduce([h], self._opts(_c10d.ReduceOptions, opts, reduceOp=gred,
                                                    rootRank=opts.rootRank)) for h in hs]
        self._model(kind, "reduce", sum(t.nbytes for t in tensors))
        return self._work("reduce", works, list(tensors), host)

    def allgather(self, output_lists, inputs, opts=None):
        # NCCL's forms: every output the same shape, each holding input.numel() elements (any
        # shape); or uneven, output i holding rank i's input (a vector all-gather).
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        flat_out = [t for lst in output_lists for t in lst]
        kind = checks.tensors(self, "all_gather", list(inputs) + flat_out)
        for lst, inp in zip(output_lists, inputs):
            checks.list_len(self, "all_gather", lst)
            checks.same_dtype("all_gather", lst, inp)
            if lst[self.rank()].numel() != inp.numel():
                raise ValueError(
                    f"neuron backend: all_gather output {self.rank()} {checks.describe(lst[self.rank()])} "
                    f"must hold this rank's input {checks.describe(inp)} (as many elements)")
        self._agreement.verify("all_gather", ";".join(
            ",".join(checks.count(o) for o in lst) for lst in output_lists))
        host = HostTensors()
        raw = any(t.dtype not in _GLOO_DTYPES for t in inputs)
        works = []
        for lst, inp in zip(output_lists, inputs):
            h_in = host.get(inp, write=False, as_bytes=raw).reshape(-1)
            h_out = [host.get(o, write=True, as_bytes=raw).reshape(-1) for o in lst]
            sizes = [h.numel() for h in h_out]
            m = max(sizes)
            if all(n == m for n in sizes):
                works.append(self._gloo.allgather([h_out], [h_in], self._opts(_c10d.AllgatherOptions, opts)))
                continue
            # uneven: gather padded rows, then each rank's part lands in its output
            padded = torch.zeros(m, dtype=h_in.dtype)
            padded[:h_in.numel()] = h_in
            buf = torch.empty(self.size() * m, dtype=h_in.dtype)
            works.append(self._gloo._allgather_base(buf, padded, self._opts(_c10d.AllgatherOptions, opts)))
            host.fixups.append(lambda buf=buf, h_out=h_out, m=m: [
                h.copy_(buf[i * m:i * m + h.numel()]) for i, h in enumerate(h_out)])
        self._model(kind, "all_gather", sum(t.nbytes for t in flat_out))
        return self._work("all_gather", works, list(output_lists), host)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # One gather per input, each into its own output list: gloo's coalesced form wants
        # every input of one dtype; this has no such limit.
        host_works, results = [], []
        for lst, inp in zip(output_lists, inputs):
            w = self.allgather([lst], [inp], opts)
            host_works.append(w)
            results.append(lst)
        return self._combine("all_gather_coalesced", host_works, results)

    def all_gather_single(self, output, input, opts=None):
        # NCCL's rule: output holds group size x input.numel() elements, whatever the shapes
        # (Accelerate passes a flat output for a (1, 16, 16) input).
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        kind = checks.tensors(self, "all_gather_into_tensor", [output, input])
        if output.dtype != input.dtype:
            raise TypeError(f"neuron backend: all_gather_into_tensor output dtype {output.dtype} "
                            f"!= input dtype {input.dtype}")
        if output.numel() != input.numel() * self.size():
            raise ValueError(
                f"neuron backend: all_gather_into_tensor output {checks.describe(output)} must hold "
                f"group size ({self.size()}) x input {checks.describe(input)} elements")
        self._agreement.verify("all_gather_into_tensor", checks.count(input))
        host = HostTensors()
        raw = input.dtype not in _GLOO_DTYPES
        h_in = host.get(input, write=False, as_bytes=raw).reshape(-1)
        h_out = host.get(output, write=True, as_bytes=raw).reshape(-1)
        w = self._gloo._allgather_base(h_out, h_in, self._opts(_c10d.AllgatherOptions, opts))
        self._model(kind, "all_gather", output.nbytes)
        return self._work("all_gather_into_tensor", [w], [output], host)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._combine("all_gather_into_tensor_coalesced", works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        # NCCL's forms: inputs of one shape holding output.numel() elements each (any shape);
        # or uneven, input i holding rank i's output (a vector reduce-scatter).
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        works, results = [], []
        for out, lst in zip(outputs, input_lists):
            checks.list_len(self, "reduce_scatter", lst)
            checks.tensors(self, "reduce_scatter", [out] + list(lst))
            checks.same_dtype("reduce_scatter", lst, out)
            mine = lst[self.rank()]
            if mine.numel() != out.numel():
                raise ValueError(f"neuron backend: reduce_scatter input {self.rank()} "
                                 f"{checks.describe(mine)} must hold as many elements as this "
                                 f"rank's output {checks.describe(out)}")
            sizes = [t.numel() for t in lst]
            m = max(sizes)
            # Lay the inputs out as one buffer (padded to the largest) and reduce-scatter it:
            # gloo's list form only exists for a subset of ops, the flat one for all.
            flat = torch.cat([t.reshape(-1) if t.numel() == m else
                              torch.cat([t.reshape(-1), t.new_zeros(m - t.numel())]) for t in lst])
            sig = ",".join(checks.count(t) for t in lst)
            if all(n == m for n in sizes):
                works.append(self.reduce_scatter_single(out, flat, opts, _name="reduce_scatter",
                                                        _sig=sig))
            else:
                works.append(self.reduce_scatter_single(out.new_empty(m), flat, opts,
                                                        _name="reduce_scatter", _sig=sig, _dest=out))
            results.append(out)
        return self._combine("reduce_scatter", works, results)

    def reduce_scatter_single(self, output, input, opts=None, _name="reduce_scatter_tensor", _sig=None,
                              _dest=None):
        """NCCL's rule: input holds group size x output.numel() elements, whatever the shapes.
        ``_dest``: the caller's output when ``output`` is a larger (padded) buffer."""
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        kind = checks.tensors(self, _name, [output, input])
        if output.dtype != input.dtype:
            raise TypeError(f"neuron backend: {_name} output dtype {output.dtype} != input dtype "
                            f"{input.dtype}")
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                f"neuron backend: {_name} input {checks.describe(input)} must hold group size "
                f"({self.size()}) x output {checks.describe(output)} elements")
        self._agreement.verify(_name, (_sig or checks.count(input)) + f"|{_red_name(opts.reduceOp)}")
        host = HostTensors()
        h_in = host.get(input, write=False)
        h_out = host.get(output, write=True)
        gred, (h_in,) = self._reduce_setup(_name, opts.reduceOp, input.dtype, host, [h_in],
                                           [h_out], False)
        # gloo splits the flat input in rank order; flat views keep any shape pairing valid
        h_in, h_out = _real(h_in).reshape(-1), _real(h_out).reshape(-1)
        w = self._gloo._reduce_scatter_base(
            h_out, h_in, self._opts(_c10d.ReduceScatterOptions, opts, reduceOp=gred))
        result = output
        if _dest is not None:
            h_dest = _real(host.get(_dest, write=True)).reshape(-1)
            host.keep.append(output)
            host.fixups.append(lambda: h_dest.copy_(h_out[:h_dest.numel()]))
            result = _dest
        self._model(kind, "reduce_scatter", input.nbytes)
        return self._work(_name, [w], [result], host)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._combine("reduce_scatter_tensor_coalesced", works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          opts=None):
        # NCCL's rules. Without split sizes: rank j gets elements [j n/p, (j+1) n/p) of the
        # flat input, whatever the shapes (n = input.numel(), divisible by p). With split
        # sizes on either side: splits of dim 0 (an empty side splits its dim 0 evenly), each
        # row worth size(0)-th of the tensor's elements.
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        kind = checks.tensors(self, "all_to_all_single", [output, input])
        p = self.size()
        if output.dtype != input.dtype:
            raise TypeError(f"neuron backend: all_to_all_single output dtype {output.dtype} != "
                            f"input dtype {input.dtype}")
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % p or output.numel() != input.numel():
                raise ValueError(
                    f"neuron backend: all_to_all_single input {checks.describe(input)} and output "
                    f"{checks.describe(output)} must hold the same number of elements, divisible "
                    f"among {p} ranks, when no split sizes are given")
            ins = outs = [input.numel() // p] * p
        else:
            ins = self._element_splits("input", input, input_split_sizes)
            outs = self._element_splits("output", output, output_split_sizes)
        # Every rank checks the whole matrix: rank i sends ins[j] elements to rank j, who must
        # expect exactly that many (its outs[i]).
        gathered = self._agreement.verify("all_to_all_single", str(input.dtype),
                                          extra=ins + outs)
        if gathered is not None:
            bad = [(i, j) for i in range(p) for j in range(p) if gathered[i][j] != gathered[j][p + i]]
            if bad:
                i, j = bad[0]
                raise RuntimeError(
                    f"neuron backend: all_to_all_single split sizes disagree across ranks of group "
                    f"{self._group_name!r}: rank {i} sends {gathered[i][j]} elements to rank {j}, "
                    f"which expects {gathered[j][p + i]} (elements sent per rank: "
                    f"{[g[:p] for g in gathered]}, expected: {[g[p:] for g in gathered]})")
        host = HostTensors()
        raw = input.dtype not in _GLOO_DTYPES
        h_in = host.get(input, write=False, as_bytes=raw).reshape(-1)
        h_out = host.get(output, write=True, as_bytes=raw).reshape(-1)
        scale = input.element_size() if raw else 1   # moved as bytes
        w = self._gloo.alltoall_base(h_out, h_in, [n * scale for n in outs],
                                     [n * scale for n in ins], self._opts(_c10d.AllToAllOptions, opts))
        self._model(kind, "all_to_all", input.nbytes)
        return self._work("all_to_all_single", [w], [output], host)

    def _element_splits(self, name: str, t: torch.Tensor, splits) -> list:
        """NCCL's checkSplitSizes and computeLengthsAndOffsets: dim-0 splits as element counts."""
        p = self.size()
        rows = t.shape[0] if t.dim() else 1
        if splits:
            splits = list(splits)
            if len(splits) != p or any(s < 0 for s in splits) or sum(splits) != rows:
                raise ValueError(
                    f"neuron backend: all_to_all_single {name}_split_sizes {splits} must be {p} "
                    f"non-negative sizes summing to {name}.size(0) = {rows}")
        else:
            if t.dim() == 0 or rows % p:
                raise ValueError(f"neuron backend: all_to_all_single {name} {checks.describe(t)}: "
                                 f"size(0) must divide evenly among {p} ranks when no "
                                 f"{name}_split_sizes are given")
            splits = [rows // p] * p
        row = t.numel() // rows if rows else 0
        return [s * row for s in splits]

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        checks.tensors(self, "all_to_all", list(outputs) + list(inputs))
        checks.list_len(self, "all_to_all", outputs)
        checks.list_len(self, "all_to_all", inputs)
        dtype = inputs[0].dtype
        if any(t.dtype != dtype for t in list(outputs) + list(inputs)):
            raise TypeError("neuron backend: all_to_all tensors must share one dtype")
        # Lay the lists out as flat buffers and exchange with split sizes: uneven sizes work.
        device = inputs[0].device
        flat_in = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0, device=device)
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=dtype, device=device)
        work = self.all_to_all_single(flat_out, flat_in, [t.numel() for t in outputs],
                                      [t.numel() for t in inputs], opts)
        work.wait()
        for t, piece in zip(outputs, flat_out.split([t.numel() for t in outputs])):
            t.copy_(piece.view(t.shape))
        return self._combine("all_to_all", [], list(outputs))

    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _c10d.GatherOptions()
        return self._rooted("gather", _c10d.GatherOptions, opts, output_lists, inputs, lists_written=True)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else _c10d.ScatterOptions()
        return self._rooted("scatter", _c10d.ScatterOptions, opts, input_lists, outputs, lists_written=False)

    def _rooted(self, name, options, opts, lists, singles, lists_written):
        """gather (the root's lists are written) and scatter (they are read): one per rank."""
        root = opts.rootRank
        checks.root(self, name, root)
        flat = [t for lst in lists for t in lst]
        kind = checks.tensors(self, name, list(singles) + flat)
        roles = ("output", "input") if lists_written else ("input", "output")
        checks.root_lists(self, name, root, lists, flat, singles[0], *roles)
        self._agreement.verify(name, ",".join(checks.count(t) for t in singles) + f"|root={root}")
        host = HostTensors()
        raw = singles[0].dtype not in _GLOO_DTYPES
        h_singles = [host.get(t, write=not lists_written, as_bytes=raw) for t in singles]
        h_lists = [[host.get(t, write=lists_written, as_bytes=raw) for t in lst] for lst in lists]
        gloo_opts = self._opts(options, opts, rootRank=root)
        if lists_written:
            w = self._gloo.gather(h_lists, h_singles, gloo_opts)
        else:
            w = self._gloo.scatter(h_singles, h_lists, gloo_opts)
        self._model(kind, name, singles[0].nbytes * self.size())
        return self._work(name, [w], list(lists) if lists_written else list(singles), host)

    # --- point to point -------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        checks.peer(self, "send", dst)
        return self._p2p("send", tensors, False, lambda hs: self._gloo.send(hs, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        checks.peer(self, "recv", src)
        return self._p2p("recv", tensors, True, lambda hs: self._gloo.recv(hs, src, tag))

    def recv_anysource(self, tensors, tag: int = 0):
        return self._p2p("recv", tensors, True, lambda hs: self._gloo.recv_anysource(hs, tag))

    def _p2p(self, op: str, tensors, write: bool, issue):
        # Point-to-point moves bytes: any dtype goes, and no peer agreement is needed.
        kind = checks.tensors(self, op, tensors)
        host = HostTensors()
        w = issue([host.get(t, write=write, as_bytes=True) for t in tensors])
        self._model(kind, op, sum(t.nbytes for t in tensors))
        return self._work(op, [w], list(tensors), host)

    def barrier(self, opts=None):
        opts = opts if opts is not None else _c10d.BarrierOptions()
        self._agreement.verify("barrier", "")
        w = self._gloo.barrier(self._opts(_c10d.BarrierOptions, opts))
        self._model("neuron", "barrier", 0)
        return self._work("barrier", [w], [], HostTensors())

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        timeout = timeout if timeout is not None else self._timeout
        self._gloo.monitored_barrier(timeout, wait_all_ranks)

    # --- coalescing (``dist._coalescing_manager(group, device)``) -------------------------
    def _start_coalescing(self, device=None) -> None:
        if self._coalesced is not None:
            raise RuntimeError("neuron backend: coalescing already started on this group")
        self._coalesced = []

    def _end_coalescing(self, device=None):
        works, self._coalesced = self._coalesced or [], None
        return self._combine("coalesced", works, [r for w in works for r in w.result()])

    def _combine(self, op: str, works: list, result: list) -> NeuronWork:
        return CombinedWork(self, op, works, result)

    # --- lifetime -------------------------------------------------------------------------
    def abort(self) -> None:
        self._agreement.close()
        self._gloo.abort()

    def shutdown(self) -> None:
        self._agreement.close()
        self._gloo.shutdown()
        # After a synchronous collective Python drops its work at once, so the gloo worker
        # that ran it may hold the last reference and release the tensors itself, which
        # takes the GIL (torch keeps a tensor's Python object alive while C++ holds the
        # tensor). If the interpreter finalizes first, that worker exits inside a noexcept
        # destructor and the process aborts ("terminate called without an active
        # exception"). Sleeping releases the GIL, so a waiting worker finishes now.
        time.sleep(0.005)



_exit_hook_installed = False


def _shutdown_at_exit() -> None:
    # A script that never calls destroy_process_group would otherwise leave gloo's worker
    # threads to static destruction, which aborts the process ("terminate called without an
    # active exception"); PyTorch's own backends are torn down before that point.
    if dist.is_initialized() and isinstance(dist.group.WORLD, ProcessGroupNeuron):
        try:
            dist.destroy_process_group()
        except Exception:  # exiting anyway: a failed teardown must not mask the exit status
            pass


def _create(dist_backend_opts, backend_options=None):
    """Creator registered with ``dist.Backend.register_backend("neuron", ..., extended_api=True)``."""
    global _exit_hook_installed
    from . import launch
    world = not dist.is_initialized()
    if world:
        launch.bind_device()
    if not _exit_hook_installed:
        import atexit
        atexit.register(_shutdown_at_exit)
        _exit_hook_installed = True
    return ProcessGroupNeuron(dist_backend_opts.store, dist_backend_opts.group_rank,
                              dist_backend_opts.group_size, dist_backend_opts.timeout,
                              global_ranks=dist_backend_opts.global_ranks_in_group,
                              group_name=dist_backend_opts.group_id)
