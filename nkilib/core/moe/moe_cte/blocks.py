"""Top-k routing laid out as ``moe_cte`` takes it (ours: AWS's callers build it in their
frameworks): every expert's tokens in blocks of ``block_size`` slots."""
from __future__ import annotations

import numpy as np


def routing_blocks(top_k_index, n_experts: int, block_size: int):
    """(token_position_to_id [N*B] int32, block_to_expert [N, 1] int32) for ``top_k_index``
    [T, k] (the experts each token picked): each expert's tokens in ascending order, in
    blocks of ``block_size``, the last one padded with the padding id T; experts no token
    picked get no block."""
    top = np.asarray(top_k_index)
    T = top.shape[0]
    pos, b2e = [], []
    for e in range(n_experts):
        toks = np.flatnonzero((top == e).any(axis=1)).tolist()
        for s in range(0, len(toks), block_size):
            chunk = toks[s:s + block_size]
            pos += chunk + [T] * (block_size - len(chunk))
            b2e.append(e)
    return np.array(pos, np.int32), np.array(b2e, np.int32).reshape(-1, 1)
