"""``nki.language``: tensors, buffers, dtypes, loops and the convenience operations.

Convenience operations (``nl.load``, ``nl.exp``, ``nl.matmul``, ``nl.softmax``, ...) are
built from ``nki.isa`` instructions, so they obey the same rules and get timed the same way.
"""
from __future__ import annotations

import builtins
import sys

import numpy as np

from . import _ops
from . import errors as E
from . import isa as _isa
from .isa import _common as _isa_common
from .simulator import context as _ctx
from .simulator import rules as _rules
from .simulator import tensor as _tensor
from .simulator import tensore as _tensore
from .simulator.dtypes import (  # noqa: F401  (public dtypes)
    DType, as_dtype, bfloat16, bool_, float4_e2m1fn, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn,
    float8_e4m3fn_x4, float8_e5m2, float8_e5m2_x4, float8_e8m0fnu, float16, float32, int8, int16,
    int32, int64, tfloat32, uint8, uint16, uint32, uint64)
from .simulator.indexing import _Arange, _DynSlice
from .simulator.spaces import BUFFERS, Buffer
from .simulator.tensor import NkiTensor

tensor = NkiTensor


sbuf, psum, hbm = BUFFERS["sbuf"], BUFFERS["psum"], BUFFERS["hbm"]
shared_hbm, private_hbm = BUFFERS["shared_hbm"], BUFFERS["private_hbm"]


class tile_size:
    """Tile limits of the NeuronCore (identical on trn1/trn2/trn3), as AWS defines them:
    PSUM sizes are per bank per partition (AWS's kernels address bank b at
    ``b * psum_fmax * 4``)."""
    pmax = 128
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_fmax = psum_bank_fmax = 512                  # fp32 elements
    psum_fmax_bytes = psum_bank_fmax_bytes = 2048
    psum_num_banks = 8
    psum_partition_size = 16384
    total_available_sbuf_size = sbuf_fmax_bytes = 192 * 1024
    sbuf_fmax = 192 * 1024 // 4                       # fp32 elements


def _kind(buffer):
    if buffer is None:
        return "sbuf"
    if isinstance(buffer, Buffer):
        return buffer.kind
    if isinstance(buffer, str) and buffer in ("sbuf", "psum", "hbm", "shared_hbm", "private_hbm"):
        return buffer
    raise E.UnsupportedError(f"buffer {buffer!r} is not supported (use nl.sbuf, nl.psum, nl.hbm, "
                             f"nl.shared_hbm or nl.private_hbm)")


def ndarray(shape, dtype, buffer=None, name=None, address=None, **kwargs):
    """A new tensor; its contents are NaN (floats) until written, so stray reads show.
    ``address=(partition_offset, byte_offset)`` places an SBUF/PSUM tile there (AWS's
    direct allocation) instead of letting the allocator choose."""
    if isinstance(shape, int):
        shape = (shape,)
    return _ctx.current().alloc(shape, as_dtype(dtype), _kind(buffer), name, address=address)


def _result(shape, dtype, buffer):
    """A helper's result tile, which the helper's own instruction writes in full: no NaN
    poisoning pass over it (that is for tiles the kernel allocates itself)."""
    return _ctx.current().alloc(shape, as_dtype(dtype), _kind(buffer), None, fill=None)


def empty_like(a, dtype=None, buffer=None, name=None, **kwargs):
    return ndarray(a.shape, dtype or a.dtype, buffer if buffer is not None else BUFFERS[a.kind], name)


def full(shape, fill_value, dtype, buffer=None, name=None, **kwargs):
    t = ndarray(shape, dtype, buffer, name)
    if t.kind == "hbm":
        t.v[...] = t.dtype.round(np.float64(fill_value))
    else:
        _isa.memset(t, fill_value)
    return t


def zeros(shape, dtype, buffer=None, name=None, **kwargs):
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=None, name=None, **kwargs):
    return full(shape, 1, dtype, buffer, name)


def zeros_like(a, dtype=None, buffer=None, name=None, **kwargs):
    return zeros(a.shape, dtype or a.dtype, buffer if buffer is not None else BUFFERS[a.kind], name)


def ones_like(a, dtype=None, buffer=None, name=None, **kwargs):
    return ones(a.shape, dtype or a.dtype, buffer if buffer is not None else BUFFERS[a.kind], name)


# ----------------------------------------------------------------------------- indexing
def ds(start, size):
    """A slice of ``size`` elements starting at ``start``."""
    return _DynSlice(start, size)


def arange(start, stop=None, step=1):
    if stop is None:
        start, stop = 0, start
    return _Arange(start, stop, step)


class _MGrid:
    def __getitem__(self, idx):
        if not isinstance(idx, tuple):
            idx = (idx,)
        parts = [_Arange(s.start or 0, s.stop, s.step or 1) for s in idx]

        class _Grid(tuple):
            pass
        g = _Grid(parts)
        for name, a in zip(("p", "x", "y", "z"), parts):
            setattr(g, name, a)
        return g


mgrid = _MGrid()


def par_dim(x):
    """Legacy marker of the partition dimension; the partition axis is always axis 0."""
    return x


# ----------------------------------------------------------------------------- programs
def program_id(axis=0):
    sim = _ctx.current()
    return sim.pid[axis] if axis < len(sim.pid) else 0


def num_programs(axes=None):
    g = _ctx.current().grid or (1,)
    if axes is None:
        return int(np.prod(g))
    if isinstance(axes, (tuple, list)):
        return int(np.prod([g[a] if a < len(g) else 1 for a in axes]))
    return g[axes] if axes < len(g) else 1


def program_ndim():
    return len(_ctx.current().grid)


# ----------------------------------------------------------------------------- loops
def affine_range(*args, **kwargs):
    """Deprecated in NKI 0.7: the same as Python ``range``."""
    return range(*args)


sequential_range = static_range = affine_range


def fori_loop(lower, upper, body_fun, step=1):
    """Run body_fun(i) for i in range(lower, upper, step); bounds may be registers."""
    if int(step) <= 0:
        _rules.fail(E.NkiRuleError, "fori_loop: step must be a positive compile-time integer")
    for i in range(int(lower), int(upper), int(step)):
        body_fun(i)


def while_loop(init, body_fun):
    """Run r = body_fun(r) while the condition register r is nonzero."""
    r = init
    while int(r.value if isinstance(r, _isa.VirtualRegister) else r) != 0:
        r = body_fun(r)


def device_print(prefix, x, **kwargs):
    _ctx.drain()
    print(prefix, x.v if isinstance(x, NkiTensor) else x)


# ----------------------------------------------------------------------------- data movement
def load(src, dtype=None, **kwargs):
    """Copy an HBM tensor (or a slice of it) into a new SBUF tile."""
    t = _result(src.shape, dtype or src.dtype, sbuf)
    _isa.dma_copy(t, src)
    return t


def store(dst, value, **kwargs):
    """Copy an SBUF tile into an HBM tensor."""
    _isa.dma_copy(dst, value)


def copy(x, dtype=None, **kwargs):
    t = _result(x.shape, dtype or x.dtype, sbuf)
    _isa.tensor_copy(t, x)
    return t


def _assign(dst, value):
    if isinstance(value, NkiTensor):
        if dst.kind == "hbm" or value.kind == "hbm":
            _isa.dma_copy(dst, value)
        else:
            _isa.tensor_copy(dst, value)
    else:
        _isa.memset(dst, value)


# ----------------------------------------------------------------------------- arithmetic
def _result_dtype(*xs):
    ts = [x.dtype for x in xs if isinstance(x, NkiTensor)]
    if builtins.any(isinstance(x, float) for x in xs) and not builtins.any(t.is_float for t in ts):
        return float32
    return builtins.max(ts, key=lambda d: (d.is_float, d.itemsize))


def _broadcast_partition(t, P):
    """A (1, F) tile repeated over P partitions (GpSimd partition broadcast)."""
    out = _result((P,) + tuple(t.shape[1:]), t.dtype, sbuf)
    sim = _ctx.current()
    sim.compute("partition_broadcast", "gpsimd", 150 + t.free_size, [t], [out])
    out.v[...] = np.broadcast_to(t.v, out.shape)
    return out


def _binary(op, x, y, dtype=None, **kwargs):
    xt, yt = isinstance(x, NkiTensor), isinstance(y, NkiTensor)
    if not xt and not yt:
        return float(_ops.apply_binary(op, np.float32(x), np.float32(y)))
    dt = as_dtype(dtype) if dtype is not None else _result_dtype(x, y)
    if xt and yt:
        if x.shape[0] != y.shape[0]:
            if x.shape[0] == 1:
                x = _broadcast_partition(x, y.shape[0])
            elif y.shape[0] == 1:
                y = _broadcast_partition(y, x.shape[0])
        if x.free_size == 1 and y.free_size > 1:
            out = _result(y.shape, dt, sbuf)
            _isa.tensor_scalar(out, y, op, x, reverse0=True)
            return out
        if y.free_size == 1 and x.free_size > 1:
            out = _result(x.shape, dt, sbuf)
            _isa.tensor_scalar(out, x, op, y)
            return out
        if tuple(x.shape) != tuple(y.shape) and x.free_size == y.free_size:
            y = y.reshape(x.shape)
        out = _result(x.shape, dt, sbuf)
        _isa.tensor_tensor(out, x, y, op)
        return out
    t, s, rev = (x, y, False) if xt else (y, x, True)
    out = _result(t.shape, dt, sbuf)
    _isa.tensor_scalar(out, t, op, s, reverse0=rev)
    return out


def _unary(op, x, dtype=None, **kwargs):
    out = _result(x.shape, dtype or x.dtype, sbuf)
    if op.kind == "bitvec1":
        _isa.tensor_scalar(out, x, _ops.BINARY["bitwise_xor"], -1)
    else:
        _isa.activation(out, op, x)
    return out


def _reduce_call(op, x, axis=None, dtype=None, keepdims=False, **kwargs):
    return _reduce(op, x, axis, dtype, keepdims)


def _reduce(op, x, axis, dtype, keepdims, negate=False):
    axis = tuple(range(1, x.ndim)) if axis is None else axis
    ax = tuple(a % x.ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
    shape = tuple(1 if i in ax else n for i, n in enumerate(x.shape)) if keepdims else \
        tuple(n for i, n in enumerate(x.shape) if i not in ax)
    if not shape or shape[0] != x.shape[0]:
        shape = (x.shape[0],) + shape[1:] if shape else (x.shape[0], 1)
    out = _result(shape, dtype or x.dtype, sbuf)
    _isa.tensor_reduce(out, op, x, ax, negate=negate, keepdims=keepdims)
    return out


for _name, _op in _ops.BINARY.items():
    _op._call = _reduce_call if _name in ("max", "min") else _binary
    globals()[_name] = _op
for _name, _op in _ops.UNARY.items():
    _op._call = _unary
    globals()[_name] = _op
del _name, _op
prelu = _ops.PRELU


def _prelu_call(op, *args, **kwargs):
    raise TypeError("nki.language.prelu is an activation operator (its slope is relu_param): pass "
                    "it as op= of nisa.activate2, not as a function")


prelu._call = _prelu_call


def sum(x, axis=None, dtype=None, keepdims=False, **kwargs):  # noqa: A001
    return _reduce(_ops.BINARY["add"], x, axis, dtype, keepdims)


def prod(x, axis=None, dtype=None, keepdims=False, **kwargs):
    return _reduce(_ops.BINARY["multiply"], x, axis, dtype, keepdims)


def mean(x, axis=None, dtype=None, keepdims=False, **kwargs):
    s = _reduce(_ops.BINARY["add"], x, axis, float32, keepdims)
    n = x.size // s.size
    out = _result(s.shape, dtype or x.dtype, sbuf)
    _isa.tensor_scalar(out, s, multiply, 1.0 / n)
    return out


def all(x, axis=None, dtype=None, keepdims=False, **kwargs):  # noqa: A001
    return min(not_equal(x, 0.0, dtype=float32), axis, dtype=dtype or bool_, keepdims=keepdims)


def any(x, axis=None, dtype=None, keepdims=False, **kwargs):  # noqa: A001
    return max(not_equal(x, 0.0, dtype=float32), axis, dtype=dtype or bool_, keepdims=keepdims)


def where(condition, x, y, dtype=None, **kwargs):
    """Elementwise select on VectorE: x where condition is nonzero, else y."""
    ref = next(t for t in (condition, x, y) if isinstance(t, NkiTensor))
    dt = as_dtype(dtype) if dtype is not None else _result_dtype(*(t for t in (x, y) if isinstance(t, NkiTensor))) \
        if isinstance(x, NkiTensor) or isinstance(y, NkiTensor) else float32
    out = _result(ref.shape, dt, sbuf)
    reads = [t for t in (condition, x, y) if isinstance(t, NkiTensor)]
    _ctx.current().compute("select", "vector", builtins.max(64, 2 * ref.free_size), reads, [out])
    val = [t.v.reshape(ref.shape).astype(np.float32) if isinstance(t, NkiTensor) else np.float32(t)
           for t in (condition, x, y)]
    out.v[...] = out.dtype.round(np.where(val[0] != 0, val[1], val[2]))
    return out


def transpose(x, dtype=None, **kwargs):
    """Swap partition and free axes of a 2-D tile on TensorE (result in PSUM)."""
    out = _result((x.free_size, x.shape[0]), dtype or x.dtype, psum)
    _isa.nc_transpose(out, x)
    return out


def matmul(x, y, transpose_x=False, **kwargs):
    """x @ y on TensorE into a float32 PSUM tile.

    With transpose_x=True, x is already laid out [K, M] (contraction on partitions)."""
    if not transpose_x:
        xt = transpose(x)
        x = copy(xt)
    out = _result((x.free_size, y.free_size), float32, psum)
    _isa.nc_matmul(out, x, y)
    # The queued GEMM computing it (True when it ran inline), for `acc += ...`.
    out._matmul = _tensore.pool().last or True
    return out


def _accumulate(acc, prod):
    """``acc += nl.matmul(x, y)`` on a PSUM accumulator, as AWS's tutorials write it: NKI
    compiles it to a matmul accumulating into acc's PSUM. The product is already computed
    and charged to TensorE; it is added in place here, TensorE ordered after it at no
    further cost."""
    if tuple(acc.shape) != tuple(prod.shape):
        _rules.fail(E.ShapeMismatchError, f"nl.matmul accumulation: the accumulator "
                    f"{tuple(acc.shape)} and the product {tuple(prod.shape)} differ in shape")
    if acc.dtype.name != "float32":
        _rules.fail(E.DtypeLegalityError, f"nl.matmul accumulation: a PSUM accumulator is "
                    f"float32, got {acc.dtype.name}")
    sim = _ctx.current()
    acc.buf.written = True
    if sim.timing:
        sim.tl.compute("nc_matmul", "tensor", 0, [prod.box()], [acc.box()])
    gemm, a, p = prod._matmul, acc.v, prod.v

    def work():
        # Queued behind the GEMMs into acc's bank; waits for the product's own GEMM, which
        # was queued earlier (so the waits cannot form a cycle).
        if gemm is not True:
            gemm.result()
        np.add(a, p, out=a)
    prof = sim.profile
    key = acc.box()[1][2] // prof.psum_bank_bytes
    _tensore.pool().submit(key, a.size * 128 if sim.in_run else 0, work,
                           (acc.buf.data, prod.buf.data))
    return acc


def softmax(x, axis=-1, dtype=None, compute_dtype=None, **kwargs):
    """exp(x - max) / sum over the last free axis: VectorE max, ScalarE exp+sum, VectorE scale."""
    P = x.shape[0]
    _isa_common._axes(axis, x.ndim, "softmax")
    mx = _result((P, 1), float32, sbuf)
    _isa.tensor_reduce(mx, maximum, x, tuple(range(1, x.ndim)) if x.ndim > 2 else 1, negate=True)
    e = _result(x.shape, float32, sbuf)
    s = _result((P, 1), float32, sbuf)
    _isa.activation(e, exp, x, bias=mx, reduce_op=add, reduce_res=s)
    r = _result((P, 1), float32, sbuf)
    _isa.reciprocal(r, s)
    out = _result(x.shape, dtype or x.dtype, sbuf)
    _isa.tensor_scalar(out, e, multiply, r)
    return out


def rms_norm(x, w, axis=-1, n=None, epsilon=1e-6, dtype=None, compute_dtype=None, **kwargs):
    """x / sqrt(sum(x^2) / n + epsilon) * w along the free axis."""
    P, F = x.shape[0], x.free_size
    n = F if n is None else n
    sq = _result(x.shape, float32, sbuf)
    ss = _result((P, 1), float32, sbuf)
    _isa.activation(sq, square, x, reduce_op=add, reduce_res=ss)
    rs = _result((P, 1), float32, sbuf)
    _isa.tensor_scalar(rs, ss, multiply, 1.0 / n, op1=add, operand1=float(epsilon))
    _isa.activation(rs, rsqrt, rs)
    if w.shape[0] != P:
        w = _broadcast_partition(w if w.ndim > 1 else w.reshape(1, -1), P)
    out = _result(x.shape, dtype or x.dtype, sbuf)
    _isa.scalar_tensor_tensor(out, x, multiply, rs, multiply, w.reshape(x.shape))
    return out


class NKIObject:
    """Base of a kernel's configuration objects, as AWS's NKI defines it: subclasses "work
    like dataclasses, with or without @dataclass", and take their attributes (annotated
    fields or plain class attributes) as keyword arguments, as AWS's kernel library builds
    them (``SectionParams(section_idx=0, ...)`` on a dataclass with no annotated fields).
    The simulator passes them to kernels as the Python objects they are."""

    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            object.__setattr__(self, k, v)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        # Put the keyword constructor in the subclass itself, where @dataclass (applied
        # afterwards) leaves an existing __init__ alone; positional and defaulted dataclass
        # fields are still honoured, from the fields @dataclass records.
        if "__init__" not in cls.__dict__:
            cls.__init__ = _nki_object_init


def _nki_object_init(self, *args, **kwargs):
    import dataclasses
    if dataclasses.is_dataclass(self):
        fields = [f for f in dataclasses.fields(self) if f.init]
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__}() takes {len(fields)} positional arguments "
                            f"but {len(args)} were given")
        for f, a in zip(fields, args):
            object.__setattr__(self, f.name, a)
        for f in fields[len(args):]:
            if f.name in kwargs:
                object.__setattr__(self, f.name, kwargs.pop(f.name))
            elif f.default is not dataclasses.MISSING:
                object.__setattr__(self, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                object.__setattr__(self, f.name, f.default_factory())
            # else: left unset, as AWS's NKI builds these objects (AWS's MLP kernels never
            # pass a field they never read); reading it raises AttributeError
    elif args:
        raise TypeError(f"{type(self).__name__}() takes keyword arguments only")
    for k, v in kwargs.items():
        object.__setattr__(self, k, v)
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


# ------------------------------------------------------- shapes, buffers, constants, random
def is_psum(buffer):
    """Whether ``buffer`` (a buffer or a tensor) is PSUM."""
    return _kind_of(buffer) == "psum"


def is_sbuf(buffer):
    """Whether ``buffer`` (a buffer or a tensor) is SBUF."""
    return _kind_of(buffer) == "sbuf"


def is_hbm(buffer):
    """Whether ``buffer`` (a buffer or a tensor) is any HBM kind."""
    return _kind_of(buffer) in ("hbm", "shared_hbm", "private_hbm")


def is_on_chip(buffer):
    """Whether ``buffer`` (a buffer or a tensor) is SBUF or PSUM."""
    return _kind_of(buffer) in ("sbuf", "psum")


def _kind_of(buffer):
    return buffer.kind if isinstance(buffer, (NkiTensor, Buffer)) else _kind(buffer)


class no_reorder:
    """``with nl.no_reorder():`` keeps program order. The simulator always issues in program
    order, so the block changes nothing here; dynamic loops inside it are refused as AWS's
    compiler refuses them."""
    _depth = 0

    def __enter__(self):
        no_reorder._depth += 1
        return self

    def __exit__(self, *exc):
        no_reorder._depth -= 1
        return False


def dynamic_range(start, stop=None, step=1):
    """A loop the device runs with runtime bounds; simulated as the same iterations."""
    if no_reorder._depth:
        raise E.UnsupportedError("nki.language.dynamic_range: dynamic loops are not supported "
                                 "inside a no_reorder block")
    return affine_range(start, stop, step) if stop is not None else affine_range(start)


def expand_dims(x, axis):
    """A view of ``x`` with a new axis of size 1 at ``axis`` (numpy.expand_dims)."""
    shape = list(x.shape)
    axis = axis if axis >= 0 else len(shape) + 1 + axis
    if not 0 <= axis <= len(shape):
        raise E.ShapeMismatchError(f"nki.language.expand_dims: axis {axis} out of range for shape {tuple(x.shape)}")
    shape.insert(axis, 1)
    return x.reshape(tuple(shape))


def broadcast_to(x, shape, dtype=None):
    """``x`` broadcast to ``shape`` (numpy rules, same rank): across partitions on GpSimd,
    along the free dims on VectorE. Returns ``x`` itself when nothing changes."""
    shape = tuple(shape)
    if len(shape) != x.ndim:
        raise E.ShapeMismatchError(f"nki.language.broadcast_to: shape {shape} must have the rank of "
                                   f"the source {tuple(x.shape)}")
    for have, want in zip(x.shape, shape):
        if have != want and have != 1:
            raise E.ShapeMismatchError(f"nki.language.broadcast_to: cannot broadcast {tuple(x.shape)} to {shape}")
    dt = as_dtype(dtype) if dtype is not None else x.dtype
    if tuple(x.shape) == shape:
        return x if dt == x.dtype else copy(x, dtype=dt)
    if x.shape[0] != shape[0]:
        x = _broadcast_partition(x, shape[0])
    if tuple(x.shape) == shape and dt == x.dtype:
        return x
    out = _result(shape, dt, sbuf)
    _ctx.current().compute("broadcast_free", "vector", builtins.max(64, out.free_size), [x], [out])
    out.v[...] = np.broadcast_to(x.v, shape).astype(out.v.dtype)
    return out


def var(x, axis, dtype=None, keepdims=False):
    """Population variance along free axes (numpy.var); keeps the reduced dims as 1, as AWS's.
    Two passes in float32: the mean, then the mean of squared deviations."""
    m = mean(x, axis=axis, dtype=float32, keepdims=True)
    d = _result(x.shape, float32, sbuf)
    _isa.tensor_scalar(d, x, subtract, m) if m.free_size == 1 else _isa.tensor_tensor(
        d, x, broadcast_to(m, x.shape), subtract)
    sq = _result(x.shape, float32, sbuf)
    _isa.activation(sq, square, d)
    return mean(sq, axis=axis, dtype=dtype or x.dtype, keepdims=True)


def abs_max(x, y, dtype=None):
    """The input of larger magnitude, sign kept (``x`` where ``|x| > |y|``, else ``y``)."""
    return _by_magnitude(x, y, greater, dtype)


def abs_min(x, y, dtype=None):
    """The input of smaller magnitude, sign kept (``x`` where ``|x| < |y|``, else ``y``)."""
    return _by_magnitude(x, y, less, dtype)


def _by_magnitude(x, y, cmp, dtype):
    ax = abs(x) if isinstance(x, NkiTensor) else builtins.abs(x)
    ay = abs(y) if isinstance(y, NkiTensor) else builtins.abs(y)
    pick = cmp(ax, ay)
    return where(pick, x, y, dtype=dtype)


def dropout(x, rate, dtype=None):
    """Zero each element with probability ``rate`` (scalar or a (P, 1) tile) on VectorE."""
    out = _result(x.shape, x.dtype, sbuf)
    _isa.dropout(out, x, rate)
    return out if dtype is None or as_dtype(dtype) == x.dtype else copy(out, dtype=dtype)


def rand(shape, dtype, buffer=None, name=None):
    """A new tensor of uniform [0, 1) values from the core's random generator."""
    t = ndarray(shape, dtype, buffer if buffer is not None else sbuf, name)
    _isa.rng(t)
    return t


def random_seed(seed):
    """Seed the core's random generator from a [1, 1] tile (or an int): the same seed gives
    the same ``rand``/``dropout`` values."""
    _isa.set_rng_seed(seed)


def shared_constant(constant):
    """A shared-HBM tensor holding ``constant`` (a numpy array or a ``.npy`` path), present at
    load time: no engine time."""
    arr = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    dt = as_dtype(arr.dtype.name if arr.dtype.name != "float64" else "float32")
    t = _result(arr.shape, dt, shared_hbm)
    t.v[...] = arr.astype(t.v.dtype)
    return t


def shared_identity_matrix(n, dtype=uint8, dst=None):
    """An n x n identity in SBUF (built once per dtype by AWS's compiler; here per call, on
    GpSimd as an iota-and-compare)."""
    t = dst if dst is not None else ndarray((n, n), dtype, sbuf)
    _ctx.current().compute("identity_matrix", "gpsimd", builtins.max(64, n), [], [t])
    t.v[...] = np.eye(n, dtype=np.float32).astype(t.v.dtype)
    return t


def gather_flattened(data, indices, axis=0, dtype=None):
    """result[p, ...] = data[p, flat index]: each partition picks elements of its own row of
    ``data`` (free dims flattened) at the integer ``indices`` of the same partition; the
    result has the indices' shape. On GpSimd, as AWS's (experimental) API describes it."""
    I = "gather_flattened"
    if axis != 0:
        _rules.fail(E.UnsupportedError, f"{I}: only axis=0 (the flattened free dims of each "
                    f"partition) is implemented, got axis={axis}")
    if not indices.dtype.is_int:
        _rules.fail(E.DtypeLegalityError, f"{I}: indices must be an integer tile, got "
                    f"{indices.dtype.name}")
    if indices.shape[0] != data.shape[0]:
        _rules.fail(E.ShapeMismatchError, f"{I}: data {tuple(data.shape)} and indices "
                    f"{tuple(indices.shape)} must span the same partitions")
    out = _result(indices.shape, dtype or data.dtype, sbuf)
    _isa_common._issue(I, "gpsimd", 150 + indices.free_size, [data, indices], [out])
    src = _isa_common._flat(data)
    idx = _isa_common._flat(indices).astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= src.shape[1]):
        _rules.fail(E.IndexOutOfBoundsError, f"{I}: index out of range [0, {src.shape[1]}) of "
                    f"data {tuple(data.shape)}")
    _isa_common._put(out, np.take_along_axis(_isa_common._f32(data).reshape(src.shape), idx, 1)
                     if data.dtype.is_float else np.take_along_axis(src, idx, 1))
    return out


def load_transpose2d(src, dtype=None):
    """Load a 2-D HBM tensor into SBUF transposed (a DMA transpose)."""
    if src.ndim != 2:
        raise E.ShapeMismatchError(f"nki.language.load_transpose2d: a 2-D tensor, got {tuple(src.shape)}")
    t = _result((src.shape[1], src.shape[0]), dtype or src.dtype, sbuf)
    _isa.dma_transpose(t, src)
    return t


def silu_dx(x, dtype=None):
    """d/dx silu(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x)))."""
    s = sigmoid(x, dtype=float32)
    return _derivative(x, s, lambda xv, sv: sv * (1 + xv * (1 - sv)), dtype)


def gelu_dx(x, dtype=None):
    """d/dx gelu(x) = Phi(x) + x * phi(x) (exact GELU)."""
    cdf = _result(x.shape, float32, sbuf)
    _isa.activation(cdf, erf, x, scale=float(1 / np.sqrt(2)))  # erf(x / sqrt 2)
    return _derivative(x, cdf, lambda xv, ev: 0.5 * (1 + ev) + xv * np.exp(-0.5 * xv * xv) / np.sqrt(2 * np.pi), dtype)


def gelu_apprx_sigmoid_dx(x, dtype=None):
    """d/dx of x * sigmoid(1.702 x)."""
    s = _result(x.shape, float32, sbuf)
    _isa.activation(s, sigmoid, x, scale=1.702)
    return _derivative(x, s, lambda xv, sv: sv + 1.702 * xv * sv * (1 - sv), dtype)


def _derivative(x, first, finish, dtype):
    # The ScalarE table lookup above, then one VectorE pass combining it with x.
    out = _result(x.shape, dtype or x.dtype, sbuf)
    _ctx.current().compute("activation_dx", "vector", builtins.max(64, x.free_size), [x, first], [out])
    xv = x.v.astype(np.float32)
    fv = first.v.astype(np.float32)
    out.v[...] = finish(xv, fv).astype(out.v.dtype)
    return out


_MISSING = {"atomic_rmw", "all_reduce", "loop_reduce", "static_assert",
            "dropout_", "random", "invert_"}


# Names AWS's kernel library uses that would shadow Python builtins inside this module.
_BUILTIN_NAMES = {"range": affine_range, "bool": bool_, "dtype": DType}


def __getattr__(name):
    if name in _BUILTIN_NAMES:
        return _BUILTIN_NAMES[name]
    if name in _MISSING:
        raise E.UnsupportedError(f"nki.language.{name} is not implemented in this NKI simulator")
    raise AttributeError(f"module 'nki.language' has no attribute {name!r}")


# Tiles combine through this module (a + b is nl.add(a, b)); it sits above the tensor class.
_tensor.set_language(sys.modules[__name__])
