"""Scalar registers: loop bounds and conditions of fori_loop / while_loop."""
from __future__ import annotations

import numpy as np

from ..simulator import context as _ctx
from ..simulator import tensore as _tensore


class VirtualRegister:
    """A scalar register (loop bounds and conditions of fori_loop / while_loop)."""

    __slots__ = ("value",)

    def __init__(self, value=0):
        self.value = int(value)

    def __index__(self):
        return self.value

    __int__ = __index__

    def __repr__(self):
        return f"VirtualRegister({self.value})"


def register_alloc(x=0):
    return VirtualRegister(x.value if isinstance(x, VirtualRegister) else x)


def register_load(dst, src):
    _tensore.drain()
    sim = _ctx.current()
    if sim.timing:
        sim.tl.register_read([src.box()])
    dst.value = int(np.asarray(src.v).reshape(-1)[0])


def register_store(dst, src):
    dst.v[...] = dst.dtype.round(np.float64(src.value))


def register_move(dst, src):
    dst.value = src.value if isinstance(src, VirtualRegister) else int(src)
