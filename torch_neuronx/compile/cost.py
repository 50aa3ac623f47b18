"""Modelled Trainium latency of compiled graphs.

At compile time (inside Inductor's code generation) every kernel of a graph is described by
what decides its cost on a NeuronCore:

- a fused kernel (one generated C++ loop nest = one Trainium kernel): one launch, one HBM
  round trip (each buffer it reads from or writes to HBM moves once; intermediates stay
  on chip), and its element-wise/reduction work on VectorE, transcendentals on ScalarE
  (the two engines run in parallel);
- an extern kernel (matmul, convolution, attention, any op Inductor calls as a library
  function): it runs through the eager device, whose runtime already accounts for it
  (``torch_neuronx.cost_model``), so only its estimate for the graph report is kept here,
  TensorE systolic-array cycles for matmuls.

The sizes are kept as expressions of the graph's symbolic sizes and emitted into the
generated wrapper, which calls ``charge`` each time the compiled graph runs: the modelled
time of the fused kernels is added to the device's modelled time
(``torch_neuronx.modelled_time()``), and the whole graph's time to the per-graph report
(``modelled_graph_time()``). Because the numbers live in the generated code, graphs loaded
from the persistent compile cache are costed as well.
"""
from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field

# Loop-body operations that are data movement or indexing, not engine work.
_NOT_COMPUTE = {"load", "store", "store_reduction", "index_expr", "constant", "get_index",
                "load_seed", "indirect_indexing", "masked", "check_bounds", "placeholder",
                "output", "to_dtype", "to_dtype_bitcast", "set_indirect", "bucketize",
                "frexp", "partial_accumulate", "device_assert_async", "getattr",
                "call_module", "get_attr"}
# Activation-function ops: they run on ScalarE's lookup-table pipeline.
_SCALAR_OPS = {"exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "sigmoid", "erf",
               "erfc", "erfinv", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh",
               "cosh", "asinh", "acosh", "atanh", "rsqrt", "sqrt", "pow", "gelu", "silu",
               "lgamma", "digamma", "libdevice_exp", "libdevice_log", "libdevice_sqrt",
               "libdevice_tanh", "libdevice_sigmoid", "reciprocal"}


def _kernel_list():
    from torch._inductor.virtualized import V
    graph = V.graph
    if not hasattr(graph, "_neuron_kernels"):
        graph._neuron_kernels = []
    return graph._neuron_kernels


def record_kernel_nodes(nodes) -> None:
    """Describe one fused kernel (the scheduler nodes generated into it)."""
    from torch._inductor import ir
    from torch._inductor.utils import sympy_product
    from torch._inductor.virtualized import V

    snodes = [n for s in nodes for n in s.get_nodes()]
    inside = {b.get_name() for s in snodes for b in s.get_outputs()}
    vec_ops = sca_ops = 0
    for s in snodes:
        ranges = s.get_ranges() if hasattr(s, "get_ranges") else ((), ())
        numel = sympy_product(ranges[0]) * sympy_product(ranges[1])
        body = getattr(s, "_body", None)
        counts = getattr(body, "op_counts", None) or {}
        n_sca = sum(c for op, c in counts.items() if op in _SCALAR_OPS)
        n_vec = sum(c for op, c in counts.items() if op not in _NOT_COMPUTE
                    and op not in _SCALAR_OPS)
        if not counts:   # templates: at least one pass over the output
            n_vec = 1
        vec_ops = vec_ops + n_vec * numel
        sca_ops = sca_ops + n_sca * numel
    reads, writes = set(), set()
    for s in snodes:
        reads |= {d.name for d in s.read_writes.reads}
        writes |= {d.name for d in s.read_writes.writes}
    nbytes = 0
    scheduler = V.graph.scheduler
    for name in (reads - inside) | writes:
        if name in writes and name in inside:
            # Written inside the kernel: it reaches HBM only if something outside reads it.
            sbuf = scheduler.name_to_buf.get(name) if scheduler is not None else None
            users = {u.node for u in sbuf.users} if sbuf is not None else {None}
            if users and users <= set(snodes):
                continue
        buf = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
        if buf is None or isinstance(getattr(buf, "layout", None), (ir.NoneLayout,
                                                                     ir.MultiOutputLayout)):
            continue
        try:
            nbytes = nbytes + sympy_product(buf.get_size()) * buf.get_dtype().itemsize
        except (AttributeError, NotImplementedError):
            continue
    _kernel_list().append(("kernel", vec_ops, sca_ops, nbytes))


def _extern_entries(graph):
    """(op, [input sizes...], itemsize) of each extern kernel of the graph, for the report."""
    from torch._inductor import ir
    from torch._inductor.scheduler import ExternKernelSchedulerNode
    out = []
    for s in getattr(graph.scheduler, "nodes", None) or []:
        if not isinstance(s, ExternKernelSchedulerNode):
            continue
        node = s.node
        name = (getattr(node, "python_kernel_name", None) or "").rsplit(".", 1)[-1]
        op = getattr(node, "op_overload", None)
        if op is not None:
            name = op._opname if hasattr(op, "_opname") else str(op)
        shapes = []
        for inp in getattr(node, "inputs", []):
            if isinstance(inp, (ir.IRNode,)) and hasattr(inp, "get_size"):
                try:
                    shapes.append(list(inp.get_size()))
                except Exception:  # noqa: BLE001 - non-tensor inputs have no size
                    continue
        try:
            itemsize = node.get_dtype().itemsize
        except Exception:  # noqa: BLE001 - multi-output nodes
            itemsize = 4
        out.append((name, shapes, itemsize))
    return out


def wrapper_cost_expr(index: int | None = None) -> str | None:
    """A line of Python for the generated ``call()``: charges this graph's modelled cost.

    ``index``: the neuron device charged (default: the graph's device).
    """
    import sympy
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    graph = V.graph
    bound = set()
    for value in graph.graph_inputs.values():
        if isinstance(value, sympy.Symbol):
            bound.add(value)
        elif isinstance(value, ir.TensorBox):
            for e in (*value.get_size(), *value.get_stride()):
                if isinstance(e, sympy.Symbol):
                    bound.add(e)

    def py(expr) -> str:
        expr = sympy.sympify(expr)
        if not expr.free_symbols:
            return str(int(expr))
        if expr.free_symbols <= bound:
            return f"({graph.wrapper_code.codegen_python_sizevar(expr)})"
        return str(int(graph.sizevars.optimization_hint(expr, fallback=1)))

    kernels = [f"({py(v)}, {py(s)}, {py(b)})" for _, v, s, b in getattr(graph, "_neuron_kernels", [])]
    externs = [f"({name!r}, ({''.join('(' + ''.join(py(d) + ', ' for d in sh) + '), ' for sh in shapes)}), {isz})"
               for name, shapes, isz in _extern_entries(graph)]
    if not kernels and not externs:
        return None
    if index is None:
        index = graph.get_current_device_or_throw().index or 0
    name = getattr(graph, "name", None) or "graph"
    phase = graph.get_training_phase() if hasattr(graph, "get_training_phase") else ""
    return (f"_neuron_cost.charge({index}, {phase!r}, ({''.join(k + ', ' for k in kernels)}), "
            f"({''.join(e + ', ' for e in externs)}))")


@dataclass
class GraphTime:
    """Modelled time of compiled graphs run since the last reset."""
    platform: str
    seconds: float = 0.0            # whole graphs: fused kernels + extern kernels
    kernel_seconds: float = 0.0     # the fused kernels alone
    extern_seconds: float = 0.0     # extern kernels (matmuls, library calls)
    launches: int = 0
    hbm_bytes: float = 0.0
    runs: int = 0
    by_phase: dict = field(default_factory=lambda: defaultdict(float))

    def __str__(self):
        phases = ", ".join(f"{k or 'graph'} {v * 1e3:.3f} ms" for k, v in self.by_phase.items())
        return (f"modelled {self.platform} compiled time: {self.seconds * 1e3:.3f} ms over "
                f"{self.runs} graph runs, {self.launches} launches "
                f"({self.hbm_bytes / 1e6:.1f} MB HBM; {phases})")


_lock = threading.Lock()
_graph_totals: dict = {}


# Loop-body operations per engine instruction: VectorE's tensor_scalar applies two ALU ops
# per element in one pass, ScalarE's activation computes func(x * scale + bias).
_OPS_PER_INSTRUCTION = 2


def _fused_seconds(p, lnc, vec, sca, nbytes):
    vector = vec / _OPS_PER_INSTRUCTION / (p.vector_lanes * p.vector_clock * lnc)
    scalar = sca / (p.vector_lanes * p.scalar_clock * lnc)
    hbm = nbytes / p.core_hbm_bandwidth(lnc)
    return p.launch_overhead_ns * 1e-9 + max(vector, scalar, hbm)


def _extern_seconds(p, lnc, name, shapes, itemsize):
    from .. import cost_model
    import torch
    base = name.split(".")[0]
    dims = cost_model._matmul_dims(base, [tuple(s) for s in shapes])
    nbytes = sum(math.prod(s) for s in shapes) * itemsize
    hbm = nbytes / p.core_hbm_bandwidth(lnc)
    if base in cost_model._TENSORE and dims is not None:
        dtype = {2: torch.bfloat16, 1: torch.float8_e4m3fn}.get(itemsize, torch.float32)
        compute = cost_model._tensore_seconds(p, dims, dtype, lnc)
    else:
        compute = (nbytes / max(itemsize, 1)) / (p.vector_lanes * p.vector_clock * lnc)
    return p.launch_overhead_ns * 1e-9 + max(compute, hbm), nbytes


_costs: dict = {}


def _graph_cost(p, lnc, kernels, externs):
    # Keyed on the profile's identity: hashing the frozen profile dataclass on every call
    # would cost more than the sum it saves.
    key = (id(p), lnc, kernels, externs)
    got = _costs.get(key)
    if got is None:
        if len(_costs) > 4096:
            _costs.clear()
        got = _costs[key] = _graph_cost_uncached(p, lnc, kernels, externs)
    return got


def _graph_cost_uncached(p, lnc, kernels, externs):
    k_sec = 0.0
    k_bytes = 0
    for vec, sca, nbytes in kernels:
        k_sec += _fused_seconds(p, lnc, vec, sca, nbytes)
        k_bytes += nbytes
    e_sec = 0.0
    e_bytes = 0
    for name, shapes, itemsize in externs:
        s, b = _extern_seconds(p, lnc, name, shapes, itemsize)
        e_sec += s
        e_bytes += b
    return k_sec, k_bytes, e_sec, e_bytes


def charge(device: int, phase: str, kernels, externs) -> None:
    """Called by generated code on every run of a compiled graph.

    ``kernels``/``externs`` are tuples (hashable): the cost of one graph at one set of
    sizes is computed once, a run only adds it up (it is on every compiled call's path).
    """
    from .. import _state, cost_model
    cfg = _state.config()
    p, lnc = cfg.profile, cfg.lnc
    try:
        k_sec, k_bytes, e_sec, e_bytes = _graph_cost(p, lnc, kernels, externs)
    except TypeError:   # lists, from code generated before the arguments became tuples
        k_sec, k_bytes, e_sec, e_bytes = _graph_cost_uncached(p, lnc, kernels, externs)
    with _lock:
        g = _graph_totals.get(device)
        if g is None:
            g = _graph_totals[device] = GraphTime(platform=p.name)
        g.seconds += k_sec + e_sec
        g.kernel_seconds += k_sec
        g.extern_seconds += e_sec
        g.launches += len(kernels) + len(externs)
        g.hbm_bytes += k_bytes + e_bytes
        g.runs += 1
        g.by_phase[phase] += k_sec + e_sec
        if kernels:
            # Extern kernels execute through the eager runtime, which already counts them;
            # the fused kernels are invisible to it, so they are added here.
            cost_model._add_time(device, "compiled_kernel", k_sec, engine="fused",
                                 launches=len(kernels), hbm_bytes=int(k_bytes))


def modelled_graph_time(device=None, reset: bool = False) -> GraphTime:
    """Modelled Trainium time of the compiled graphs run on ``device`` since the last reset.

    Each run of a compiled graph (forward or backward) adds its fused kernels (one launch and
    one HBM round trip each) and its extern kernels (matmuls on TensorE). The fused kernels
    also add into ``torch_neuronx.modelled_time()``, next to the eager ops.
    """
    from .. import _state
    from ..neuron import _index
    idx = _index(device)
    with _lock:
        g = _graph_totals.get(idx) or GraphTime(platform=_state.config().profile.name)
        if reset:
            _graph_totals.pop(idx, None)
    return g


def reset_modelled_graph_time(device=None) -> None:
    """Forget the accumulated compiled-graph time (of one device, or all when None)."""
    from ..neuron import _index
    with _lock:
        if device is None:
            _graph_totals.clear()
        else:
            _graph_totals.pop(_index(device), None)
