"""The neuron caching allocator's events of a finished ``torch.profiler`` run
(``profile_memory=True``), read from torch's event tree: each allocation or free on the ops'
own clock and with the ops that enclose it, so no second clock has to be reconciled."""
from __future__ import annotations

from torch._C._profiler import _EventType


def allocations(prof) -> list:
    """``(ns since the trace start, device, addr, bytes, total_allocated, total_reserved,
    enclosing op ids innermost first)`` per neuron allocator event, in time order. The op ids
    are torch.profiler's (``FunctionEvent.id``); torch leaves some ops out of its
    FunctionEvents, so a caller takes the first id it knows."""
    if not getattr(prof, "profile_memory", False):
        return []
    result = prof.profiler.kineto_results
    t0 = result.trace_start_ns()
    out = []
    stack = list(result.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag != _EventType.Allocation:
            continue
        f = e.extra_fields
        if f.device.type != "neuron":
            continue
        ops, p = [], e.parent
        while p is not None:
            if p.tag == _EventType.TorchOp:
                ops.append(p.correlation_id)
            p = p.parent
        out.append((e.start_time_ns - t0, f.device.index or 0, f.ptr, f.alloc_size,
                    f.total_allocated, f.total_reserved, tuple(ops)))
    out.sort(key=lambda r: r[0])
    return out
