"""Every nki.language / nki.isa name AWS's NKI-lib uses exists here: a kernel library
written by someone else, run unchanged, is the real test of the simulator.

The names were collected from AWS's nki-library sources (every ``nl.X`` and ``nisa.X`` they
reference); names that need two NeuronCores at once must raise UnsupportedError saying so.
"""
import pytest

import nki.errors
import nki.isa as nisa
import nki.language as nl

LANGUAGE = [
    "NKIObject", "abs", "add", "affine_range", "arange", "bfloat16", "bool", "copy", "ds",
    "dtype", "dynamic_range", "equal", "exp", "float16", "float32", "float4_e2m1fn_x4",
    "float8_e4m3", "float8_e4m3fn", "float8_e4m3fn_x4", "float8_e5m2", "float8_e5m2_x4",
    "gelu", "gelu_apprx_sigmoid", "gelu_apprx_sigmoid_dx", "gelu_apprx_tanh", "greater",
    "greater_equal", "hbm", "int16", "int32", "int8", "less", "less_equal", "load", "log",
    "logical_and", "maximum", "minimum", "multiply", "ndarray", "num_programs", "par_dim",
    "private_hbm", "program_id", "program_ndim", "psum", "range", "rsqrt", "sbuf",
    "sequential_range", "shared_constant", "shared_hbm", "shared_identity_matrix", "sigmoid",
    "silu", "silu_dx", "sin", "square", "static_range", "subtract", "tensor", "tile_size",
    "uint16", "uint32", "uint8",
]
ISA = [
    "activation", "activation_reduce", "affine_select", "bn_aggr", "bn_stats", "constants",
    "core_barrier", "dge_mode", "dma_compute", "dma_copy", "dma_transpose", "engine",
    "get_nc_version", "gpsimd_engine", "iota", "local_gather", "matmul_perf_mode", "max8",
    "memset", "nc_find_index8", "nc_match_replace8", "nc_matmul", "nc_matmul_mx",
    "nc_n_gather", "nc_stream_shuffle", "nc_transpose", "nc_version", "nonzero_with_count",
    "oob_mode", "quantize_mx", "range_select", "reciprocal", "register_alloc", "register_load",
    "scalar_engine", "scalar_tensor_tensor", "sendrecv", "tensor_copy",
    "tensor_copy_predicated", "tensor_partition_reduce", "tensor_reduce", "tensor_scalar",
    "tensor_scalar_reduce", "tensor_tensor", "tensor_tensor_scan", "vector_engine",
]


@pytest.mark.parametrize("name", LANGUAGE)
def test_language_name_exists(name):
    assert getattr(nl, name) is not None


@pytest.mark.parametrize("name", ISA)
def test_isa_name_exists(name):
    assert getattr(nisa, name) is not None


def test_names_that_shadow_builtins():
    assert list(nl.range(2, 5)) == [2, 3, 4]
    assert nl.bool == nl.bool_
    assert isinstance(nl.float32, nl.dtype)
