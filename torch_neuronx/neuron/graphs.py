"""torch.accelerator.Graph on neuron (csrc/python/graph.cpp forwards each call here).

Capture records the ops issued on the capturing thread (and on autograd's device thread,
which inherits the thread's dispatch modes) that touch neuron tensors, without running them,
as a CUDA stream capture does. Each functional op's outputs are allocated at capture from the
op's meta kernel (its "static" outputs); views run at once, since they only describe memory.
replay() issues the recorded ops again, in order, on the current stream: they read the
static inputs as they are at replay time, write in place what they wrote at capture, and
copy each functional result into its static output. The graph holds every tensor it
touched, which is what CUDA's graph memory pool guarantees.

What CUDA refuses during capture is refused with CUDA's message: host synchronisation
(csrc/runtime/device.cpp), reading device data on the host (``.item()``, ``.cpu()``, ops whose
output shape depends on data) and copies from pageable host memory.
"""
from __future__ import annotations

import itertools
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map

from .. import _C
from ..kernels._meta import to_meta

_pool_ids = itertools.count(1)
# Ops that only allocate or describe memory: run at capture, nothing to replay.
_ALLOCATION_ONLY = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                    "aten::new_empty_strided", "aten::resize_", "aten::set_"}
_MODES = ("default", "global", "thread_local", "relaxed")


def _capture_error(func, why):
    return RuntimeError(f"operation not permitted when stream is capturing: {func} {why} while a "
                        "torch.accelerator.Graph is capturing on neuron (CUDA raises "
                        "cudaErrorStreamCaptureUnsupported here)")


def _on_neuron(x):
    return isinstance(x, torch.Tensor) and x.device.type == "neuron"


def _device_kwarg(kwargs):
    d = kwargs.get("device")
    return torch.device(d) if d is not None else None


def _written(schema, args, kwargs):
    """The arguments the op writes (in-place self, out=), in schema order."""
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else None)
    return out


def _check_not_capturing_direct(what: str) -> None:
    """Raise when device memory is about to be written behind the dispatcher (an eager NKI
    kernel call) while this thread captures: the recorder would not see it, and a replay
    would leave its outputs stale."""
    if any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack()):
        raise RuntimeError(f"operation not permitted when stream is capturing: {what} writes device "
                           "memory directly, which a torch.accelerator.Graph cannot record on "
                           "neuron; register the kernel with torch_neuronx.nki_op so the capture "
                           "records it as an op")


class _Recorder(TorchDispatchMode):
    def __init__(self, nodes):
        super().__init__()
        self.nodes = nodes
        self.warned_host = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        dev = next((a.device for a in flat if _on_neuron(a)), None)
        if dev is None:
            kdev = _device_kwarg(kwargs)
            dev = kdev if kdev is not None and kdev.type == "neuron" else None
        schema = func._schema
        name = schema.name
        if dev is None:
            self._host_op(func, schema, args, kwargs)
            return func(*args, **kwargs)
        if name in _ALLOCATION_ONLY or torch.Tag.inplace_view in func.tags:
            return func(*args, **kwargs)
        returns = schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return func(*args, **kwargs)  # a view of a static tensor: metadata only
        if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
            raise _capture_error(func, "reads device data on the host")
        host = [str(r.type) for r in returns if r.type.kind() not in ("TensorType", "ListType", "OptionalType")]
        if host:
            raise _capture_error(func, f"returns a host value ({', '.join(host)}), which a capture "
                                       "cannot record")
        self._check_copy(func, name, args, kwargs)
        written = _written(schema, args, kwargs)
        if written:  # in place or out=: replay writes the same tensors again
            self.nodes.append((func, args, kwargs, None))
            if not returns:
                return None
            return written[0] if len(returns) == 1 else tuple(written)
        out = self._static_outputs(func, args, kwargs, dev)
        self.nodes.append((func, args, kwargs, out))
        return out

    def _host_op(self, func, schema, args, kwargs):
        # CPU work runs once, at capture, as on CUDA; a write to host state (an optimizer's
        # step counter on the CPU, say) then stays frozen over replays, which is a silent
        # error CUDA's optimizers guard against only for cuda/xpu: say it once.
        if not self.warned_host and any(
                isinstance(t, torch.Tensor) for t in tree_flatten(_written(schema, args, kwargs))[0]):
            self.warned_host = True
            warnings.warn(f"torch.accelerator.Graph capture on neuron: {func} writes a CPU tensor; "
                          "host work runs once at capture and is not replayed (an optimizer "
                          "needs capturable=True)", stacklevel=3)

    @staticmethod
    def _check_copy(func, name, args, kwargs):
        if name == "aten::_to_copy":
            kdev = _device_kwarg(kwargs)
            if kdev is not None and kdev.type != "neuron":
                raise _capture_error(func, "copies device memory to the host")
            src = args[0]
        elif name == "aten::copy_":
            if not _on_neuron(args[0]):
                raise _capture_error(func, "copies device memory to the host")
            src = args[1]
        else:
            return
        if isinstance(src, torch.Tensor) and src.device.type == "cpu" and not src.is_pinned():
            raise _capture_error(func, "copies from pageable host memory (pin it: a replay "
                                       "reads a pinned buffer as it is then)")

    @staticmethod
    def _static_outputs(func, args, kwargs, dev):
        margs, mkwargs = tree_map(to_meta, (args, kwargs))
        try:
            meta_out = func(*margs, **mkwargs)
        except (NotImplementedError, RuntimeError):
            # No meta kernel (a neuron-only op): run it once to learn its outputs, which is
            # safe for a functional op; replay overwrites them anyway.
            return func(*args, **kwargs)
        return tree_map(lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=dev)
                        if isinstance(m, torch.Tensor) else m, meta_out)


# out= kernels that write their result straight into the given tensors. Others may use
# `out` as scratch of another shape first (CPU's mse_loss.out resizes it to the elementwise
# loss, then reduces), which would reallocate a static output behind its views.
_DIRECT_OUT = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul"}


def _out_overload(func, n_out):
    """The ``out=`` overload computing ``func`` into given tensors, with its out argument
    names, or None."""
    base = func._schema.name
    if not (torch.Tag.pointwise in func.tags or torch.Tag.reduction in func.tags
            or base in _DIRECT_OUT or base.startswith("aten::_foreach_")):
        return None
    name = func._overloadname
    packet = func.overloadpacket
    for cand in (("out",) if name == "default" else (f"{name}_out", "out")):
        out_func = getattr(packet, cand, None)
        if out_func is None:
            continue
        args = out_func._schema.arguments
        outs = [a.name for a in args if a.is_out]
        ins = [(a.name, str(a.type)) for a in args if not a.is_out]
        if len(outs) == n_out and ins == [(a.name, str(a.type)) for a in func._schema.arguments]:
            return out_func, outs
    return None


def _replayable(func, args, kwargs, out):
    """One recorded op as a call: in place as recorded; a functional op through its out=
    overload straight into its static outputs (no second pass over memory), else computed
    and copied into them."""
    if out is None:
        return lambda: func(*args, **kwargs)
    outs = tree_flatten(out)[0]
    rets = out if isinstance(out, tuple) else (out,)
    if outs and all(isinstance(o, torch.Tensor) for o in outs):
        found = _out_overload(func, len(rets))
        if found is not None:
            out_func, names = found
            okw = dict(kwargs, **dict(zip(names, rets)))
            return lambda: out_func(*args, **okw)

    def compute_and_copy():
        for o, r in zip(outs, tree_flatten(func(*args, **kwargs))[0]):
            if isinstance(o, torch.Tensor):
                o.copy_(r)
    return compute_and_copy


class _GraphImpl:
    def __init__(self, keep_graph):
        self.keep_graph = bool(keep_graph)
        self._debug = False
        self.reset()

    def reset(self):
        if getattr(self, "_mode", None) is not None:
            raise RuntimeError("torch.accelerator.Graph: reset() called during capture; call "
                               "capture_end() first")
        self.nodes = None
        self._mode = self._pool = self._stream = None
        self._ended = self._instantiated = False
        self._program = []

    def capture_begin(self, pool_first, pool_second, mode):
        if self.nodes is not None:
            raise RuntimeError("torch.accelerator.Graph: this graph already holds a capture; call "
                               "reset() or create a new Graph to capture again")
        self._pool = (pool_first, pool_second) if (pool_first, pool_second) != (0, 0) \
            else (0, next(_pool_ids))
        stream = torch.accelerator.current_stream()
        _C._set_capturing(stream.device_index, stream.stream_id, True)
        self._stream = stream
        self.nodes = []
        self._mode = _Recorder(self.nodes)
        self._mode.__enter__()

    def capture_end(self):
        if self._mode is None:
            raise RuntimeError("torch.accelerator.Graph: capture_end() called without a preceding "
                               "capture_begin()")
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(None, None, None)
        finally:
            _C._set_capturing(self._stream.device_index, self._stream.stream_id, False)
        self._ended = True
        if not self.keep_graph:
            self.instantiate()

    def instantiate(self):
        if not self._ended:
            raise RuntimeError("torch.accelerator.Graph: instantiate() called before capture_end()")
        self._program = [_replayable(*node) for node in self.nodes]
        self._instantiated = True

    def replay(self):
        if not self._ended:
            raise RuntimeError("torch.accelerator.Graph: replay() called without a preceding "
                               "successful capture (capture_begin/capture_end)")
        if not self._instantiated:
            self.instantiate()
        with torch.no_grad():
            for run in self._program:
                run()

    def pool(self):
        if self._pool is None:
            raise RuntimeError("torch.accelerator.Graph: pool() called before capture_begin()")
        return self._pool

    def enable_debug_mode(self):
        self._debug = True

    def debug_dump(self, path):
        if not self._debug or not self._ended:
            raise RuntimeError("torch.accelerator.Graph: debug_dump() needs enable_debug_mode() "
                               "before capture and a finished capture")
        with open(path, "w") as f:
            f.write("digraph neuron_graph {\n")
            for i, (func, *_rest) in enumerate(self.nodes):
                f.write(f'  n{i} [label="{func}"];\n')
                if i:
                    f.write(f"  n{i - 1} -> n{i};\n")
            f.write("}\n")


# torch.cuda's graph names, for CUDA code ported by renaming the device module.
class NeuronGraph(torch.accelerator.Graph):
    """``torch.cuda.CUDAGraph``'s counterpart: a ``torch.accelerator.Graph`` whose
    ``capture_begin`` takes the pool and capture mode as CUDA's does."""

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.graph_pool, self.capture_error_mode = pool, capture_error_mode
        super().capture_begin()


def graph_pool_handle():
    """An opaque pool token, as ``torch.cuda.graph_pool_handle()``: graphs given the same
    token share their pool."""
    return (0, next(_pool_ids))


def is_current_stream_capturing() -> bool:
    """Whether a graph is capturing on the current neuron stream (``torch.cuda``'s name)."""
    s = torch.accelerator.current_stream()
    return s.device.type == "neuron" and _C._is_capturing(s.device_index, s.stream_id)


class graph:
    """``torch.cuda.graph``'s counterpart: captures into ``neuron_graph`` on ``stream``, or
    on a side stream of the graph's own when none is given, as CUDA's does."""

    _side_stream = None

    def __init__(self, neuron_graph, pool=None, stream=None, capture_error_mode="global"):
        if capture_error_mode not in _MODES:
            raise ValueError(f"capture_error_mode must be one of {_MODES}, got {capture_error_mode!r}")
        if stream is None:
            if graph._side_stream is None:
                graph._side_stream = torch.neuron.Stream()
            stream = graph._side_stream
        self.graph, self.pool, self.mode = neuron_graph, pool, capture_error_mode
        self.stream_ctx = torch.neuron.stream(stream)

    def __enter__(self):
        torch.neuron.synchronize()
        torch.neuron.empty_cache()
        self.stream_ctx.__enter__()
        self.graph.graph_pool, self.graph.capture_error_mode = self.pool, self.mode
        torch.accelerator.Graph.capture_begin(self.graph)

    def __exit__(self, *exc):
        self.graph.capture_end()
        self.stream_ctx.__exit__(*exc)

