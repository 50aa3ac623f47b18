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


def _to_meta(x):
    if isinstance(x, torch.Tensor) and x.device.type == "neuron":
        base = torch.empty(x.untyped_storage().nbytes() // x.element_size() + 1, dtype=x.dtype,
                           device="meta")
        return base.as_strided(x.shape, x.stride(), x.storage_offset())
    if isinstance(x, torch.device) and x.type == "neuron":
        return torch.device("meta")
    return x


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
        margs, mkwargs = tree_map(_to_meta, (args, kwargs))
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


def make_graphed_callables(callables, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           pool=None):
    """``torch.cuda.make_graphed_callables`` for neuron: each callable (a function or an
    ``nn.Module``) comes back with its forward captured as one graph and its backward as
    another, run by a single autograd node. Inputs are copied into the captured (static) ones
    at each call, outputs are the static outputs, detached. A module's forward is replaced
    while it is in training mode, as CUDA's does; in eval mode it runs eagerly."""
    from torch.utils._pytree import tree_unflatten
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    if len(callables) != len(sample_args):
        raise ValueError(f"make_graphed_callables: {len(callables)} callables but "
                         f"{len(sample_args)} tuples of sample args")
    pool = graph_pool_handle() if pool is None else pool
    out = []
    for fn, args in zip(callables, sample_args):
        args = tuple(args)
        if not all(isinstance(a, torch.Tensor) for a in args):
            raise TypeError("make_graphed_callables: sample_args may hold only Tensors, got "
                            f"{[type(a).__name__ for a in args]}")
        params = ()
        if isinstance(fn, torch.nn.Module):
            if fn._backward_hooks or fn._forward_hooks or fn._forward_pre_hooks:
                raise RuntimeError("make_graphed_callables: modules must not have hooks registered "
                                   "when they are graphed (the hooks would run only at capture)")
            bad = [n for n, b in fn.named_buffers() if b.requires_grad]
            if bad:
                raise RuntimeError(f"make_graphed_callables: buffers {bad} require grad; in a "
                                   "graphed module only parameters may be trainable")
            params = tuple(p for p in fn.parameters() if p.requires_grad)
        out.append(_graph_one(fn, args, params, num_warmup_iters, allow_unused_input, pool,
                              tree_unflatten))
    return out[0] if single else tuple(out)


def _graph_one(fn, args, params, warmup, allow_unused, pool, tree_unflatten):
    inputs = args + params
    needs = [t for t in inputs if t.requires_grad]

    def grads_of(outs, grad_outs):
        diff = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad]
        return torch.autograd.grad([o for o, _ in diff], needs, grad_outputs=[g for _, g in diff],
                                   only_inputs=True, allow_unused=allow_unused)

    side = torch.neuron.Stream()
    side.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(side):  # warm-up: lazy state built before capture, as on CUDA
        for _ in range(warmup):
            outs = tree_flatten(fn(*args))[0]
            if needs:
                grads_of(outs, [torch.empty_like(o) for o in outs])
    torch.neuron.current_stream().wait_stream(side)

    fwd = NeuronGraph()
    with graph(fwd, pool=pool):
        static_out = fn(*args)
    flat_out, spec = tree_flatten(static_out)
    static_grad_out = [torch.empty_like(o) if o.requires_grad else None for o in flat_out]
    bwd = NeuronGraph()
    with graph(bwd, pool=pool):
        grads = grads_of(flat_out, static_grad_out) if needs else ()
    it = iter(grads)
    static_grad_in = [next(it) if t.requires_grad else None for t in inputs]
    n_args = len(args)

    class _Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *given):
            for static, new in zip(args, given[:n_args]):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
            fwd.replay()
            return tuple(o.detach() for o in flat_out)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grad_outs):
            for static, g in zip(static_grad_out, grad_outs):
                if static is not None:
                    if g is None:
                        static.zero_()
                    elif static.data_ptr() != g.data_ptr():
                        static.copy_(g)
            bwd.replay()
            return tuple(g.detach() if g is not None else None for g in static_grad_in)

    def graphed(*user_args):
        if len(user_args) != n_args:
            raise TypeError(f"graphed callable takes {n_args} tensor arguments, got {len(user_args)}")
        return tree_unflatten(list(_Graphed.apply(*(tuple(user_args) + params))), spec)

    if isinstance(fn, torch.nn.Module):
        eager_forward = fn.forward

        def forward(*user_args):
            return graphed(*user_args) if fn.training else eager_forward(*user_args)
        fn.forward = forward
        return fn
    return graphed
