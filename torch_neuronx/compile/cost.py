"""Modelled Trainium latency of compiled graphs.

At compile time (inside Inductor's code generation) every kernel of a graph is described by
what decides its cost on a NeuronCore: a fused kernel (one generated C++ loop nest) by its
element-wise/reduction work (VectorE), its transcendentals (ScalarE) and the HBM buffers it
reads and writes (intermediates stay on chip); an extern kernel (matmul, convolution, any
op Inductor calls as a library function) by its op and input sizes (TensorE for matmuls).
The kernels, in program order, with the buffers they exchange, are emitted into the
generated wrapper as expressions of the graph's symbolic sizes; each run calls ``charge``,
which times the graph as one Trainium program on the NKI engine timeline (``program.py``;
once per set of sizes) and adds it to the per-graph report (``modelled_graph_time()``).
Because the description lives in the generated code, graphs loaded from the persistent
compile cache are costed as well.
"""
from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..profiling import _lanes

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


def _invariant_counts(body) -> Counter:
    """Compute ops of a loop body that depend on no loop variable (a scale computed from a
    loaded scalar, inlined into the loop by Inductor): they run once per kernel, not per
    element, as the compiler hoists them (so would a Trainium kernel: one scalar, then a
    per-element ``tensor_scalar``)."""
    block = getattr(body, "root_block", None)
    if block is None:
        return Counter()
    loop_vars = set(getattr(body, "var_ranges", None) or ())
    varying, counts = set(), Counter()
    for node in block.graph.nodes:
        if node.op == "call_module":
            expr = body.indexing_exprs.get(node.args[0]) if node.target == "get_index" else None
            if expr is None or expr.free_symbols & loop_vars:
                varying.add(node)   # a varying index, or a masked/indirect sub-block
            continue
        if node.op != "call_method":
            continue
        if (node.target in _PER_ELEMENT
                or any(a in varying for a in node.all_input_nodes)):
            varying.add(node)
        elif node.target not in _NOT_COMPUTE:
            counts[node.target] += 1
    return counts


# Loop-body ops that run per element whatever their inputs.
_PER_ELEMENT = {"reduction", "store", "store_reduction", "load_seed", "masked", "scan", "sort",
                "partial_accumulate"}


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
        once = _invariant_counts(body) if counts else Counter()
        n_sca = sum(c - once[op] for op, c in counts.items() if op in _SCALAR_OPS)
        n_vec = sum(c - once[op] for op, c in counts.items() if op not in _NOT_COMPUTE
                    and op not in _SCALAR_OPS)
        if not counts:   # templates: at least one pass over the output
            n_vec = 1
        vec_ops = vec_ops + n_vec * numel + sum(c for op, c in once.items()
                                                if op not in _SCALAR_OPS)
        sca_ops = sca_ops + n_sca * numel + sum(c for op, c in once.items()
                                                if op in _SCALAR_OPS)
    reads, writes = set(), set()
    for s in snodes:
        reads |= {d.name for d in s.read_writes.reads}
        writes |= {d.name for d in s.read_writes.writes}
    hbm_reads, hbm_writes = [], []
    scheduler = V.graph.scheduler
    for name in sorted((reads - inside) | writes):
        if name in writes and name in inside:
            # Written inside the kernel: it reaches HBM only if something outside reads it.
            sbuf = scheduler.name_to_buf.get(name) if scheduler is not None else None
            users = {u.node for u in sbuf.users} if sbuf is not None else {None}
            if users and users <= set(snodes):
                continue
        if _buffer_bytes(name) is None:
            continue
        (hbm_writes if name in writes else hbm_reads).append(name)
    _kernel_list().append(("kernel", vec_ops, sca_ops, tuple(hbm_reads), tuple(hbm_writes),
                           frozenset(s.get_name() for s in snodes)))


def _buffer_bytes(name):
    """Bytes of a graph buffer or input (a sympy expression), None if it has no storage."""
    from torch._inductor import ir
    from torch._inductor.utils import sympy_product
    from torch._inductor.virtualized import V
    buf = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
    if buf is None or isinstance(getattr(buf, "layout", None), (ir.NoneLayout,
                                                                 ir.MultiOutputLayout)):
        return None
    try:
        return sympy_product(buf.get_size()) * buf.get_dtype().itemsize
    except (AttributeError, NotImplementedError):
        return None


def _buffer_dtype(name) -> str:
    """Name of a graph buffer's or input's dtype (as ``torch`` spells it)."""
    from torch._inductor.virtualized import V
    buf = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
    return str(buf.get_dtype()).removeprefix("torch.")


def _program(graph):
    """The graph's kernels in program order: ("kernel", vec, sca, reads, writes) and
    ("extern", op, [input sizes...], itemsize, reads, writes), reads/writes buffer names."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode
    kernels = list(getattr(graph, "_neuron_kernels", []))
    owner = {name: i for i, k in enumerate(kernels) for name in k[5]}
    externs = iter(_extern_entries(graph))
    out, seen = [], set()
    for s in getattr(graph.scheduler, "nodes", None) or []:
        if isinstance(s, ExternKernelSchedulerNode):
            name, shapes, itemsize = next(externs)
            reads = tuple(sorted(d.name for d in s.read_writes.reads
                                 if _buffer_bytes(d.name) is not None))
            writes = tuple(sorted(b.get_name() for b in s.get_outputs()
                                  if _buffer_bytes(b.get_name()) is not None))
            out.append(("extern", name, shapes, itemsize, reads, writes))
            continue
        for sub in s.get_nodes():
            i = owner.get(sub.get_name())
            if i is not None and i not in seen:
                seen.add(i)
                out.append(kernels[i][:5])
    out += [k[:5] for i, k in enumerate(kernels) if i not in seen]
    return out


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

    program = _program(graph)
    if not program:
        return None
    names: dict = {}

    def ref(names_):
        return "(" + "".join(f"{names.setdefault(n, len(names))}, " for n in names_) + ")"

    items = []
    for it in program:
        if it[0] == "kernel":
            _, v, sc, reads, writes = it
            items.append(f"('kernel', {py(v)}, {py(sc)}, {ref(reads)}, {ref(writes)})")
        else:
            _, name, shapes, isz, reads, writes = it
            sh = "(" + "".join("(" + "".join(py(d) + ", " for d in shape) + "), "
                               for shape in shapes) + ")"
            items.append(f"('extern', {name!r}, {sh}, {isz}, {ref(reads)}, {ref(writes)})")
    bufs = "(" + "".join(py(_buffer_bytes(n)) + ", " for n in names) + ")"
    # the buffers' dtypes, for cost_model.price_as
    dtypes = "(" + "".join(repr(_buffer_dtype(n)) + ", " for n in names) + ")"
    if index is None:
        index = graph.get_current_device_or_throw().index or 0
    phase = graph.get_training_phase() if hasattr(graph, "get_training_phase") else ""
    label = _graph_label(graph, phase)
    return (f"_neuron_cost.charge({index}, {phase!r}, {label!r}, {bufs}, "
            f"({''.join(i + ', ' for i in items)}), {dtypes})")


def _graph_label(graph, phase) -> str:
    """How reports name a graph: its phase and the user's line of its first kernel."""
    where = next(iter(getattr(graph, "_neuron_origins", {}).values()), None)
    return f"{phase or 'graph'} @ {where}" if where else (phase or "graph")


@dataclass
class GraphRecord:
    """One compiled graph's modelled runs."""
    runs: int = 0
    seconds: float = 0.0                 # the graph as one program, per run summed
    busy: dict = field(default_factory=lambda: defaultdict(float))   # engine -> seconds
    hbm_bytes: float = 0.0
    bound: str = ""                      # the engine (or "hbm") its time is bound by


@dataclass
class GraphTime:
    """Modelled time of compiled graphs run since the last reset.

    Each run of a graph is one program on the chip (``program.py``): one launch, engines
    overlapping under data dependencies, HBM traffic only across kernel boundaries.
    """
    platform: str
    seconds: float = 0.0            # whole graphs, each as one program
    kernel_seconds: float = 0.0     # what graphs add to torch_neuronx.modelled_time()
    extern_seconds: float = 0.0     # their extern calls, as the eager runtime charges them
    launches: int = 0
    hbm_bytes: float = 0.0
    runs: int = 0
    by_phase: dict = field(default_factory=lambda: defaultdict(float))
    by_engine: dict = field(default_factory=lambda: defaultdict(float))   # busy seconds
    by_graph: dict = field(default_factory=dict)     # label -> GraphRecord

    @property
    def bound(self) -> str:
        """The engine with the most busy time over all runs ("dma" = HBM/DMA bound)."""
        return max(self.by_engine, key=self.by_engine.get) if self.by_engine else ""

    def __str__(self):
        phases = ", ".join(f"{k or 'graph'} {v * 1e3:.3f} ms" for k, v in self.by_phase.items())
        engines = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in self.by_engine.items() if v)
        return (f"modelled {self.platform} compiled time: {self.seconds * 1e3:.3f} ms over "
                f"{self.runs} graph runs, {self.launches} launches "
                f"({self.hbm_bytes / 1e6:.1f} MB HBM; {phases}; engines busy ms: {engines})")


_lock = threading.Lock()
_graph_totals: dict = {}


_ITEMSIZE_DTYPES = {2: "bfloat16", 1: "float8_e4m3fn"}


def _dtype_of(itemsize):
    import torch
    return getattr(torch, _ITEMSIZE_DTYPES.get(itemsize, "float32"))


def _extern_seconds(p, lnc, name, shapes, itemsize):
    """What the eager runtime charges for one extern call (it runs as an eager op)."""
    from .. import cost_model
    nbytes = sum(math.prod(s) for s in shapes) * itemsize
    return cost_model.op_seconds(p, lnc, name.split(".")[0], [tuple(s) for s in shapes],
                                 _dtype_of(itemsize), nbytes, 0)[0]


def _extern_work(p, lnc, name, shapes, itemsize):
    """(TensorE seconds or None, elements it produces or passes over) of an extern call."""
    from .. import cost_model
    base = name.split(".")[0]
    dims = cost_model._matmul_dims(base, [tuple(s) for s in shapes])
    if base in cost_model._TENSORE and dims is not None:
        batch, m, _, n = dims
        return cost_model._tensore_seconds(p, dims, _dtype_of(itemsize), lnc), batch * m * n
    return None, sum(math.prod(s) for s in shapes)


_costs: dict = {}


def _graph_cost(p, lnc, bufs, items):
    # Keyed on the profile's identity: hashing the frozen profile dataclass on every call
    # would cost more than the sum it saves.
    key = (id(p), lnc, bufs, items)
    got = _costs.get(key)
    if got is None:
        if len(_costs) > 4096:
            _costs.clear()
        from .program import simulate
        prog = simulate(p, lnc, bufs, items,
                        lambda name, shapes, isz: _extern_work(p, lnc, name, shapes, isz))
        eager = sum(_extern_seconds(p, lnc, it[1], it[2], it[3]) for it in items
                    if it[0] == "extern")
        got = _costs[key] = (prog, eager)
    return got


def _priced_as(bufs, items, dtypes, source, new):
    """``bufs`` and ``items`` with the buffers in ``source`` and the library calls on
    ``source``'s itemsize as ``new`` (``cost_model.price_as``)."""
    name, scale = str(source).removeprefix("torch."), new.itemsize / source.itemsize
    bufs = tuple(round(b * scale) if d == name else b for b, d in zip(bufs, dtypes))
    items = tuple(it[:3] + (new.itemsize,) + it[4:]
                  if it[0] == "extern" and it[3] == source.itemsize else it for it in items)
    return bufs, items


def charge(device: int, phase: str, label: str, bufs, items, dtypes) -> None:
    """Called by generated code on every run of a compiled graph.

    ``bufs``: bytes of the HBM buffers its kernels exchange (``dtypes``: their dtypes'
    names); ``items``: its kernels in program order (``program.simulate``). All are tuples:
    a graph at one set of sizes is timed once, a run only adds it up (this is on every
    compiled call's path).
    """
    from .. import _state, cost_model
    cfg = _state.config()
    p, lnc = cfg.profile, cfg.lnc
    if cost_model._price_as is not None:
        bufs, items = _priced_as(bufs, items, dtypes, *cost_model._price_as)
    prog, eager = _graph_cost(p, lnc, bufs, items)
    # The extern calls run as eager ops, whose records the runtime already charges; the
    # rest of the program's time is invisible to it and is added here.
    rest = max(0.0, prog.seconds - eager)
    with _lock:
        g = _graph_totals.get(device)
        if g is None:
            g = _graph_totals[device] = GraphTime(platform=p.name)
        g.seconds += prog.seconds
        g.kernel_seconds += rest
        g.extern_seconds += eager
        g.launches += prog.launches
        g.hbm_bytes += prog.hbm_bytes
        g.runs += 1
        g.by_phase[phase] += prog.seconds
        r = g.by_graph.get(label)
        if r is None:
            r = g.by_graph[label] = GraphRecord()
        r.runs += 1
        r.seconds += prog.seconds
        r.hbm_bytes += prog.hbm_bytes
        r.bound = prog.bound
        for e, sec in prog.busy.items():
            g.by_engine[e] += sec
            r.busy[e] += sec
    if rest or _lanes._collectors:
        if _lanes._collectors:  # with extern calls the program spans more than `rest`
            _lanes._capture(device, "compiled_graph", [prog.events], prog.seconds * 1e9 if eager else 0.0)
        # Extern calls charged above the program's time leave it nothing: while a profile
        # collects, a zero-length event (no launch, no bytes) still anchors its lanes.
        cost_model._add_time(device, "compiled_graph", rest, engine="fused",
                             launches=prog.launches if rest else 0,
                             hbm_bytes=prog.hbm_bytes if rest else 0)


def modelled_graph_time(device=None, reset: bool = False) -> GraphTime:
    """Modelled Trainium time of the compiled graphs run on ``device`` since the last reset.

    Each run of a compiled graph (forward or backward) is one program on the chip: one
    launch, its kernels' instructions on TensorE/VectorE/ScalarE/GpSimd/DMA overlapping
    under data dependencies (``program.py``). ``by_graph`` holds each graph's total, engine
    busy times, HBM bytes and what bounds it. The program's time beyond its extern calls
    (which run as eager ops and are charged as such) also adds into
    ``torch_neuronx.modelled_time()`` (``by_op["compiled_graph"]``).
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
