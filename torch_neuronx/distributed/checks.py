"""Argument checks of the neuron process group's collectives: each names the op, the rank,
the group and what is wrong, before any rank talks to another (NCCL-like errors, never a hang)."""
from __future__ import annotations

import torch


# Names by dtype: each collective describes its call for the peer agreement, and str() of
# torch's dtypes costs more than the rest of that description.
_DTYPE_NAMES: dict = {}


def describe(t: torch.Tensor) -> str:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
    return f"{name}{list(t.shape)}"


def count(t: torch.Tensor) -> str:
    """A tensor as NCCL sees it in a collective: dtype and element count (``float32[12]``).
    Peers agree on this, not on shapes: NCCL moves ``numel`` elements, whatever the shape."""
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
    return f"{name}[{t.numel()}]"


def same_dtype(op: str, tensors, like: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != like.dtype:
            raise TypeError(f"neuron backend: {op} tensors must share one dtype: got {t.dtype} "
                            f"and {like.dtype}")


def tensors(pg, op: str, tensors) -> str:
    """All tensors of one call on one device this group serves; return its type."""
    kind = None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"neuron backend: {op} expects tensors, got {type(t).__name__}")
        dev = t.device
        if dev.type not in ("neuron", "cpu"):
            raise RuntimeError(
                f"neuron backend: {op} got a tensor on {dev}; the neuron process group "
                "serves neuron and cpu tensors (move it with .to('neuron'))")
        if dev.type == "neuron" and dev.index != pg._device_index:
            raise RuntimeError(
                f"neuron backend: {op} got a tensor on {dev}, but rank {pg.rank()} of "
                f"group {pg._group_name!r} communicates from neuron:{pg._device_index}; "
                f"use tensors on neuron:{pg._device_index} (torchrun binds "
                "neuron:LOCAL_RANK; call torch.neuron.set_device before init_process_group "
                "to choose another)")
        if t.layout != torch.strided:
            raise RuntimeError(f"neuron backend: {op} supports dense tensors only, got {t.layout}")
        if kind is None:
            kind = dev.type
        elif kind != dev.type:
            raise RuntimeError(
                f"neuron backend: {op} mixes {kind} and {dev.type} tensors; all tensors of "
                "one collective must be on the same device")
    return kind or "cpu"

def root(pg, op: str, root: int) -> None:
    if not 0 <= root < pg.size():
        raise ValueError(f"neuron backend: {op} root rank {root} is not in group "
                         f"{pg._group_name!r} of size {pg.size()}")

def peer(pg, op: str, peer: int) -> None:
    if not 0 <= peer < pg.size():
        raise ValueError(f"neuron backend: {op} peer rank {peer} is not in group "
                         f"{pg._group_name!r} of size {pg.size()}")

def root_lists(pg, op: str, root: int, lists, flat, like, role: str, other: str) -> None:
    # gather/scatter: only the root passes the per-rank list, whose tensors match `like`.
    if pg.rank() != root:
        if flat:
            raise ValueError(f"neuron backend: {op}: only the root (rank {root}) passes a "
                             f"{op}_list")
        return
    for lst in lists:
        list_len(pg, op, lst)
        for t in lst:
            if t.shape != like.shape or t.dtype != like.dtype:
                raise ValueError(f"neuron backend: {op} {role} {describe(t)} does not "
                                 f"match the {other} {describe(like)}")

def list_len(pg, op: str, lst) -> None:
    if len(lst) != pg.size():
        raise ValueError(f"neuron backend: {op} needs a list of group size ({pg.size()}) "
                         f"tensors, got {len(lst)}")
