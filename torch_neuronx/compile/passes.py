"""FX passes of the neuron backend.

- ``check_graph``: Dynamo-level validation; constructs the device cannot compile raise an
  error naming the op and the user's source line.
- ``lower_flex_attention``: FlexAttention calls become Neuron's block-sparse attention ops
  (``flex.py``), forward and backward.
- ``NeuronPostGradPass``: Inductor's post-grad hook (ATen level, after decompositions);
  validates the ATen graph the code generator will see, and keys the compile cache on the
  neuron backend version.
- ``explain_failure``: turns an Inductor failure into an error naming the op and line.
- ``report_recompile``: warns on recompilation storms with the guard that failed.
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings

import torch

from .. import __version__

aten = torch.ops.aten


class NeuronCompileError(RuntimeError):
    """A graph could not be compiled for neuron."""


def _source_line(node) -> str:
    """The innermost user frame of an FX node's stack trace, as 'file:line in fn'."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines() if node is not None else []
    frames = [ln.strip() for ln in trace if ln.strip().startswith("File ")]
    if not frames:
        return "<unknown source line>"
    last = frames[-1]
    code = ""
    idx = trace.index(next(ln for ln in trace if ln.strip() == last))
    if idx + 1 < len(trace) and not trace[idx + 1].strip().startswith("File "):
        code = ": " + trace[idx + 1].strip()
    return last.replace("File ", "", 1) + code


# (id of a Dynamo graph, node name) -> that node's user source line, for naming compiled
# kernels in the device's error reports. Bounded: old graphs' lines are dropped.
_lines: dict = {}
_LINES_KEPT = 20000


def note_source_lines(gm: torch.fx.GraphModule) -> None:
    """Remember the user source line of each node of a Dynamo graph about to compile."""
    if len(_lines) > _LINES_KEPT:
        _lines.clear()
    gid = id(gm.graph)
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and \
                node.meta.get("stack_trace"):
            _lines[(gid, node.name)] = _source_line(node)


def source_line_of(node) -> str | None:
    """The user source line an ATen-graph node came from (via its provenance), if known."""
    if node.meta.get("stack_trace"):
        return _source_line(node)
    chain = node.meta.get("from_node") or []
    while chain:
        src = chain[-1]
        where = _lines.get((src.graph_id, src.name))
        if where:
            return where
        chain = src.from_node
    return None


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)   # "aten.foo.default"
    return getattr(target, "__name__", str(target))


# Inputs the generated C++ kernels cannot address: they take dense strided host memory.
def _unsupported_value(val) -> str | None:
    if isinstance(val, torch.Tensor):
        if val.layout != torch.strided:
            return f"a {val.layout} tensor"
        if val.device.type == "neuron" and val.dtype in (torch.complex32,):
            return f"dtype {val.dtype}"
    return None


def check_graph(gm: torch.fx.GraphModule) -> None:
    """Raise ``NeuronCompileError`` naming op and source line for what neuron can't compile."""
    for node in gm.graph.nodes:
        vals = node.meta.get("example_value")
        for v in (vals if isinstance(vals, (list, tuple)) else [vals]):
            why = _unsupported_value(v)
            if why is not None:
                what = _op_name(node.target) if node.op != "placeholder" else f"input {node.name}"
                raise NeuronCompileError(
                    f"neuron backend cannot compile {what} producing {why} "
                    f"(at {_source_line(node)}): compiled neuron graphs take dense strided "
                    "tensors of real, complex64/128, integer or bool dtypes")


def _validate_post_grad(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        for v in (val if isinstance(val, (list, tuple)) else [val]):
            why = _unsupported_value(v)
            if why is not None:
                raise NeuronCompileError(
                    f"neuron backend cannot compile {_op_name(node.target)} producing "
                    f"{why} (at {_source_line(node)})")


def _cache_uuid() -> bytes:
    # Part of the FX graph cache key: a new backend version, decomposition table or code
    # generator must not reuse graphs compiled by an older one.
    from .decompositions import table_fingerprint
    text = f"torch_neuronx {__version__} {table_fingerprint()} {_codegen_fingerprint()}"
    return hashlib.sha256(text.encode()).digest()


@functools.cache
def post_grad_pass():
    """Inductor's per-device post-grad pass for graphs on neuron (ATen level).

    Registered with ``register_backend_for_device`` so that it runs for every Inductor
    compile touching neuron (backend "neuron" or plain ``torch.compile``); its ``uuid``
    keys the persistent cache on this backend's version. (Built lazily: importing
    Inductor's pass base class at module import would import Inductor with us.)
    """
    from torch._inductor.custom_graph_pass import CustomGraphModulePass

    class NeuronPostGradPass(CustomGraphModulePass):
        def __call__(self, gm: torch.fx.GraphModule) -> None:
            _validate_post_grad(gm)

        def uuid(self) -> bytes:
            return _cache_uuid()

    return NeuronPostGradPass()


def _codegen_fingerprint() -> str:
    here = os.path.dirname(__file__)
    h = hashlib.sha256()
    for name in ("codegen.py", "cost.py", "flex.py", "decompositions.py", "host.py", "program.py"):
        path = os.path.join(here, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def lower_flex_attention(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace FlexAttention higher-order ops by Neuron's block-sparse attention ops."""
    from . import flex
    return flex.rewrite(gm)


def explain_failure(exc: BaseException, gm: torch.fx.GraphModule) -> BaseException:
    """An error naming the op and source line that failed to compile (or ``exc`` itself)."""
    if isinstance(exc, NeuronCompileError):
        return exc
    from torch._inductor.exc import LoweringException
    cur = exc
    seen = set()
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, LoweringException):
            break
        cur = cur.__cause__ or cur.__context__
    if isinstance(cur, LoweringException):
        # Inductor's message reads "<Error>: <reason>\n  target: aten.op.overload\n  args..."
        msg = str(cur)
        target = next((ln.split(":", 1)[1].strip() for ln in msg.splitlines()
                       if ln.strip().startswith("target:")), "an op")
        node = _find_node(gm, target)
        reason = msg.splitlines()[0]
        return NeuronCompileError(
            f"neuron backend cannot compile {target} (at {_source_line(node)}): {reason}")
    return exc


def _find_node(gm, target: str):
    """The Dynamo-graph node most likely to have produced ATen op ``target``."""
    short = target.split(".")[1] if target.count(".") >= 1 else target
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            name = _op_name(node.target) if node.op != "call_module" else str(node.target)
            if short in name:
                return node
    return None


# --- recompilation storms -------------------------------------------------------------
_last_reasons = threading.local()
RECOMPILE_WARN_AFTER = int(os.environ.get("TORCH_NEURONX_RECOMPILE_WARN", "4"))


def install_recompile_reasons_hook() -> None:
    """Keep the guard failures Dynamo computes for each recompilation (idempotent)."""
    from torch._dynamo import convert_frame
    inner = convert_frame.get_and_maybe_log_recompilation_reasons
    if getattr(inner, "_neuron_hook", False):
        return

    def hooked(*args, **kwargs):
        reasons = inner(*args, **kwargs)
        _last_reasons.value = list(reasons)
        return reasons

    hooked._neuron_hook = True
    convert_frame.get_and_maybe_log_recompilation_reasons = hooked


def report_recompile(gm) -> None:
    """Warn when one frame has been recompiled many times, with the guard that failed."""
    from torch._guards import CompileContext
    cid = CompileContext.current_compile_id()
    if cid is None or cid.frame_compile_id is None:
        return
    n = cid.frame_compile_id
    if n >= RECOMPILE_WARN_AFTER:
        reasons = getattr(_last_reasons, "value", None) or ["<unknown guard>"]
        warnings.warn(
            f"neuron backend: recompiling {gm.__class__.__name__} for the {n + 1}th time "
            f"(frame {cid.frame_id}); the guard that failed: {reasons[0].strip()}. "
            "Mark changing sizes dynamic (torch.compile(dynamic=True) or "
            "torch._dynamo.mark_dynamic) to avoid a recompilation storm.", stacklevel=2)

