"""Tiled matmul in three optimisation stages: result[M, N] = lhsT[K, M].T @ rhs[K, N].

TensorE contracts over the partition axis, so the left operand arrives transposed.
"""
import nki
import nki.isa as nisa
import nki.language as nl

TK, TM, TN = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax


@nki.jit
def matmul_basic(lhsT, rhs):
    """Stage 1: load both operand tiles for every (m, n, k) step."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TM):
        for n in range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            out = nl.ndarray((TM, TN), dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=acc)
            nisa.dma_copy(dst=result[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=out)
    return result


@nki.jit
def matmul_hoisted(lhsT, rhs):
    """Stage 2: load each lhsT column block once per m and reuse it for every n."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TM):
        a = nl.ndarray((TK, K // TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
        for k in range(K // TK):
            nisa.dma_copy(dst=a[:, k, :], src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
        for n in range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TK):
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a[:, k, :], moving=b)
            out = nl.ndarray((TM, TN), dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=acc)
            nisa.dma_copy(dst=result[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=out)
    return result


@nki.jit
def matmul_blocked(lhsT, rhs, block_n=2048):
    """Stage 3: keep a whole rhs column block resident in SBUF, accumulate a full row block
    of PSUM (one 512-column tile per bank) and write each row block with one DMA."""
    K, M = lhsT.shape
    _, N = rhs.shape
    BN = min(block_n, N)
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for nb in range(N // BN):
        b = nl.ndarray((TK, K // TK, BN), dtype=rhs.dtype, buffer=nl.sbuf)
        for k in range(K // TK):
            nisa.dma_copy(dst=b[:, k, :], src=rhs[k * TK:(k + 1) * TK, nb * BN:(nb + 1) * BN])
        for m in range(M // TM):
            a = nl.ndarray((TK, K // TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
            for k in range(K // TK):
                nisa.dma_copy(dst=a[:, k, :], src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
            acc = nl.ndarray((TM, BN), dtype=nl.float32, buffer=nl.psum)
            for n in range(BN // TN):
                for k in range(K // TK):
                    nisa.nc_matmul(dst=acc[:, n * TN:(n + 1) * TN], stationary=a[:, k, :],
                                   moving=b[:, k, n * TN:(n + 1) * TN])
            out = nl.ndarray((TM, BN), dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=acc)
            nisa.dma_copy(dst=result[m * TM:(m + 1) * TM, nb * BN:(nb + 1) * BN], src=out)
    return result
