"""Decompositions applied to graphs compiled for neuron.

Inductor's own table (``select_decomp_table``) turns composite ATen ops into primitives
its code generator fuses. On top of it, the neuron table decomposes ops that Inductor would
otherwise call as opaque library (extern) kernels although they are element-wise or
reductions: on Trainium an extern call is a separate kernel launch with its own HBM round
trip, while a decomposed op fuses with its neighbours into one kernel.
"""
from __future__ import annotations

import functools

import torch

aten = torch.ops.aten


def _extra_ops():
    # Element-wise / reduction composites Inductor keeps as extern calls by default on CPU.
    # Each entry is (op, why); only ops with a registered core decomposition are used.
    return [
        aten._log_softmax_backward_data.default,   # fuses with the loss' backward
        aten._softmax_backward_data.default,       # fuses with the attention backward
        aten.native_layer_norm_backward.default,   # reductions + elementwise, one kernel
        aten.native_group_norm_backward.default,
        aten.embedding_dense_backward.default,     # index_put accumulate, no extern
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten.gelu_backward.default,
        aten.silu_backward.default,
        aten.mse_loss_backward.default,
    ]


@functools.cache
def neuron_decompositions() -> dict:
    """The decomposition table of the neuron backend (Inductor's plus the ops above)."""
    from torch._decomp import core_aten_decompositions, get_decompositions
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    extra = [op for op in _extra_ops() if op not in table]
    available = get_decompositions(extra)
    core = core_aten_decompositions()
    for op in extra:
        fn = available.get(op) or core.get(op)
        if fn is not None:
            table[op] = fn
    return table


def table_fingerprint() -> str:
    """Stable text naming the extra decompositions (part of the compile cache key)."""
    return ",".join(sorted(str(op) for op in neuron_decompositions()
                           if op in set(_extra_ops())))
