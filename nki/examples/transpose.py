"""Transpose x[R, C] (multiples of 128) through TensorE, 128x128 tiles at a time."""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def transpose_kernel(x):
    R, C = x.shape
    P = nl.tile_size.pmax
    out = nl.ndarray((C, R), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in range(R // P):
        for j in range(C // P):
            t = nl.ndarray((P, P), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x[i * P:(i + 1) * P, j * P:(j + 1) * P])
            tp = nl.ndarray((P, P), dtype=x.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=tp, data=t)
            o = nl.ndarray((P, P), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o, src=tp)
            nisa.dma_copy(dst=out[j * P:(j + 1) * P, i * P:(i + 1) * P], src=o)
    return out
