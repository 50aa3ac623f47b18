"""Compile a neuron graph exactly as Inductor compiles the same graph for CPU.

Device memory of the virtual NeuronCore is host memory, so the best kernels for a neuron
graph are Inductor-CPU's own. Inductor, however, takes several lowering and scheduling
decisions on ``device.type == "cpu"`` (two-pass variance instead of Welford, ``cat`` and
``stack`` as concatenation kernels rather than masked point-wise loops, no constant
division rewritten as a multiplication, the CPU matmul decompositions, no mixed-order
reductions); on any other device it takes the GPU-oriented branch, which for C++ code is
slower (up to 4x on a block of norms, rotary embedding and softmax) and rounds differently.

So each ATen graph AOTAutograd hands to Inductor is retargeted before lowering: its fake
tensors and device arguments say ``cpu``, and while it compiles, Inductor's ``cpu`` entry
uses the neuron scheduling (which costs every kernel for Trainium) and a wrapper that
allocates neuron buffers and launches the kernels on the device queue. The generated
kernels are therefore Inductor-CPU's, line for line, and the graph still takes and returns
neuron tensors. The retargeted graph is keyed apart from a genuine CPU graph in Inductor's
cache (a distinct custom-pass UUID).

Graphs that hold tensors of another device (a CPU scalar, a meta tensor), tensor constants,
or more than one neuron device are compiled on the neuron device directly (``debug`` log
says why).
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.utils._pytree as pytree

from ..kernels.dtypes import cpu_refuses

log = logging.getLogger(__name__)

_DEVICE = "neuron"


def _tensors(gm, example_inputs):
    for x in example_inputs:
        yield "input", x
    for node in gm.graph.nodes:
        for v in pytree.tree_leaves(node.meta.get("val")):
            yield node.format_node(), v


def check(gm: torch.fx.GraphModule, example_inputs) -> tuple[str | None, int]:
    """(why ``gm`` cannot be compiled as a host graph or None, its neuron device index)."""
    from torch._subclasses.fake_tensor import FakeTensor

    indices = set()
    for where, v in _tensors(gm, example_inputs):
        if not isinstance(v, torch.Tensor):
            continue
        if not isinstance(v, FakeTensor):
            return f"a real tensor reaches the compiler ({where})", 0
        if v.device.type != _DEVICE:
            return f"a {v.device.type} tensor ({where})", 0
        indices.add(v.device.index or 0)
    if len(indices) > 1:
        return f"tensors on several neuron devices {sorted(indices)}", 0
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            return f"attribute {node.target} (a tensor constant or a subgraph)", 0
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.args:
            first = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(first, torch.Tensor) and cpu_refuses(node.target._opname, first.dtype):
                return (f"{node.target} of {first.dtype}: CPU has no such kernel and the device "
                        f"computes CUDA's result", 0)
        for a in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, torch.device) and a.type != _DEVICE:
                return f"device argument {a} ({node.format_node()})", 0
    return None, (indices.pop() if indices else torch.neuron.current_device())


def to_host_graph(gm: torch.fx.GraphModule, example_inputs):
    """The same graph with every neuron fake tensor and device argument on cpu (in place)."""
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    memo: dict[int, torch.Tensor] = {}
    cpu = torch.device("cpu")

    def fake(v):
        if not isinstance(v, FakeTensor):
            return v
        got = memo.get(id(v))
        if got is None:
            # A FakeTensor over the same meta storage: sizes (symbolic ones too), strides,
            # offsets and aliasing are kept, only the device it reports changes.
            with in_kernel_invocation_manager(v.fake_mode):
                got = FakeTensor(v.fake_mode, v, cpu)
            memo[id(v)] = got
        return got

    def device_arg(a):
        return cpu if isinstance(a, torch.device) and a.type == _DEVICE else a

    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = pytree.tree_map(fake, node.meta["val"])
        node.args = pytree.tree_map(device_arg, node.args)
        node.kwargs = pytree.tree_map(device_arg, node.kwargs)
    gm.recompile()
    return gm, [fake(x) for x in example_inputs]


@functools.cache
def _host_pass():
    from torch._inductor.custom_graph_pass import CustomGraphModulePass

    from .passes import _cache_uuid, _validate_post_grad

    class NeuronHostPass(CustomGraphModulePass):
        """Post-grad validation; its UUID keeps host-compiled neuron graphs apart in the cache."""

        def __call__(self, gm: torch.fx.GraphModule) -> None:
            _validate_post_grad(gm)

        def uuid(self) -> bytes:
            # The device index is part of the key: the wrapper allocates on that device.
            from .codegen import _host
            index = getattr(_host, "index", None) or 0
            return f"neuron-host:{index}:".encode() + _cache_uuid()

    return NeuronHostPass()


@contextlib.contextmanager
def _cpu_entry_is_neuron(index: int):
    from torch._inductor.codegen import common

    from . import codegen

    common.init_backend_registration()
    saved = (common.device_codegens.get("cpu"), common.custom_backend_passes.get("cpu"),
             common.custom_backend_codegen_configs.get("cpu"))
    scheduling, wrapper = codegen.host_classes(index)
    common.device_codegens["cpu"] = common.DeviceCodegen(
        scheduling, wrapper, saved[0].cpp_wrapper_codegen, saved[0].fx_wrapper_codegen)
    common.custom_backend_passes["cpu"] = _host_pass()
    try:
        yield
    finally:
        codegen.host_classes(None)
        common.device_codegens["cpu"] = saved[0]
        common.custom_backend_passes["cpu"] = saved[1]
        common.custom_backend_codegen_configs["cpu"] = saved[2]


def inner_compile(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """``compile_fx``'s inner compiler for neuron: the graph compiled as a host graph."""
    from torch._inductor.compile_fx import compile_fx_inner

    why, index = check(gm, example_inputs)
    if why is not None:
        log.debug("neuron graph compiled on the neuron device, not as a host graph: %s", why)
        return compile_fx_inner(gm, example_inputs, **kwargs)
    gm, example_inputs = to_host_graph(gm, example_inputs)
    with _cpu_entry_is_neuron(index):
        return compile_fx_inner(gm, example_inputs, **kwargs)
