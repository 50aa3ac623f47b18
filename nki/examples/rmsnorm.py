"""RMSNorm of x[R, D] with weight w[1, D]: y = x / sqrt(mean(x^2) + eps) * w."""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def rmsnorm_kernel(x, w, eps=1e-6):
    R, D = x.shape
    P = nl.tile_size.pmax
    out = nl.ndarray((R, D), dtype=x.dtype, buffer=nl.shared_hbm)
    wt = nl.ndarray((P, D), dtype=w.dtype, buffer=nl.sbuf)
    for p in range(P):        # replicate the weight row to every partition with DMA
        nisa.dma_copy(dst=wt[p:p + 1, :], src=w[0:1, :])
    for r in range(R // P):
        t = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r * P:(r + 1) * P, :])
        sq = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
        ss = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq, op=nl.square, data=t, reduce_op=nl.add, reduce_res=ss)
        rs = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=rs, data=ss, op0=nl.multiply, operand0=1.0 / D, op1=nl.add, operand1=eps)
        nisa.activation(dst=rs, op=nl.rsqrt, data=rs)
        y = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=y, data=t, op0=nl.multiply, operand0=rs, op1=nl.multiply, operand1=wt)
        nisa.dma_copy(dst=out[r * P:(r + 1) * P, :], src=y)
    return out


@nki.jit
def rmsnorm_language(x, w, eps=1e-6):
    R, D = x.shape
    P = nl.tile_size.pmax
    out = nl.ndarray((R, D), dtype=x.dtype, buffer=nl.shared_hbm)
    wt = nl.load(w)
    for r in range(R // P):
        t = nl.load(x[r * P:(r + 1) * P, :])
        nl.store(out[r * P:(r + 1) * P, :], nl.rms_norm(t, wt, axis=1, n=D, epsilon=eps))
    return out
