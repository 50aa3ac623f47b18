"""A fused causal attention block for one head.

qT[d, S] and kT[d, S] arrive transposed (head dim on partitions), v[S, d]; S is a multiple of
128 up to 512, d <= 128. Scores, the causal mask, softmax and the PV product stay on chip.
"""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def attention_kernel(qT, kT, v, causal=True):
    d, S = qT.shape
    P = nl.tile_size.pmax
    scale = 1.0 / float(d) ** 0.5
    out = nl.ndarray((S, d), dtype=v.dtype, buffer=nl.shared_hbm)
    q_sb = nl.ndarray((d, S), dtype=qT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=qT)
    k_sb = nl.ndarray((d, S), dtype=kT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=k_sb, src=kT)
    v_sb = nl.ndarray((P, S // P, d), dtype=v.dtype, buffer=nl.sbuf)
    for j in range(S // P):
        nisa.dma_copy(dst=v_sb[:, j, :], src=v[j * P:(j + 1) * P, :])
    for i in range(S // P):
        # scores[i-block rows, all keys] = q_i . k
        s_ps = nl.ndarray((P, S), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=s_ps, stationary=q_sb[:, i * P:(i + 1) * P], moving=k_sb)
        s = nl.ndarray((P, S), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=s, data=s_ps, op0=nl.multiply, operand0=scale)
        if causal:
            # keep key j for query row p of block i when (i*P + p) - j >= 0
            nisa.affine_select(dst=s, pattern=[[-1, S]], offset=i * P, channel_multiplier=1,
                               on_true_tile=s, on_false_value=-3.0e38, cmp_op=nl.greater_equal)
        neg_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.max, data=s, axis=1, negate=True)
        p = nl.ndarray((P, S), dtype=v.dtype, buffer=nl.sbuf)
        total = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=p, op=nl.exp, data=s, bias=neg_max, reduce_op=nl.add, reduce_res=total)
        inv = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=total)
        # out_i = P_i @ V: transpose each 128-key block of P so keys sit on partitions
        o_ps = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
        for j in range(S // P):
            pt_ps = nl.ndarray((P, P), dtype=p.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=pt_ps, data=p[:, j * P:(j + 1) * P])
            pt = nl.ndarray((P, P), dtype=p.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pt, src=pt_ps)
            nisa.nc_matmul(dst=o_ps, stationary=pt, moving=v_sb[:, j, :], accumulate=(j > 0))
        o = nl.ndarray((P, d), dtype=v.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o, data=o_ps, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[i * P:(i + 1) * P, :], src=o)
    return out
