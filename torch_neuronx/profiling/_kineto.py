"""Python's half of the Kineto plugin (csrc/profiler/kineto_plugin.cpp): the modelled
Trainium time of each traced kernel, and the work only Python sees (NKI kernels, collectives,
library kernels, compiled graphs' modelled time), which the cost model learns through
``cost_model._add_time``. Imports nothing heavy: the plugin imports it at session start."""
from __future__ import annotations

from .. import _state, cost_model

_add = None  # the plugin's recorder while a session runs


def _session_started(add) -> None:
    global _add
    _add = add
    if _listen not in cost_model._added_listeners:
        cost_model._added_listeners.append(_listen)


def _session_stopped() -> None:
    global _add
    _add = None
    if _listen in cost_model._added_listeners:
        cost_model._added_listeners.remove(_listen)


def _listen(c) -> None:
    # Only _add_time's work: the op records' the plugin traces launch by launch.
    add = _add
    if add is not None:
        add(int(c.device), c.name, c.engine, float(c.seconds), int(c.count), float(c.flops),
            int(c.hbm_bytes), int(c.link_bytes), int(c.group_size), int(c.nodes))


def _modelled(records) -> list:
    """(seconds, engine, flops, hbm_bytes) of one launch of each ``(name, device, dtype, sig,
    bytes_in, bytes_out)`` record, as ``cost_model`` charges it (its ``_account`` without
    the totals)."""
    cfg = _state.config()
    p, lnc = cfg.profile, cfg.lnc
    cache: dict = {}
    out = []
    for name, _device, dtype_code, sig, bytes_in, bytes_out in records:
        key = (name, dtype_code, tuple(sig), bytes_in, bytes_out)
        got = cache.get(key)
        if got is None:
            op = name.split("::", 1)[-1]
            if op.startswith("copy_"):
                got = (cost_model.copy_seconds(p, lnc, op, bytes_out), "dma", 0.0,
                       bytes_out if op == "copy_d2d" else 0)
            else:
                seconds, engine, flops = cost_model.op_seconds(
                    p, lnc, op, cost_model._shapes(sig), cost_model._dtype_from_code(dtype_code),
                    bytes_in, bytes_out, 1, cost_model._flags(sig))
                got = (seconds, engine, float(flops), int(bytes_in + bytes_out))
            cache[key] = got
        out.append(got)
    return out
