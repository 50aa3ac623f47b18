"""Neuron decompositions, added to Inductor's decomposition table for neuron tensors only.

Inductor decomposes matrix products whose result is an outer product (K == 1) into
element-wise code on accelerators, and those whose result is a dot product only on CPU.
On a NeuronCore a dot product (M == 1 and N == 1 per batch) would occupy one column of
TensorE's 128x128 array for a single output; as a multiply and a reduction it runs on
VectorE and fuses with its neighbours into one kernel (one launch, one HBM round trip).
Each entry wraps Inductor's own decomposition and declines (``NotImplemented``) for any
other device, so CPU and GPU compiles are unchanged.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_installed = False


def _on_neuron(*tensors) -> bool:
    return all(isinstance(t, torch.Tensor) and t.device.type == "neuron" for t in tensors)


def _known(cond) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return statically_known_true(cond)


def _mm(inner):
    def mm(self, input2, *args, **kwargs):
        if (_on_neuron(self, input2) and not args and not kwargs and _known(self.size(0) == 1)
                and _known(input2.size(-1) == 1)):
            return torch.sum(self.squeeze(0) * input2.squeeze(-1), dim=0,
                             keepdim=True).unsqueeze(0)
        return inner(self, input2, *args, **kwargs)
    return mm


def _addmm(inner):
    def addmm(self, mat1, mat2, *args, beta=1, alpha=1, **kwargs):
        if (_on_neuron(self, mat1, mat2) and not args and not kwargs
                and _known(mat1.size(0) == 1) and _known(mat2.size(-1) == 1)):
            out = torch.sum(mat1.squeeze(0) * mat2.squeeze(-1), dim=0, keepdim=True).unsqueeze(0)
            return alpha * out + beta * self
        return inner(self, mat1, mat2, *args, beta=beta, alpha=alpha, **kwargs)
    return addmm


def _bmm(inner):
    def bmm(self, batch2, *args, **kwargs):
        if (_on_neuron(self, batch2) and not args and not kwargs and _known(self.size(1) == 1)
                and _known(batch2.size(-1) == 1)):
            return torch.sum(self.squeeze(1) * batch2.squeeze(-1), dim=1,
                             keepdim=True).unsqueeze(1)
        return inner(self, batch2, *args, **kwargs)
    return bmm


_WRAPPERS = {aten.mm.default: _mm, aten.addmm.default: _addmm, aten.bmm.default: _bmm}


def install() -> None:
    """Wrap Inductor's mm/addmm/bmm decompositions with the neuron rules (idempotent)."""
    global _installed
    if _installed:
        return
    from torch._inductor import decomposition as ind

    for op, wrap in _WRAPPERS.items():
        inner = ind.decompositions.get(op)
        if inner is None:
            continue
        ind.decompositions[op] = wrap(inner)
    ind.fast_random_decomps.cache_clear()    # it caches a copy of the table
    _installed = True


def neuron_decompositions() -> dict:
    """The decomposition table compiles for neuron use (Inductor's, with the rules above)."""
    install()
    from torch._inductor.decomposition import select_decomp_table
    return select_decomp_table()


def table_fingerprint() -> str:
    """Names of the ops with neuron rules (part of the compile cache key)."""
    return ",".join(sorted(str(op) for op in _WRAPPERS))
