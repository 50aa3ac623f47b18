"""Fused-kernel code generation for the neuron device.

Device memory of the virtual NeuronCore is host memory, so the kernels Inductor's C++ (CPU)
backend generates can read and write neuron buffers in place: a neuron tensor's
``data_ptr()`` is a host address. This module plugs that code generator into Inductor for
the ``neuron`` device:

- ``NeuronScheduling``: Inductor's ``CppScheduling`` (loop fusion, vectorisation, OpenMP),
  which also records for every fused kernel what it costs on Trainium (``cost.py``);
- ``NeuronWrapperCodegen``: the Python wrapper that allocates neuron buffers and launches
  the kernels, calling them as CPU kernels (no copy to CPU: the pointers are the device
  buffers), and which tells the cost model each time the compiled graph runs;
- ``register()``: makes Inductor use both for ``neuron`` (idempotent).

"""
from __future__ import annotations

import functools
import threading

import torch

_DEVICE = "neuron"


def _patch_inductor_host_checks() -> None:
    """Make Inductor's "is this the C++ host backend?" questions answer yes for neuron.

    Inductor asks ``device.type == "cpu"`` in places that really mean "the code generator is
    C++ on host memory" (fusion legality, which ops-handler dialect to use, reduction
    thresholds). For neuron the answer is the same as for CPU, so those few predicates
    are widened; everything else (devices of buffers, allocation) stays ``neuron``.
    """
    import sys

    from torch._inductor import config, ir, scheduler, utils

    if getattr(utils.get_current_backend, "_neuron", False):
        return
    inner_backend = utils.get_current_backend

    def get_current_backend(device_type=None):
        from torch._inductor.virtualized import V
        if not device_type:
            device_type = V.graph.get_current_device_or_throw().type
        if device_type == _DEVICE:
            return config.cpu_backend
        return inner_backend(device_type)

    get_current_backend._neuron = True
    for name in ("torch._inductor.utils", "torch._inductor.codegen.common",
                 "torch._inductor.scheduler", "torch._inductor.kernel.mm_common"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "get_current_backend", None) is inner_backend:
            mod.get_current_backend = get_current_backend

    inner_is_cpu = ir.is_cpu

    def is_cpu(x) -> bool:
        return inner_is_cpu(x) or ir.get_device_type(x) == _DEVICE

    ir.is_cpu = is_cpu

    def node_is_cpu(self) -> bool:
        device = self.get_device()
        return device is not None and device.type in ("cpu", _DEVICE)

    scheduler.BaseSchedulerNode.is_cpu = node_is_cpu

    # Scatter-add: for C++ code Inductor falls back to ATen's scatter_reduce_ only when the
    # source is on "cpu" (its atomic-add loop can index a transposed tile wrongly: a
    # DeBERTa backward compiled on the neuron device wrote out of bounds). Neuron's kernels
    # are the same C++, so the CPU rule applies.
    inner_fallback = utils.use_scatter_fallback

    def use_scatter_fallback(op_overload, reduction_type, self_dtype, src_dtype,
                             src_device_type, src_is_tensor):
        if src_device_type == _DEVICE:
            src_device_type = "cpu"
        return inner_fallback(op_overload, reduction_type, self_dtype, src_dtype,
                              src_device_type, src_is_tensor)

    for name in ("torch._inductor.utils", "torch._inductor.lowering",
                 "torch._inductor.decomposition"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "use_scatter_fallback", None) is inner_fallback:
            mod.use_scatter_fallback = use_scatter_fallback


def _arg_kinds(arg_types) -> str | None:
    """'r'/'w'/'i' per kernel argument (read pointer, written pointer, int64), else None."""
    if not arg_types:
        return None
    kinds = []
    for t in arg_types:
        t = str(t).strip()
        if t.endswith("*"):
            kinds.append("r" if t.startswith("const ") else "w")
        elif t.replace("const ", "").strip() in ("int64_t", "long", "int64_t&"):
            kinds.append("i")
        else:
            return None
    return "".join(kinds)


def _user_line(nodes) -> str | None:
    """The user's source line of the first FX node fused into a kernel that has one.

    Nodes of the ATen graphs Inductor compiles carry no stack trace; their provenance
    (``from_node``) leads back to the Dynamo graph's nodes, whose lines the backend noted
    (``passes.note_source_lines``).
    """
    from .passes import source_line_of
    for snode in nodes:
        for n in snode.get_nodes():
            origins = getattr(getattr(n, "node", None), "origins", None) or ()
            for fx_node in sorted(origins, key=lambda o: o.name):
                where = source_line_of(fx_node)
                if where:
                    return where
    return None


# csrc/aten/compiled.cpp launches kernels of at most this many arguments (foreach kernels
# over hundreds of tensors have more: they run on the host after a synchronisation).
_MAX_QUEUED_ARGS = 512
_entries: dict = {}
# The neuron device whose graph compiles as a host graph on this thread (host.py).
_host = threading.local()


def kernel_entry(kernel) -> int:
    """The address of an Inductor C++ kernel's ``extern "C" kernel`` function."""
    addr = _entries.get(kernel)
    if addr is None:
        import ctypes
        path = getattr(getattr(kernel, "__self__", None), "__file__", None)
        if path is None:
            raise RuntimeError(f"neuron: compiled kernel {kernel!r} has no shared library "
                               "to launch it from")
        addr = ctypes.cast(ctypes.CDLL(path).kernel, ctypes.c_void_p).value
        _entries[kernel] = addr
    return addr


@functools.cache
def _classes():
    # Inductor is imported only when something compiles; keep ``import torch`` fast.
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
    from torch._inductor.virtualized import V

    from . import cost

    _patch_inductor_host_checks()

    class NeuronScheduling(CppScheduling):
        """Inductor's C++ scheduling; each fused kernel is also costed for Trainium."""

        def define_kernel(self, src_code, nodes, kernel_args=None):
            # One definition per emitted kernel launch (flush or template): cost it here.
            cost.record_kernel_nodes(nodes)
            name = super().define_kernel(src_code, nodes, kernel_args)
            where = _user_line(nodes)
            if where:
                # Named in the device's error reports: the launch site is generated code.
                if not hasattr(V.graph, "_neuron_origins"):
                    V.graph._neuron_origins = {}
                V.graph._neuron_origins[name] = where
            return name

    class NeuronWrapperCodegen(PythonWrapperCodegen):
        """Python wrapper launching C++ kernels on neuron buffers (device memory = host)."""

        @staticmethod
        def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
            if is_subgraph:
                return SubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper,
                                                    partition_signatures)
            return NeuronWrapperCodegen()

        def write_header(self) -> None:
            super().write_header()
            self.header.splice("import torch_neuronx.compile.cost as _neuron_cost")
            self.header.splice("from torch_neuronx import _C as _neuron_rt")
            self.header.splice("from torch_neuronx.compile.codegen import kernel_entry as "
                               "_neuron_entry")

        def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None,
                                         triton=True, arg_types=None, **kwargs):
            device = device or V.graph.get_current_device_or_throw()
            kinds = _arg_kinds(arg_types) if device.type == _DEVICE and not triton else None
            if kinds is not None and len(kinds) == len(call_args) <= _MAX_QUEUED_ARGS:
                # The kernel is a host function over raw pointers: it goes on the current
                # stream's queue, in order with the graph's ATen ops and eager work.
                args = "".join(f", {a}" for a in call_args)
                where = getattr(V.graph, "_neuron_origins", {}).get(kernel_name)
                label = f"{kernel_name} (compiled from {where})" if where else kernel_name
                self.writeline(f"_neuron_rt._launch_kernel(_neuron_entry({kernel_name}), "
                               f"{label!r}, {kinds!r}{args})")
                return
            if device.type == _DEVICE:
                # Arguments the queue cannot take (floats, too many): run it here, once the
                # device's queue has produced its inputs.
                self.writeline("_neuron_rt._synchronize_all()")
                device = torch.device("cpu")
            super()._generate_kernel_call_helper(kernel_name, call_args, device=device,
                                                 triton=triton, arg_types=arg_types,
                                                 **kwargs)

        def generate_after_suffix(self, result) -> None:
            super().generate_after_suffix(result)
            # The graph's work is launched as a compiled graph's (its thread count:
            # docs/compile.md), also when it raises.
            result.splice('''
                _neuron_graph_call = call
                def call(args):
                    depth = _neuron_rt._enter_compiled()
                    try:
                        return _neuron_graph_call(args)
                    finally:
                        _neuron_rt._exit_compiled(depth)
                ''')

        def generate_return(self, output_refs) -> None:
            # Emitted last in call(), once every kernel is known (symbolic sizes are bound
            # by then): the graph's modelled cost is charged on every run.
            graph_cost = cost.wrapper_cost_expr(getattr(_host, "index", None))
            if graph_cost is not None:
                self.wrapper_call.writeline(graph_cost)
            super().generate_return(output_refs)

    class NeuronHostWrapperCodegen(NeuronWrapperCodegen):
        """The wrapper of a neuron graph compiled as a host graph (``host.py``).

        Inductor sees ``cpu`` everywhere; the buffers it allocates and the device arguments
        it passes to library calls are neuron ones.
        """

        @staticmethod
        def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
            if is_subgraph:
                return SubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper,
                                                    partition_signatures)
            return NeuronHostWrapperCodegen()

        # The graph's neuron device, by index: a host graph has no device guard, so a bare
        # "neuron" would allocate on whatever device is current when it runs.
        def _neuron(self):
            return torch.device(_DEVICE, getattr(_host, "index", None) or 0)

        def make_allocation(self, name, device, dtype, shape, stride, allocation_shape=None,
                            is_pinned=False):
            if device.type == "cpu":
                device = self._neuron()
            out = super().make_allocation(name, device, dtype, shape, stride,
                                          allocation_shape, is_pinned)
            return out.replace(f"device='{_DEVICE}'", f"device='{device}'")

        def val_to_arg_str(self, s, type_=None):
            if isinstance(s, torch.device) and s.type == "cpu":
                s = self._neuron()
            return super().val_to_arg_str(s, type_)

        def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None,
                                         **kwargs):
            device = device or V.graph.get_current_device_or_throw()
            if device.type == "cpu":
                device = torch.device(_DEVICE)
            super()._generate_kernel_call_helper(kernel_name, call_args, device=device,
                                                 **kwargs)

    return NeuronScheduling, NeuronWrapperCodegen, NeuronHostWrapperCodegen


def host_classes(index: int | None):
    """(scheduling, wrapper) Inductor's ``cpu`` entry uses while a host graph of neuron
    device ``index`` compiles on this thread (None: the compile has ended)."""
    _host.index = index
    scheduling, _, wrapper = _classes()
    return scheduling, wrapper


class _Forward(type):
    # Inductor wants classes (it checks isinstance(..., type) and reads class attributes
    # such as supports_caching); these stand-ins forward to the real classes, which are
    # built on first use so that registering imports nothing heavy.
    def __getattr__(cls, name):
        return getattr(_classes()[cls._index], name)


class _LazyScheduling(metaclass=_Forward):
    _index = 0

    def __new__(cls, scheduler):
        return _classes()[0](scheduler)


class _LazyWrapperCodegen(metaclass=_Forward):
    _index = 1


def register_inductor() -> None:
    """Make Inductor generate code for ``neuron`` with the classes above.

    Safe to call while ``torch._inductor.codegen.common`` is still being imported by
    someone else: only constructors are stored, the classes are built on first use.
    """
    from torch._inductor.codegen import common

    if common.get_scheduling_for_device(_DEVICE) is _LazyScheduling:
        return
    from .passes import post_grad_pass

    common.register_backend_for_device(_DEVICE, _LazyScheduling, _LazyWrapperCodegen,
                                       device_custom_pass=post_grad_pass())

    class _Overrides(common.DeviceOpOverrides):
        # Snippets Inductor's wrapper emits for device management on neuron.
        def import_get_raw_stream_as(self, name: str) -> str:
            return f"def {name}(_):\n    return 0\n"

        def set_device(self, device_idx: int) -> str:
            return f"torch.neuron.set_device({device_idx})"

        def synchronize(self) -> str:
            return "torch.neuron.synchronize()"

        def device_guard(self, device_idx: int) -> str:
            return f"torch.neuron.device({device_idx})"

        def cpp_kernel_type(self) -> str:
            return "void*"

    common.register_device_op_overrides(_DEVICE, _Overrides())


def register_dynamo() -> None:
    """Give Dynamo the neuron ``DeviceInterface`` (idempotent)."""
    from torch._dynamo.device_interface import device_interfaces, register_interface_for_device

    from .device_interface import NeuronInterface

    if device_interfaces.get(_DEVICE) is NeuronInterface:
        return
    register_interface_for_device(_DEVICE, NeuronInterface)
    for i in range(torch.neuron.device_count()):
        register_interface_for_device(f"{_DEVICE}:{i}", NeuronInterface)


def register() -> None:
    """Register the neuron device with Dynamo and Inductor (idempotent)."""
    register_dynamo()
    register_inductor()
