"""Index objects of ``nki.language``: ``nl.ds(start, size)`` slices and ``nl.arange`` affine
indices, which tensors accept as subscripts."""
from __future__ import annotations


class _DynSlice:
    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start, self.size = int(start), int(size)


class _Arange:
    """An affine index (start + step * i) usable to index one tensor axis."""

    __slots__ = ("start", "stop", "step")

    def __init__(self, start, stop, step=1):
        self.start, self.stop, self.step = int(start), int(stop), int(step)

    def as_slice(self):
        return slice(self.start, self.stop, self.step if self.step != 1 else None)

    def __getitem__(self, idx):           # nl.arange(n)[:, None] keeps the same index
        return self

    def __add__(self, k):
        return _Arange(self.start + int(k), self.stop + int(k), self.step)

    __radd__ = __add__

    def __sub__(self, k):
        return self + (-int(k))

    def __mul__(self, k):
        k = int(k)
        return _Arange(self.start * k, self.start * k + (self.stop - self.start) * k, self.step * k)

    __rmul__ = __mul__

    @property
    def shape(self):
        return (len(range(self.start, self.stop, self.step)),)
