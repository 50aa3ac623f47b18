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

Safety: unless ``TORCH_NEURONX_DIST_CHECK=0``, every collective first agrees with its peers on
a fingerprint of (op, dtype, shape, root, reduce op), so ranks that disagree get the same
clear error, naming each rank's call, instead of a hang or gloo's size assertion (which can
kill a rank). The agreement runs through shared memory when every rank of the group is on
this host (``shm_agreement``), else (or with ``TORCH_NEURONX_DIST_CHECK=gloo``) as a 16-byte
gloo all-reduce. A rank that dies or never arrives surfaces as an error on the survivors
within the group's timeout, with the op, rank and group named.
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from . import collectives_model, shm_agreement

ReduceOp = dist.ReduceOp
_RED = ReduceOp.RedOpType
_SUM, _AVG, _PREMUL_SUM = int(_RED.SUM), int(_RED.AVG), int(_RED.PREMUL_SUM)
_BITWISE = {int(_RED.BAND), int(_RED.BOR), int(_RED.BXOR)}
_GLOO_REDUCTIONS = {int(_RED.PRODUCT), int(_RED.MIN), int(_RED.MAX)} | _BITWISE

# dtypes gloo reduces (and moves); other dtypes are moved as bytes and cannot be reduced.
_GLOO_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                torch.uint8, torch.int32, torch.int64, torch.bool}
_INFINITE = timedelta(milliseconds=-1)
_ZERO = timedelta(0)
_FINGERPRINTS: dict = {}   # call description -> its 56-bit hash, for the peer agreement


def _find_runtime_alias():
    from .. import _C
    return getattr(_C, "_cpu_alias", None)


_runtime_alias = _find_runtime_alias()


def _cpu_alias(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same memory as neuron tensor ``t`` (same sizes, strides, offset).

    The device runtime's ``_C._cpu_alias`` keeps the device storage alive; the fallback here
    (for runtimes without it) does not own the memory, so callers keep ``t`` alive anyway.
    """
    if _runtime_alias is not None:
        return _runtime_alias(t)
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    cpu_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), torch.device("cpu"), storage.nbytes())
    return torch.empty(0, dtype=t.dtype).set_(cpu_storage, t.storage_offset(), t.size(), t.stride())


_ADD_TIME = None


def _add_time():
    """``cost_model._add_time`` (imported on first use: the cost model imports the runtime)."""
    global _ADD_TIME
    if _ADD_TIME is None:
        from ..cost_model import _add_time as add
        _ADD_TIME = add
    return _ADD_TIME


# Names by dtype and by reduce-op value: each collective describes its call for the peer
# agreement, and str() of torch's enums costs more than the rest of that description.
_DTYPE_NAMES: dict = {}
_RED_NAMES = {int(k): str(k).rsplit(".", 1)[-1] for k in _RED.__members__.values()}


def _describe(t: torch.Tensor) -> str:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
    return f"{name}{list(t.shape)}"


def _red_kind(op) -> int:
    return int(op.op if isinstance(op, ReduceOp) else op)


def _red_name(op) -> str:
    return _RED_NAMES[_red_kind(op)]


class _Host:
    """The CPU tensors gloo uses for one collective, and what to do once it completes."""

    __slots__ = ("keep", "fixups", "copyback")

    def __init__(self):
        self.keep = []       # device tensors whose memory gloo is using
        self.fixups = []     # run first on completion (AVG division), on host tensors
        self.copyback = []   # then copy staged results into non-contiguous outputs

    def get(self, t: torch.Tensor, write: bool, as_bytes: bool = False) -> torch.Tensor:
        if t.device.type == "neuron":
            self.keep.append(t)
            h = _cpu_alias(t)
        else:
            h = t
        if not h.is_contiguous():
            staged = h.contiguous()
            if write:
                self.copyback.append((h, staged))
            h = staged
        if as_bytes:
            h = h.reshape(-1).view(torch.uint8) if h.dim() else h.reshape(1).view(torch.uint8)
        return h

    def finish(self) -> None:
        for f in self.fixups:
            f()
        for dst, src in self.copyback:
            dst.copy_(src)
        self.keep = []


class _NeuronWork(dist.Work):
    """Work of one collective: waits on gloo's works, then finishes the host-side steps; its
    future resolves to the caller's (device) tensors, as CUDA's does."""

    def __init__(self, pg, op: str, works: list, result: list, host: _Host):
        super().__init__()
        self._pg = pg
        self._op = op
        self._works = works
        self._result = result
        self._host = host
        self._fut = None

    def _finish(self) -> None:
        # wait() and the future's callback (a gloo thread) may both get here: popping the
        # attribute is atomic under the GIL, so exactly one of them finishes the host side.
        host = self.__dict__.pop("_host", None)
        if host is not None:
            host.finish()

    def wait(self, timeout=None) -> bool:
        try:
            if timeout is None or timeout == _ZERO or timeout == _INFINITE:
                for w in self._works:
                    w.wait()
            else:
                for w in self._works:
                    w.wait(timeout)
        except RuntimeError as e:
            raise self._pg._comm_error(self._op, e) from e
        self._finish()
        return True

    def get_future(self):
        if self._fut is None:
            futs = [w.get_future() for w in self._works]
            if not futs:
                base = torch.futures.Future()
                base.set_result([])
            elif len(futs) == 1:
                base = futs[0]
            else:
                base = torch.futures.collect_all(futs)

            def done(f, futs=futs):
                for g in futs:
                    g.value()  # re-raise a communication error
                self._finish()
                return self._result

            self._fut = base.then(done)
        return self._fut

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self):
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None

    def result(self) -> list:
        return self._result

    def synchronize(self) -> None:
        # The device runs in issue order on the host: nothing to order beyond wait().
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        return self._works[0]._source_rank()

    def _source_rank(self) -> int:
        return self._works[0]._source_rank()


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
        mode = os.environ.get("TORCH_NEURONX_DIST_CHECK", "1")
        if mode not in ("0", "1", "gloo"):
            raise ValueError(f"TORCH_NEURONX_DIST_CHECK={mode!r}: expected 0 (no peer agreement "
                             "check), 1 (shared memory when the group's ranks share a host, else "
                             "a gloo round trip) or gloo (always the gloo round trip)")
        self._check = mode != "0" and size > 1
        self._slots = None
        if self._check and mode == "1" and shm_agreement.available():
            self._slots = shm_agreement.SharedSlots.negotiate(self._gloo, rank, size)
        # how this group agrees before each collective: "off", "shm" or "gloo"
        self.check_transport = ("off" if not self._check else
                                "shm" if self._slots is not None else "gloo")
        self._seq = 0
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

    # --- checks ---------------------------------------------------------------------------
    def _check_tensors(self, op: str, tensors) -> str:
        """All tensors of one call on one device this group serves; return its type."""
        kind = None
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"neuron backend: {op} expects tensors, got {type(t).__name__}")
            dev = t.device
            if dev.type not in ("neuron", "cpu"):
                raise RuntimeError(
                    f"neuron backend: {op} got a tensor on {dev}; the neuron process group "
                    "serves neuron and cpu tensors (move it with .to('neuron'))")
            if dev.type == "neuron" and dev.index != self._device_index:
                raise RuntimeError(
                    f"neuron backend: {op} got a tensor on {dev}, but rank {self.rank()} of "
                    f"group {self._group_name!r} communicates from neuron:{self._device_index}; "
                    f"use tensors on neuron:{self._device_index} (torchrun binds "
                    "neuron:LOCAL_RANK; call torch.neuron.set_device before init_process_group "
                    "to choose another)")
            if t.layout != torch.strided:
                raise RuntimeError(f"neuron backend: {op} supports dense tensors only, got {t.layout}")
            if kind is None:
                kind = dev.type
            elif kind != dev.type:
                raise RuntimeError(
                    f"neuron backend: {op} mixes {kind} and {dev.type} tensors; all tensors of "
                    "one collective must be on the same device")
        return kind or "cpu"

    def _verify(self, op: str, signature: str, extra=None) -> list | None:
        """Agree with every peer on ``signature`` before the real collective (see module doc).

        ``extra`` (int list, same length on every rank) is gathered too and returned per rank.
        """
        if not self._check:
            return None
        self._seq += 1
        call = f"{op}|{signature}"
        h = _FINGERPRINTS.get(call)
        if h is None:
            h = int.from_bytes(hashlib.blake2b(call.encode(), digest_size=7).digest(), "little")
            if len(_FINGERPRINTS) < 4096:   # a training loop repeats a few dozen calls
                _FINGERPRINTS[call] = h
        if self._slots is not None:
            try:
                entries = self._slots.exchange(self._seq, h, extra or (),
                                               self._timeout.total_seconds())
            except shm_agreement.PeerMissing as e:
                raise self._missing_error(op, e) from e
            agreed = all(fp == h for fp, _ in entries)
            gathered = [ex for _, ex in entries]
        else:
            try:
                agreed, gathered = self._verify_gloo(h, extra)
            except RuntimeError as e:
                raise self._comm_error(op, e) from e
        if agreed:
            return None if extra is None else gathered
        # Disagreement: every rank reaches this point, so exchanging the descriptions is safe.
        desc = f"{op}({signature})".encode()[:255]
        buf = torch.zeros(256, dtype=torch.uint8)
        buf[:len(desc)] = torch.frombuffer(bytearray(desc), dtype=torch.uint8)
        outs = [torch.empty_like(buf) for _ in range(self.size())]
        self._gloo.allgather([outs], [buf]).wait()
        calls = [bytes(o.tolist()).rstrip(b"\0").decode(errors="replace") for o in outs]
        lines = "; ".join(f"rank {i}: {c}" for i, c in enumerate(calls))
        raise RuntimeError(
            f"neuron backend: ranks of group {self._group_name!r} called collective #{self._seq} "
            f"with mismatched arguments (every rank must call the same collective with the same "
            f"dtype and shape): {lines}")

    def _verify_gloo(self, h: int, extra) -> tuple:
        """The agreement as a gloo round trip: (whether every fingerprint equals ``h``,
        every rank's ``extra`` or None without it)."""
        if extra is None:
            # max(h) == -max(-h) exactly when every rank's h is the same
            t = torch.tensor([h, -h], dtype=torch.int64)
            opts = _c10d.AllreduceOptions()
            opts.reduceOp = ReduceOp.MAX
            self._gloo.allreduce([t], opts).wait()
            return int(t[0]) == -int(t[1]), None
        mine = torch.tensor([h] + list(extra), dtype=torch.int64)
        outs = [torch.empty_like(mine) for _ in range(self.size())]
        self._gloo.allgather([outs], [mine]).wait()
        gathered = [o.tolist() for o in outs]
        return all(g[0] == h for g in gathered), [g[1:] for g in gathered]

    def _why(self, timed_out: bool) -> str:
        if timed_out:
            return (f"timed out after {self._timeout.total_seconds():g}s: a peer rank never "
                    "arrived at this collective (it hung, skipped it, or died)")
        return "a peer rank died or closed its connection"

    def _comm_error(self, op: str, e: Exception) -> RuntimeError:
        msg = str(e)
        low = msg.lower()
        if "timed out" in low or "timeout" in low:
            why = self._why(True)
        elif "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
            why = self._why(False)
        else:
            why = "the communication failed"
        return RuntimeError(f"neuron backend: {op} on rank {self.rank()} of group "
                            f"{self._group_name!r} (size {self.size()}): {why} [{msg}]")

    def _missing_error(self, op: str, e: shm_agreement.PeerMissing) -> RuntimeError:
        ranks = ", ".join(str(q) if self._global_ranks[q] == q else
                          f"{q} (global rank {self._global_ranks[q]})" for q in e.ranks)
        what = ("exited or left the group before reaching" if e.dead else "did not reach")
        return RuntimeError(f"neuron backend: {op} on rank {self.rank()} of group "
                            f"{self._group_name!r} (size {self.size()}): {self._why(not e.dead)} "
                            f"[group rank(s) {ranks} {what} collective #{e.seq}]")

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
                    link_bytes=nbytes)

    def _work(self, op: str, works: list, result: list, host: _Host) -> _NeuronWork:
        w = _NeuronWork(self, op, works, result, host)
        if self._coalesced is not None:
            self._coalesced.append(w)
        return w

    def _reduce_setup(self, op: str, red, dtype: torch.dtype, host: _Host, inputs: list,
                      outputs: list, inputs_are_outputs: bool):
        """Map ``red`` to an op gloo has (AVG -> SUM then divide, PREMUL_SUM -> scale then
        SUM), rewriting ``inputs`` (host tensors) when they must be scaled."""
        if dtype not in _GLOO_DTYPES:
            raise TypeError(f"neuron backend: {op} cannot reduce dtype {dtype}; reduce in "
                            "float32/bfloat16/float16/float64 or an integer dtype")
        kind = _red_kind(red)
        if kind == _SUM:
            return ReduceOp.SUM, inputs
        if kind == _AVG:
            size = self.size()
            for o in outputs:
                if o.is_floating_point():
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
        kind = self._check_tensors("all_reduce", tensors)
        red = opts.reduceOp
        red_kind = _red_kind(red)
        # host views first: a rank that waits in the agreement issues right after it returns
        host = _Host()
        hs = [host.get(t, write=True) for t in tensors]
        self._verify("all_reduce", ",".join(_describe(t) for t in tensors) + "|"
                     + _RED_NAMES[red_kind])
        gred, hs = self._reduce_setup("all_reduce", red, tensors[0].dtype, host, hs, hs, True)
        if red_kind == _AVG or red_kind == _PREMUL_SUM:
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
        kind = self._check_tensors("broadcast", tensors)
        self._check_root("broadcast", opts.rootRank)
        self._verify("broadcast", ",".join(_describe(t) for t in tensors) + f"|root={opts.rootRank}")
        host = _Host()
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
        kind = self._check_tensors("reduce", tensors)
        self._check_root("reduce", opts.rootRank)
        self._verify("reduce", ",".join(_describe(t) for t in tensors)
                     + f"|{_red_name(opts.reduceOp)}|root={opts.rootRank}")
        host = _Host()
        hs = [host.get(t, write=True) for t in tensors]
        outs = hs if self.rank() == opts.rootRank else []
        gred, hs = self._reduce_setup("reduce", opts.reduceOp, tensors[0].dtype, host, hs, outs, True)
        works = [self._gloo.reduce([h], self._opts(_c10d.ReduceOptions, opts, reduceOp=gred,
                                                    rootRank=opts.rootRank)) for h in hs]
        self._model(kind, "reduce", sum(t.nbytes for t in tensors))
        return self._work("reduce", works, list(tensors), host)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        flat_out = [t for lst in output_lists for t in lst]
        kind = self._check_tensors("all_gather", list(inputs) + flat_out)
        for lst, inp in zip(output_lists, inputs):
            self._check_list_len("all_gather", lst)
            for o in lst:
                if o.shape != inp.shape or o.dtype != inp.dtype:
                    raise ValueError(f"neuron backend: all_gather output {_describe(o)} does not "
                                     f"match the input {_describe(inp)}")
        self._verify("all_gather", ",".join(_describe(t) for t in inputs))
        host = _Host()
        raw = any(t.dtype not in _GLOO_DTYPES for t in inputs)
        works = []
        for lst, inp in zip(output_lists, inputs):
            h_in = host.get(inp, write=False, as_bytes=raw)
            h_out = [host.get(o, write=True, as_bytes=raw) for o in lst]
            works.append(self._gloo.allgather([h_out], [h_in], self._opts(_c10d.AllgatherOptions, opts)))
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
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        kind = self._check_tensors("all_gather_into_tensor", [output, input])
        if output.dtype != input.dtype:
            raise TypeError(f"neuron backend: all_gather_into_tensor output dtype {output.dtype} "
                            f"!= input dtype {input.dtype}")
        if output.numel() != input.numel() * self.size():
            raise ValueError(
                f"neuron backend: all_gather_into_tensor output {_describe(output)} must hold "
                f"group size ({self.size()}) x input {_describe(input)} elements")
        self._verify("all_gather_into_tensor", _describe(input))
        host = _Host()
        raw = input.dtype not in _GLOO_DTYPES
        h_in = host.get(input, write=False, as_bytes=raw)
        h_out = host.get(output, write=True, as_bytes=raw)
        w = self._gloo._allgather_base(h_out, h_in, self._opts(_c10d.AllgatherOptions, opts))
        self._model(kind, "all_gather", output.nbytes)
        return self._work("all_gather_into_tensor", [w], [output], host)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._combine("all_gather_into_tensor_coalesced", works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        works, results = [], []
        for out, lst in zip(outputs, input_lists):
            self._check_list_len("reduce_scatter", lst)
            self._check_tensors("reduce_scatter", [out] + list(lst))
            for t in lst:
                if t.shape != out.shape or t.dtype != out.dtype:
                    raise ValueError(f"neuron backend: reduce_scatter input {_describe(t)} does "
                                     f"not match the output {_describe(out)}")
            # Lay the inputs out as one buffer and reduce-scatter it: gloo's list form only
            # exists for a subset of ops, the flat one for all.
            flat = torch.cat([t.reshape(-1) for t in lst])
            works.append(self.reduce_scatter_single(out, flat, opts, _name="reduce_scatter",
                                                    _sig=_describe(out)))
            results.append(out)
        return self._combine("reduce_scatter", works, results)

    def reduce_scatter_single(self, output, input, opts=None, _name="reduce_scatter_tensor", _sig=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        kind = self._check_tensors(_name, [output, input])
        if output.dtype != input.dtype:
            raise TypeError(f"neuron backend: {_name} output dtype {output.dtype} != input dtype "
                            f"{input.dtype}")
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                f"neuron backend: {_name} input {_describe(input)} must hold group size "
                f"({self.size()}) x output {_describe(output)} elements")
        self._verify(_name, (_sig or _describe(input)) + f"|{_red_name(opts.reduceOp)}")
        host = _Host()
        h_in = host.get(input, write=False)
        h_out = host.get(output, write=True)
        gred, (h_in,) = self._reduce_setup(_name, opts.reduceOp, input.dtype, host, [h_in],
                                           [h_out], False)
        # gloo splits the flat input in rank order; flat views keep any shape pairing valid
        h_in, h_out = h_in.reshape(-1), h_out.reshape(-1)
        w = self._gloo._reduce_scatter_base(
            h_out, h_in, self._opts(_c10d.ReduceScatterOptions, opts, reduceOp=gred))
        self._model(kind, "reduce_scatter", input.nbytes)
        return self._work(_name, [w], [output], host)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._combine("reduce_scatter_tensor_coalesced", works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          opts=None):
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        kind = self._check_tensors("all_to_all_single", [output, input])
        p = self.size()
        out_splits = list(output_split_sizes or [])
        in_splits = list(input_split_sizes or [])
        if output.dtype != input.dtype:
            raise TypeError(f"neuron backend: all_to_all_single output dtype {output.dtype} != "
                            f"input dtype {input.dtype}")
        for name, splits, t in (("input", in_splits, input), ("output", out_splits, output)):
            if splits:
                if len(splits) != p or any(s < 0 for s in splits) or sum(splits) != (t.shape[0] if t.dim() else 1):
                    raise ValueError(
                        f"neuron backend: all_to_all_single {name}_split_sizes {splits} must be "
                        f"{p} non-negative sizes summing to {name}.size(0) = "
                        f"{t.shape[0] if t.dim() else 1}")
            elif t.dim() == 0 or t.shape[0] % p:
                raise ValueError(f"neuron backend: all_to_all_single {name} {_describe(t)}: size(0) "
                                 f"must divide evenly among {p} ranks when no split sizes are given")
        row = math.prod(input.shape[1:]) if input.dim() > 1 else 1
        # Every rank checks the whole split matrix: rank i sends in_splits[j] rows to rank j,
        # who must expect exactly that many (out_splits[i]).
        ins = in_splits or [input.shape[0] // p] * p
        outs = out_splits or [output.shape[0] // p] * p
        gathered = self._verify("all_to_all_single",
                                f"{str(input.dtype)}|{list(input.shape[1:])}|{list(output.shape[1:])}",
                                extra=ins + outs)
        if gathered is not None:
            bad = [(i, j) for i in range(p) for j in range(p) if gathered[i][j] != gathered[j][p + i]]
            if bad:
                i, j = bad[0]
                raise RuntimeError(
                    f"neuron backend: all_to_all_single split sizes disagree across ranks of group "
                    f"{self._group_name!r}: rank {i} sends {gathered[i][j]} rows to rank {j}, which "
                    f"expects {gathered[j][p + i]} (input_split_sizes per rank: "
                    f"{[g[:p] for g in gathered]}, output_split_sizes: {[g[p:] for g in gathered]})")
        host = _Host()
        raw = input.dtype not in _GLOO_DTYPES
        h_in = host.get(input, write=False)
        h_out = host.get(output, write=True)
        if raw:
            # moved as bytes: a row of ``row`` elements becomes row * itemsize bytes
            h_in = h_in.reshape(h_in.shape[0], row).view(torch.uint8)
            h_out = h_out.reshape(h_out.shape[0], row).view(torch.uint8)
        w = self._gloo.alltoall_base(h_out, h_in, out_splits, in_splits,
                                     self._opts(_c10d.AllToAllOptions, opts))
        self._model(kind, "all_to_all", input.nbytes)
        return self._work("all_to_all_single", [w], [output], host)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        self._check_tensors("all_to_all", list(outputs) + list(inputs))
        self._check_list_len("all_to_all", outputs)
        self._check_list_len("all_to_all", inputs)
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
        root = opts.rootRank
        self._check_root("gather", root)
        flat_out = [t for lst in output_lists for t in lst]
        kind = self._check_tensors("gather", list(inputs) + flat_out)
        self._check_root_lists("gather", root, output_lists, flat_out, inputs[0], "output", "input")
        self._verify("gather", ",".join(_describe(t) for t in inputs) + f"|root={root}")
        host = _Host()
        raw = inputs[0].dtype not in _GLOO_DTYPES
        h_in = [host.get(t, write=False, as_bytes=raw) for t in inputs]
        h_out = [[host.get(o, write=True, as_bytes=raw) for o in lst] for lst in output_lists]
        w = self._gloo.gather(h_out, h_in, self._opts(_c10d.GatherOptions, opts, rootRank=root))
        self._model(kind, "gather", inputs[0].nbytes * self.size())
        return self._work("gather", [w], list(output_lists), host)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else _c10d.ScatterOptions()
        root = opts.rootRank
        self._check_root("scatter", root)
        flat_in = [t for lst in input_lists for t in lst]
        kind = self._check_tensors("scatter", list(outputs) + flat_in)
        self._check_root_lists("scatter", root, input_lists, flat_in, outputs[0], "input", "output")
        self._verify("scatter", ",".join(_describe(t) for t in outputs) + f"|root={root}")
        host = _Host()
        raw = outputs[0].dtype not in _GLOO_DTYPES
        h_out = [host.get(t, write=True, as_bytes=raw) for t in outputs]
        h_in = [[host.get(t, write=False, as_bytes=raw) for t in lst] for lst in input_lists]
        w = self._gloo.scatter(h_out, h_in, self._opts(_c10d.ScatterOptions, opts, rootRank=root))
        self._model(kind, "scatter", outputs[0].nbytes * self.size())
        return self._work("scatter", [w], list(outputs), host)

    # --- point to point -------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        self._check_peer("send", dst)
        return self._p2p("send", tensors, False, lambda hs: self._gloo.send(hs, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        self._check_peer("recv", src)
        return self._p2p("recv", tensors, True, lambda hs: self._gloo.recv(hs, src, tag))

    def recv_anysource(self, tensors, tag: int = 0):
        return self._p2p("recv", tensors, True, lambda hs: self._gloo.recv_anysource(hs, tag))

    def _p2p(self, op: str, tensors, write: bool, issue):
        # Point-to-point moves bytes: any dtype goes, and no peer agreement is needed.
        kind = self._check_tensors(op, tensors)
        host = _Host()
        w = issue([host.get(t, write=write, as_bytes=True) for t in tensors])
        self._model(kind, op, sum(t.nbytes for t in tensors))
        return self._work(op, [w], list(tensors), host)

    def barrier(self, opts=None):
        opts = opts if opts is not None else _c10d.BarrierOptions()
        self._verify("barrier", "")
        w = self._gloo.barrier(self._opts(_c10d.BarrierOptions, opts))
        self._model("neuron", "barrier", 0)
        return self._work("barrier", [w], [], _Host())

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

    def _combine(self, op: str, works: list, result: list) -> _NeuronWork:
        return _Combined(self, op, works, result)

    # --- validation helpers ---------------------------------------------------------------
    def _check_root(self, op: str, root: int) -> None:
        if not 0 <= root < self.size():
            raise ValueError(f"neuron backend: {op} root rank {root} is not in group "
                             f"{self._group_name!r} of size {self.size()}")

    def _check_peer(self, op: str, peer: int) -> None:
        if not 0 <= peer < self.size():
            raise ValueError(f"neuron backend: {op} peer rank {peer} is not in group "
                             f"{self._group_name!r} of size {self.size()}")

    def _check_root_lists(self, op: str, root: int, lists, flat, like, role: str, other: str) -> None:
        # gather/scatter: only the root passes the per-rank list, whose tensors match `like`.
        if self.rank() != root:
            if flat:
                raise ValueError(f"neuron backend: {op}: only the root (rank {root}) passes a "
                                 f"{op}_list")
            return
        for lst in lists:
            self._check_list_len(op, lst)
            for t in lst:
                if t.shape != like.shape or t.dtype != like.dtype:
                    raise ValueError(f"neuron backend: {op} {role} {_describe(t)} does not "
                                     f"match the {other} {_describe(like)}")

    def _check_list_len(self, op: str, lst) -> None:
        if len(lst) != self.size():
            raise ValueError(f"neuron backend: {op} needs a list of group size ({self.size()}) "
                             f"tensors, got {len(lst)}")

    # --- lifetime -------------------------------------------------------------------------
    def abort(self) -> None:
        self._close_slots()
        self._gloo.abort()

    def shutdown(self) -> None:
        self._close_slots()
        self._gloo.shutdown()
        # After a synchronous collective Python drops its work at once, so the gloo worker
        # that ran it may hold the last reference and release the tensors itself, which
        # takes the GIL (torch keeps a tensor's Python object alive while C++ holds the
        # tensor). If the interpreter finalizes first, that worker exits inside a noexcept
        # destructor and the process aborts ("terminate called without an active
        # exception"). Sleeping releases the GIL, so a waiting worker finishes now.
        time.sleep(0.005)

    def _close_slots(self) -> None:
        if self._slots is not None:
            self._slots.close()
            self._slots = None


class _Combined(_NeuronWork):
    """Several works completed as one (coalesced and list collectives)."""

    def __init__(self, pg, op, works, result):
        super().__init__(pg, op, [], result, None)
        self._parts = works

    def wait(self, timeout=None) -> bool:
        for w in self._parts:
            w.wait(timeout)
        return True

    def get_future(self):
        if self._fut is None:
            futs = [w.get_future() for w in self._parts]
            if not futs:
                base = torch.futures.Future()
                base.set_result(self._result)
                self._fut = base
            else:
                self._fut = torch.futures.collect_all(futs).then(
                    lambda f: ([g.value() for g in f.value()], self._result)[1])
        return self._fut

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._parts)

    def result(self) -> list:
        return self._result


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
