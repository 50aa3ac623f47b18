"""Small harness: run one instruction on loaded tiles and return the result as numpy."""
import ml_dtypes
import numpy as np

import nki
import nki.isa as nisa
import nki.language as nl

BF16 = ml_dtypes.bfloat16


def as_dtype_np(x, dtype):
    """x rounded to an NKI dtype, as a numpy array of that dtype."""
    return np.asarray(x, np.float32).astype(nl.as_dtype(dtype).real) if nl.as_dtype(dtype).is_float \
        else np.asarray(x).astype(nl.as_dtype(dtype).real)


def rounded(x, dtype):
    """Reference: float32 math rounded to dtype, back in float32."""
    return as_dtype_np(x, dtype).astype(np.float32)


def run_instr(fn, inputs, out_shape, out_dtype, out_buffer="sbuf", target=None):
    """Load inputs to SBUF, call fn(dst, *tiles), store dst; returns float32 numpy."""
    @nki.jit(platform_target=target)
    def kernel(*ins):
        tiles = []
        for t in ins:
            s = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=s, src=t)
            tiles.append(s)
        dst = nl.ndarray(out_shape, dtype=out_dtype, buffer=nl.psum if out_buffer == "psum" else nl.sbuf)
        fn(dst, *tiles)
        if out_buffer == "psum":
            sb = nl.ndarray(out_shape, dtype=out_dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=sb, src=dst)
            dst = sb
        out = nl.ndarray(out_shape, dtype=out_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=dst)
        return out
    r = kernel(*inputs)
    return np.asarray(r).astype(np.float32) if np.asarray(r).dtype.kind == "f" or r.dtype.name.startswith(("bfloat", "float")) else np.asarray(r)
