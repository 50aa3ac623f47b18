"""``nki.isa``: one function per NeuronCore instruction, destination first (NKI 0.7).

Each instruction checks the rules AWS documents for it, computes its result as a vectorized
numpy operation on whole tiles (float32 math, then rounding to the destination dtype), and
reports its engine and cost to the simulator. Costs are AWS's published formulas in engine
cycles; clocks and fixed latencies come from the hardware profile. One module per engine.
"""
from __future__ import annotations

import warnings

from .. import errors as E
from .. import lnc
from ..simulator import context as _ctx
from ._instruction import NkiInstruction, issued  # noqa: F401
from ._dma import dma_compute, dma_copy, dma_transpose  # noqa: F401
from ._gpsimd import (  # noqa: F401
    affine_select,
    dropout,
    iota,
    local_gather,
    nc_n_gather,
    nonzero_with_count,
    rand2,
    rand_get_state,
    rand_set_state,
    range_select,
    rng,
    select_reduce,
    sequence_bounds,
    set_rng_seed,
    topk,
)
from ._registers import VirtualRegister, register_alloc, register_load, register_move, register_store  # noqa: F401
from ._scalar_engine import activate2, activation, activation_reduce  # noqa: F401
from ._statistics import bn_aggr, bn_stats, max8, nc_find_index8, nc_match_replace8  # noqa: F401
from ._tensor_engine import nc_matmul, nc_matmul_mx, nc_transpose  # noqa: F401
from ._vector_engine import (  # noqa: F401
    exponential,
    memset,
    nc_stream_shuffle,
    quantize_mx,
    reciprocal,
    scalar_tensor_tensor,
    tensor_copy,
    tensor_copy_predicated,
    tensor_partition_reduce,
    tensor_reduce,
    tensor_scalar,
    tensor_scalar_cumulative,
    tensor_scalar_reduce,
    tensor_tensor,
    tensor_tensor_scan,
)
from .constants import (  # noqa: F401
    dge_mode,
    dma_engine,
    engine,
    gpsimd_engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
    scalar_engine,
    tensor_engine,
    unknown_engine,
    vector_engine,
)


def get_nc_version():
    return nc_version[_ctx.current().profile.nki_target]


# The LNC instructions moved to nki.lnc; AWS keeps these names as deprecated wrappers.
def _deprecated(name):
    warnings.warn(f"nki.isa.{name} is deprecated; use nki.lnc.{name}", DeprecationWarning, stacklevel=3)


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    _deprecated("core_barrier")
    return lnc.core_barrier(data, cores, engine=engine, name=name)


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id=None, dma_engine=dma_engine.dma, name=None):
    """``pipe_id`` is ignored, as AWS's wrapper ignores it."""
    _deprecated("sendrecv")
    return lnc.sendrecv(src, dst, send_to_rank, recv_from_rank, dma_engine=dma_engine, name=name)


def sendrecv_compute(src, dst, send_to_rank, recv_from_rank, reduce_op, name=None):
    _deprecated("sendrecv_compute")
    return lnc.sendrecv_compute(src, dst, send_to_rank, recv_from_rank, reduce_op, name=name)


# Every operation returns the handle of what it issued (AWS: explicit scheduling edges).
for _name in ("dma_copy", "dma_transpose", "dma_compute", "iota", "affine_select", "select_reduce",
              "range_select", "local_gather", "dropout", "rng", "set_rng_seed", "nc_n_gather", "topk",
              "sequence_bounds", "nonzero_with_count", "rand_set_state", "rand_get_state", "rand2",
              "register_load", "register_store", "register_move", "activation", "activation_reduce",
              "activate2", "bn_stats", "bn_aggr", "max8", "nc_find_index8", "nc_match_replace8",
              "nc_matmul", "nc_matmul_mx", "nc_transpose", "tensor_tensor", "tensor_tensor_scan",
              "tensor_scalar", "scalar_tensor_tensor", "tensor_scalar_reduce", "tensor_reduce",
              "tensor_partition_reduce", "tensor_copy", "tensor_copy_predicated", "memset", "reciprocal",
              "exponential", "tensor_scalar_cumulative", "nc_stream_shuffle", "quantize_mx"):
    globals()[_name] = issued(globals()[_name])
del _name

# Removed by AWS in NKI 0.4.0.
_REMOVED = {"tensor_copy_dynamic_src", "tensor_copy_dynamic_dst"}


def __getattr__(name):
    if name in _REMOVED:
        raise E.UnsupportedError(f"nki.isa.{name} was removed in NKI 0.4.0; use nisa.tensor_copy with "
                                 f"an access pattern (.ap) instead")
    raise AttributeError(f"module 'nki.isa' has no attribute {name!r}")
