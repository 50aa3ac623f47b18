"""Tensors: a ``Buffer`` (one allocation in HBM, SBUF or PSUM) and ``NkiTensor`` views of it.

The first axis of an on-chip tensor is the partition axis. Indexing returns a view that
shares the buffer, so instructions write through to it.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from .. import errors as E
from . import rules
from .indexing import _Arange, _DynSlice
from .spaces import BUFFERS

# nki.language, which gives tiles their arithmetic (a + b is nl.add(a, b)) and assignment;
# it sits above this module and registers itself with set_language.
_language = None


def set_language(module) -> None:
    global _language
    _language = module

_ids = itertools.count()


# Storage of dead buffers, by (shape, numpy dtype), for the next allocation of that shape:
# fresh host memory page-faults on first touch, which cost more than the simulated work
# for big tiles. Bounded so a finished kernel leaves little behind.
_SPARE: dict = {}
_SPARE_LIMIT = 256 << 20
_spare_bytes = 0


def take_spare(shape, dtype, in_use=None):
    """A recycled storage of this shape and dtype, the newest one ``in_use`` (a queued GEMM
    still reads or writes it) does not claim; None if there is none."""
    global _spare_bytes
    lst = _SPARE.get((shape, dtype))
    if not lst:
        return None
    for i in range(len(lst) - 1, -1, -1):
        if in_use is None or not in_use(lst[i]):
            a = lst.pop(i)
            _spare_bytes -= a.nbytes
            return a
    return None


def _give_spare(a):
    global _spare_bytes
    if _spare_bytes + a.nbytes <= _SPARE_LIMIT:
        _SPARE.setdefault((a.shape, a.dtype), []).append(a)
        _spare_bytes += a.nbytes


class Buffer:
    __slots__ = ("kind", "dtype", "data", "name", "addr", "alloc", "ptr", "sitem",
                 "written", "groups", "origin", "recycle", "framework_tensor", "pbase",
                 "__weakref__")

    def __init__(self, kind, dtype, data, name, addr=0, alloc=None, origin=None, pbase=0):
        self.kind, self.dtype, self.data, self.name = kind, dtype, data, name
        self.addr, self.alloc, self.origin = addr, alloc, origin
        self.pbase = pbase           # first partition (a tile placed at a partition offset)
        self.ptr = data.__array_interface__["data"][0]
        self.sitem = data.itemsize
        self.written = False
        self.groups = None           # PSUM: boxes of open matmul accumulation groups
        self.recycle = False         # storage the simulator allocated (never a caller's array)
        self.framework_tensor = None  # the device tensor whose memory ``data`` views, if any

    def __del__(self):
        if self.alloc is not None:
            self.alloc.free(self.addr)
        if self.recycle:
            _give_spare(self.data)


def _bounds(a: np.ndarray):
    """Lowest and one-past-highest byte address a view touches."""
    ai = a.__array_interface__
    lo = hi = ai["data"][0]
    strides = ai["strides"]
    if a.size == 0:
        return lo, lo
    if strides is None:
        return lo, lo + a.nbytes
    for n, s in zip(a.shape, strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + a.itemsize


class NkiTensor:
    """A view of an NKI buffer: ``shape``, ``dtype``, ``buffer`` as in AWS's NKI."""

    __slots__ = ("buf", "v", "shape", "pstart", "_box", "_matmul", "_indirect")

    def __init__(self, buf: Buffer, view: np.ndarray):
        self.buf, self.v, self.shape = buf, view, view.shape
        self._box = None
        if buf.kind != "hbm" and view.ndim and buf.data.strides[0]:
            lo, _ = _bounds(view)
            self.pstart = buf.pbase + (lo - buf.ptr) // buf.data.strides[0]
        else:           # HBM, or an empty tile (numpy gives it zero strides)
            self.pstart = buf.pbase

    # -- AWS-visible attributes -------------------------------------------------------
    @property
    def dtype(self):
        return self.buf.dtype

    @property
    def buffer(self):
        return BUFFERS[self.buf.kind]

    @property
    def kind(self) -> str:
        return self.buf.kind

    @property
    def name(self) -> str:
        return self.buf.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def free_size(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def itemsize(self) -> int:
        return self.buf.dtype.itemsize

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"NkiTensor({self.name}, shape={tuple(self.shape)}, dtype={self.dtype.name}, buffer={self.kind})"

    # -- views ------------------------------------------------------------------------
    def __getitem__(self, idx):
        return NkiTensor(self.buf, self.v[_norm_index(idx, self.shape, self.kind != "hbm")])

    def __setitem__(self, idx, value):
        _language._assign(self[idx], value)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        try:
            v = self.v.view()
            v.shape = tuple(int(s) for s in shape)
        except (AttributeError, ValueError):
            rules.fail(E.ShapeMismatchError,
                       f"cannot reshape {self.name!r} {tuple(self.shape)} to {tuple(shape)} "
                       f"without copying (it is not contiguous or the sizes differ)")
        return NkiTensor(self.buf, v)

    # -- AWS's named view operations (nki.language.NkiTensor): numpy views of the storage,
    # so they read and write through like indexing; an on-chip tensor keeps its partition dim
    def _dim(self, dim, what, extra=0, partition_ok=False):
        n = self.ndim + extra
        if not -n <= dim < n:
            rules.fail(E.ShapeMismatchError, f"{what}: dim {dim} out of range for "
                                             f"{self.name!r} of shape {tuple(self.shape)}")
        dim %= n
        if dim == 0 and self.kind != "hbm" and not partition_ok:
            self._keeps_partitions(what)
        return dim

    def _keeps_partitions(self, what):
        rules.fail(E.ShapeMismatchError, f"{what}: dim 0 of {self.name!r} is its partition "
                                         f"dimension ({self.kind.upper()}), which views keep")

    def slice(self, dim, start, end, step=1):
        """Elements start:end:step of ``dim``."""
        dim = self._dim(dim, "slice", partition_ok=True)
        idx = [slice(None)] * self.ndim
        idx[dim] = slice(start, end, step)
        return NkiTensor(self.buf, self.v[tuple(idx)])

    def select(self, dim, index):
        """Index ``index`` of ``dim``, which the view drops."""
        dim = self._dim(dim, "select")
        if not -self.shape[dim] <= index < self.shape[dim]:
            rules.fail(E.IndexOutOfBoundsError, f"select: index {index} out of range for dim "
                                                f"{dim} of {self.name!r} {tuple(self.shape)}")
        idx = [slice(None)] * self.ndim
        idx[dim] = index
        return NkiTensor(self.buf, self.v[tuple(idx)])

    def expand_dim(self, dim):
        """A new dimension of size 1 at ``dim``."""
        dim = self._dim(dim, "expand_dim", extra=1)
        return NkiTensor(self.buf, np.expand_dims(self.v, dim))

    def squeeze_dim(self, dim):
        """Drops ``dim``, of size 1."""
        dim = self._dim(dim, "squeeze_dim")
        if self.shape[dim] != 1:
            rules.fail(E.ShapeMismatchError, f"squeeze_dim: dim {dim} of {self.name!r} "
                                             f"{tuple(self.shape)} has size "
                                             f"{self.shape[dim]}, not 1")
        return NkiTensor(self.buf, np.squeeze(self.v, dim))

    def reshape_dim(self, dim, shape):
        """``dim`` split into ``shape`` (one entry may be -1)."""
        dim = self._dim(dim, "reshape_dim")
        return self.reshape(tuple(self.shape[:dim]) + tuple(shape) + tuple(self.shape[dim + 1:]))

    def flatten_dims(self, start_dim, end_dim):
        """Dims start_dim..end_dim (inclusive) merged into one, where no copy is needed."""
        a = self._dim(start_dim, "flatten_dims", partition_ok=True)
        b = self._dim(end_dim, "flatten_dims", partition_ok=True)
        if a == 0 < b and self.kind != "hbm":
            self._keeps_partitions("flatten_dims")
        n = int(np.prod(self.shape[a:b + 1]))
        return self.reshape(tuple(self.shape[:a]) + (n,) + tuple(self.shape[b + 1:]))

    def permute(self, dims):
        """The dimensions reordered: view dim i is this tensor's ``dims[i]``."""
        dims = tuple(int(d) % self.ndim for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            rules.fail(E.ShapeMismatchError, f"permute: {dims} is not a permutation of the "
                                             f"{self.ndim} dims of {self.name!r}")
        if self.kind != "hbm" and dims[0] != 0:
            self._keeps_partitions("permute")
        return NkiTensor(self.buf, np.transpose(self.v, dims))

    def broadcast(self, dim, size):
        """Size-1 ``dim`` repeated ``size`` times (stride 0: a read-only view)."""
        dim = self._dim(dim, "broadcast")
        if self.shape[dim] != 1:
            rules.fail(E.ShapeMismatchError, f"broadcast: dim {dim} of {self.name!r} "
                                             f"{tuple(self.shape)} has size "
                                             f"{self.shape[dim]}, not 1")
        shape = list(self.shape)
        shape[dim] = int(size)
        return NkiTensor(self.buf, np.broadcast_to(self.v, tuple(shape)))

    def get_pattern(self):
        """This view's access pattern ``[[stride, count], ...]`` in elements, as ``ap`` takes
        it (on chip the first pair steps partitions by the allocation's partition pitch)."""
        return [[int(st) // self.v.itemsize, int(n)] for st, n in zip(self.v.strides, self.shape)]

    def is_contiguous(self):
        """Whether the view covers its elements without gaps (on chip: within each
        partition, its partitions consecutive)."""
        v = self.v
        if self.kind != "hbm" and v.ndim:
            rows = v[0] if v.shape[0] else v
            pitch = self.buf.data.strides[0]
            return bool(rows.flags.c_contiguous and (v.shape[0] <= 1 or v.strides[0] == pitch))
        return bool(v.flags.c_contiguous)

    def is_indirect(self):
        return getattr(self, "_indirect", None) is not None

    def indirect(self, *args, **kwargs):
        raise E.UnsupportedError("NkiTensor.indirect (tensor indirection views) is not "
                                 "implemented in this simulator; use .ap(vector_offset=...)")

    def vector_select(self, *args, **kwargs):
        raise E.UnsupportedError("NkiTensor.vector_select is not implemented in this simulator; "
                                 "use .ap(vector_offset=...)")

    def rearrange(self, *args, **kwargs):
        raise E.UnsupportedError("NkiTensor.rearrange is not implemented in this simulator; "
                                 "use permute, reshape_dim and flatten_dims")

    @property
    def reinterpret_cast(self):
        raise E.UnsupportedError("NkiTensor.reinterpret_cast (bit-casting a tensor) is not "
                                 "implemented in this simulator")

    def view(self, dtype):
        raise E.UnsupportedError("NkiTensor.view(dtype) (bit-casting a tensor) is not implemented")

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0,
           dtype=None):
        """An explicit access pattern over this tensor's storage, as AWS's ``NkiTensor.ap``:
        ``pattern`` is ``[[stride, count], ...]`` in elements, the first pair stepping
        partitions for an on-chip tensor (its stride a multiple of the allocation's
        partition pitch), ``offset`` elements added to this view's start. A view that writes
        through, like indexing."""
        if scalar_offset is not None and vector_offset is not None:
            rules.fail(E.NkiRuleError, "ap: scalar_offset and vector_offset are mutually exclusive")
        if (scalar_offset is not None or vector_offset is not None) and self.kind != "hbm":
            rules.fail(E.MemoryLegalityError, f"ap: indirect access indexes an HBM tensor; "
                       f"{self.name!r} lives in {self.kind.upper()}")
        if scalar_offset is not None:
            # One runtime offset for all partitions: indirect_dim starts scalar_offset further on.
            s_off = scalar_offset.value if hasattr(scalar_offset, "value") and \
                not isinstance(scalar_offset, NkiTensor) else int(np.asarray(scalar_offset.v).flat[0])
            offset = (offset or 0) + int(s_off) * self._indirect_stride(indirect_dim)
        if vector_offset is not None:
            return self._indirect_view(pattern, offset or 0, vector_offset, indirect_dim)
        if dtype is not None and getattr(dtype, "name", dtype) != self.dtype.name and dtype != self.dtype:
            raise E.UnsupportedError("NkiTensor.ap: reinterpreting the storage as another dtype is "
                                     "not implemented in this simulator")
        pat = [(int(st), int(n)) for st, n in pattern]
        if not pat or any(n <= 0 for _, n in pat):
            rules.fail(E.ShapeMismatchError, f"ap: every count must be positive, got pattern {pattern}")
        base = self.buf.data
        item = base.itemsize
        start = (self.v.__array_interface__["data"][0] - self.buf.ptr)
        if self.kind == "hbm":
            if not base.flags.c_contiguous:
                raise E.UnsupportedError("NkiTensor.ap over a non-contiguous HBM array")
            start = start // item + (offset or 0)
            span = [(st * (n - 1)) for st, n in pat]
            lo, hi = start + sum(min(0, x) for x in span), start + sum(max(0, x) for x in span)
            if lo < 0 or hi >= base.size:
                rules.fail(E.IndexOutOfBoundsError, f"ap: pattern {pattern} at offset {start} reaches "
                           f"elements [{lo}, {hi}] of {self.name!r}, which holds {base.size}")
            byte_strides = [st * item for st, _ in pat]
            origin = start * item
        else:
            pitch = math.prod(base.shape[1:]) if base.ndim > 1 else 1
            p0, f0 = divmod(start // base.strides[0] * pitch + (start % base.strides[0]) // item
                            + (offset or 0), pitch)
            pst, pn = pat[0]
            if pst % pitch:
                rules.fail(E.ShapeMismatchError, f"ap: the partition stride {pst} of {pattern} is not "
                           f"a multiple of {self.name!r}'s partition pitch {pitch}")
            free_span = [(st * (n - 1)) for st, n in pat[1:]]
            flo, fhi = f0 + sum(min(0, x) for x in free_span), f0 + sum(max(0, x) for x in free_span)
            plast = p0 + (pst // pitch) * (pn - 1)
            if min(p0, plast) < 0 or max(p0, plast) >= base.shape[0] or flo < 0 or fhi >= pitch:
                rules.fail(E.IndexOutOfBoundsError, f"ap: pattern {pattern} (partition {p0}, element {f0}) "
                           f"leaves {self.name!r} of shape {tuple(base.shape)}")
            if base.ndim > 1 and base.strides[-1] != item:
                raise E.UnsupportedError("NkiTensor.ap over a tile whose rows are not contiguous")
            byte_strides = [(pst // pitch) * base.strides[0]] + [st * item for st, _ in pat[1:]]
            origin = p0 * base.strides[0] + f0 * item
        # Address the allocation's memory directly (bounds checked above), as_strided-style.
        first = np.lib.stride_tricks.as_strided(base, shape=(origin // item + 1,), strides=(item,))
        v = np.lib.stride_tricks.as_strided(first[origin // item:], shape=tuple(n for _, n in pat),
                                            strides=tuple(byte_strides))
        return NkiTensor(self.buf, v)

    def _indirect_stride(self, dim):
        """Elements one index of this tensor's dim ``dim`` spans (AWS: an indirect offset is
        scaled by the accumulated shape right of ``indirect_dim``, not by the pattern)."""
        if not 0 <= dim < max(1, self.ndim):
            rules.fail(E.ShapeMismatchError, f"ap: indirect_dim {dim} is not a dim of "
                                             f"{self.name!r} {tuple(self.shape)}")
        return int(np.prod(self.shape[dim + 1:], dtype=np.int64))

    def _indirect_view(self, pattern, offset, vector_offset, dim):
        """Per-partition runtime offsets (``vector_offset`` [P, 1]): index i of pattern dim
        ``dim`` becomes vector_offset[i] rows of this tensor's dim ``dim``. The result holds
        the addressed elements (gathered now); a DMA writing it scatters them back
        (``nisa.dma_copy``), and out-of-range offsets are the DMA's ``oob_mode`` to judge."""
        pat = [(int(st), int(n)) for st, n in pattern]
        idx = np.asarray(vector_offset.v).reshape(-1).astype(np.int64)
        if not 0 <= dim < len(pat) or pat[dim][1] != idx.size:
            rules.fail(E.ShapeMismatchError, f"ap: indirect_dim {dim} of pattern {pattern} must count "
                       f"the {idx.size} offsets of vector_offset {tuple(vector_offset.shape)}")
        pat[dim] = (self._indirect_stride(dim), pat[dim][1])
        base = self.buf.data.reshape(-1)
        start = (self.v.__array_interface__["data"][0] - self.buf.ptr) // base.itemsize + offset
        flat = np.full([n for _, n in pat], start, dtype=np.int64)
        for k, (st, n) in enumerate(pat):
            steps = idx if k == dim else np.arange(n, dtype=np.int64)
            shape = [1] * len(pat)
            shape[k] = n
            flat += (steps * st).reshape(shape)
        oob = (flat < 0) | (flat >= base.size)
        v = np.zeros(flat.shape, dtype=base.dtype)
        v[~oob] = base[flat[~oob]]
        t = NkiTensor(self.buf, v)
        t._indirect = (base, flat, oob)
        # Dependencies: the whole tensor (the rows are only known at run time).
        t._box = NkiTensor(self.buf, self.buf.data).box()
        return t

    def box(self):
        """Region this view touches, for dependency tracking: (space, bounds tuple)."""
        if self._box is None:
            buf = self.buf
            lo, hi = _bounds(self.v)
            lo, hi = (lo - buf.ptr) // buf.sitem, (hi - buf.ptr) // buf.sitem - 1
            if buf.kind == "hbm":
                b = []
                for n in reversed(buf.data.shape):
                    lo, l0 = divmod(lo, n)
                    hi, h0 = divmod(hi, n)
                    b += [l0, h0 + 1]
                self._box = (id(buf), tuple(b))
            elif not buf.data.strides[0]:       # an empty tile: it touches nothing
                self._box = (buf.kind, (buf.pbase, buf.pbase, buf.addr, buf.addr))
            else:
                row = buf.data.strides[0] // buf.sitem
                p0, f0 = divmod(lo, row)
                p1, f1 = divmod(hi, row)
                isz = buf.dtype.itemsize
                p0, p1 = p0 + buf.pbase, p1 + buf.pbase
                self._box = (buf.kind, (p0, p1 + 1, buf.addr + f0 * isz, buf.addr + (f1 + 1) * isz))
        return self._box

    # -- arithmetic sugar: tiles combine through nki.language ---------------------------
    def _bin(self, other, op, rev=False):
        f = getattr(_language, op)
        return f(other, self) if rev else f(self, other)

    def __add__(self, o): return self._bin(o, "add")

    def __iadd__(self, o):
        # `psum_acc += nl.matmul(...)`: a matmul accumulating into the PSUM tile
        if self.kind == "psum" and isinstance(o, NkiTensor) and getattr(o, "_matmul", False):
            return _language._accumulate(self, o)
        return self._bin(o, "add")
    def __radd__(self, o): return self._bin(o, "add", True)
    def __sub__(self, o): return self._bin(o, "subtract")
    def __rsub__(self, o): return self._bin(o, "subtract", True)
    def __mul__(self, o): return self._bin(o, "multiply")
    def __rmul__(self, o): return self._bin(o, "multiply", True)
    def __truediv__(self, o): return self._bin(o, "divide")
    def __rtruediv__(self, o): return self._bin(o, "divide", True)
    def __neg__(self):
        return _language.negative(self)


def _norm_index(idx, shape, keep_partition):
    if not isinstance(idx, tuple):
        idx = (idx,)
    out, dim = [], 0
    if any(i is Ellipsis for i in idx):
        k = idx.index(Ellipsis)
        fill = len(shape) - (len(idx) - 1)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    for i in idx:
        if dim >= len(shape):
            rules.fail(E.IndexOutOfBoundsError, f"too many indices for a tensor of shape {tuple(shape)}")
        n = shape[dim]
        if isinstance(i, _Arange):
            i = i.as_slice()
        elif isinstance(i, _DynSlice):
            i = slice(i.start, i.start + i.size)
        if isinstance(i, slice):
            start, stop, step = i.start, i.stop, i.step
            if isinstance(start, NkiTensor) or isinstance(stop, NkiTensor):
                raise E.UnsupportedError("indexing with a tensor (dynamic offset) is not implemented; "
                                         "use a Python int")
            start = 0 if start is None else int(start)
            stop = n if stop is None else int(stop)
            if start < 0 or stop > n or start > stop:
                rules.fail(E.IndexOutOfBoundsError,
                           f"slice [{start}:{stop}] is out of bounds for axis {dim} of size {n} "
                           f"(shape {tuple(shape)})")
            out.append(slice(start, stop, step))
        elif isinstance(i, (int, np.integer)) or hasattr(i, "__index__"):
            i = int(i)
            if i < -n or i >= n:
                rules.fail(E.IndexOutOfBoundsError,
                           f"index {i} is out of bounds for axis {dim} of size {n} (shape {tuple(shape)})")
            out.append(slice(i, i + 1) if (dim == 0 and keep_partition) else i)
        else:
            raise E.UnsupportedError(f"index of type {type(i).__name__} is not supported "
                                     f"(use ints, slices, nl.ds or nl.arange)")
        dim += 1
    return tuple(out)


def new_id() -> int:
    return next(_ids)
