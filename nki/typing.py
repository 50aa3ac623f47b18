"""``nki.typing``: annotations for kernel signatures (``tensor[128, 512]``)."""
from __future__ import annotations

from .simulator.tensor import NkiTensor


class _TensorType:
    def __getitem__(self, shape):
        return NkiTensor


tensor = _TensorType()
scalar = float
__all__ = ["tensor", "scalar"]
