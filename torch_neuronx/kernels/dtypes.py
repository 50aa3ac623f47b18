"""CUDA's dtypes where CPU has no kernel: the device computes them as CUDA does.

Programs written for CUDA use dtypes that CUDA's kernels take and CPU's refuse (integer
``histc`` in Transformers' MoE routing, half-precision ``avg_pool3d`` and FFTs, ``chalf``
math). The fallback runs CPU kernels; when one refuses its arguments, it hands them (host
aliases of the device tensors) to :func:`_policy`, which computes CUDA's result:

* half, bfloat16 and complex32 ops run in float32 / complex64 and round the result back,
  as CUDA's kernels compute in their ``opmath`` type and round once;
* integer ``histc`` uses CUDA's integer bin formula, ``(x - min) * bins // (max - min)``
  in int64, bounds converted to the input dtype as CUDA does;
* ``abs`` and ``trace`` of bool, and ``nansum`` of complex, follow CUDA's definitions;
* uint16/uint32/uint64 ops CPU refuses (those CUDA's kernels take, and the arithmetic,
  comparisons and reductions Inductor compiles) compute as C's unsigned integers
  (``_unsigned``).

The op list comes from PyTorch's OpInfo database (ops whose ``dtypesIfCUDA`` exceed their
``dtypes``); ``tests/device/test_cuda_dtypes.py`` regenerates it, so a new torch that adds
one is caught. Anything else the CPU refuses still raises the CPU error.
"""
from __future__ import annotations

import torch

from .. import _C

_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
          torch.complex32: torch.complex64}
_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

# Ops whose CUDA kernels take half/bfloat16/complex32 where CPU's do not, computed wider:
# these for all three, the math below for complex32 only (CPU takes half and bfloat16).
_UPCAST_HALF = frozenset("""
avg_pool3d avg_pool3d_backward _upsample_bilinear2d_aa _upsample_bilinear2d_aa_backward
_upsample_bicubic2d_aa _upsample_bicubic2d_aa_backward
multi_margin_loss multi_margin_loss_backward multilabel_margin_loss_forward
multilabel_margin_loss_backward rrelu_with_noise rrelu_with_noise_ rrelu_with_noise_backward
_fft_r2c _fft_c2c _fft_c2r
""".split())
_UPCAST_CHALF = frozenset("""
acos acosh asin asinh atan atanh cos cosh sin sinh tan tanh exp log sqrt rsqrt sigmoid
div logaddexp pow lerp angle prod sum trace
""".split())
_UPCAST = _UPCAST_HALF | _UPCAST_CHALF


def _schema_call(name: str, overload: str, args):
    op = getattr(getattr(torch.ops.aten, name), overload or "default")
    pos, kw = [], {}
    for a, v in zip(op._schema.arguments, args):
        if a.kwarg_only:
            kw[a.name] = v
        else:
            pos.append(v)
    return op, pos, kw


def _write_args(op):
    return [i for i, a in enumerate(op._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _finish(op, args, wide_args, out, narrow):
    """Rounds results back to the narrow dtypes and writes mutated arguments back."""
    for i in _write_args(op):
        t, w = args[i], wide_args[i]
        if isinstance(t, torch.Tensor) and t is not w:
            if t.shape != w.shape:
                t.resize_(w.shape)
            t.copy_(w)

    def back(r, ret):
        if not isinstance(r, torch.Tensor):
            return r
        if ret.alias_info is not None and ret.alias_info.is_write:
            for i in _write_args(op):
                if op._schema.arguments[i].alias_info.before_set == ret.alias_info.before_set:
                    return args[i]
        return r.to(narrow.get(r.dtype, r.dtype))

    rets = op._schema.returns
    if len(rets) == 1:
        return back(out, rets[0])
    return tuple(back(r, ret) for r, ret in zip(out, rets))


def _upcast(name, overload, args):
    lacking = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in _WIDER}
    if not lacking:
        return None
    narrow = {}
    for d in lacking:
        narrow[_WIDER[d]] = d
    if torch.complex32 in lacking:
        narrow.setdefault(torch.float32, torch.float16)  # real results of chalf math (angle)
    wide = [a.to(_WIDER[a.dtype]) if isinstance(a, torch.Tensor) and a.dtype in _WIDER else a
            for a in args]
    wide = [a if not isinstance(a, torch.dtype) else _WIDER.get(a, a) for a in wide]
    op, pos, kw = _schema_call(name, overload, wide)
    return _finish(op, args, wide, op(*pos, **kw), narrow)


def _scalar_as(v, dtype):
    """A Scalar converted to an integer dtype as C++ converts it (truncate, then wrap)."""
    return int(torch.tensor(int(v), dtype=torch.int64).to(dtype))


def _histc_int(name, overload, args):
    self, bins, lo, hi = args[:4]
    if self.dtype not in _INTS:
        return None
    if bins <= 0:
        raise RuntimeError(f"torch.histc: bins must be > 0, but got {bins} for bins")
    lo, hi = _scalar_as(lo, self.dtype), _scalar_as(hi, self.dtype)
    x = self.reshape(-1).to(torch.int64)
    if lo == hi and x.numel() > 0:
        lo, hi = int(x.min()), int(x.max())
    if lo == hi:
        lo, hi = _scalar_as(lo - 1, self.dtype), _scalar_as(hi + 1, self.dtype)
    if not lo < hi:
        raise RuntimeError("torch.histc: max must be larger than min")
    b = torch.div((x - lo) * bins, hi - lo, rounding_mode="floor").clamp_(max=bins - 1)
    # Values outside [lo, hi] go to an extra bin that is dropped: every shape is known before
    # the values are, so on the device nothing waits for them (Transformers' MoE routing calls
    # histc to avoid bincount's device-to-host synchronisation)
    b = torch.where((x >= lo) & (x <= hi), b, bins)
    hist = torch.zeros(bins + 1, dtype=torch.int64, device=x.device)
    hist = hist.scatter_add_(0, b, torch.ones_like(b))[:bins].to(self.dtype)
    if overload == "out":
        out = args[4]
        out.resize_(hist.shape).copy_(hist)
        return out
    return hist


def _abs_bool(name, overload, args):
    self = args[0]
    if self.dtype != torch.bool:
        return None
    if overload == "out":
        args[1].resize_(self.shape).copy_(self)
        return args[1]
    return self.clone()


def _trace(name, overload, args):
    self = args[0]
    if self.dtype == torch.bool:  # CUDA sums the diagonal, which promotes bool to int64
        return self.diagonal().sum()
    return _upcast(name, overload, args)


def _nansum_complex(name, overload, args):
    self = args[0]
    if not self.is_complex():
        return None
    wide = self.to(torch.complex64) if self.dtype == torch.complex32 else self
    clean = torch.where(torch.isnan(wide), torch.zeros((), dtype=wide.dtype), wide)
    op, pos, kw = _schema_call("sum", "dim_IntList" if overload != "out" else "IntList_out",
                               [clean] + list(args[1:]))
    out = op(*pos, **kw)
    if overload != "out" and self.dtype == torch.complex32 and out.dtype == torch.complex64:
        out = out.to(torch.complex32)
    return out


_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_SIGN = -(1 << 63)   # uint64 -> int64 with the unsigned order: flip the top bit

# uint16/uint32/uint64 (PyTorch's "barebones unsigned" dtypes) where CPU's kernels refuse
# them: those CUDA's kernels take (index_select, flip, random_, full count_nonzero,
# amin/amax) and those Inductor compiles (arithmetic, comparisons, reductions), so that eager
# computes what a compiled graph does. uint16/uint32 compute exactly in int64 and wrap back;
# uint64 is reinterpreted as int64: arithmetic modulo 2**64 and bit operations as they are
# (``_U64_SAME``), ordering ops with the top bit flipped (``_U64_ORDER``); others refuse it.
_U64_SAME = frozenset("add sub mul neg bitwise_not bitwise_left_shift __lshift__ __ilshift__ "
                      "index_select gather scatter index_put masked_fill where flip "
                      "count_nonzero nonzero".split())
_U64_ORDER = frozenset("lt le gt ge eq ne minimum maximum amin amax min max argmax argmin "
                       "topk isin".split())
_UNSIGNED_OPS = _U64_SAME | _U64_ORDER | frozenset(
    "floor_divide remainder bitwise_right_shift __rshift__ __irshift__ abs clamp clamp_min "
    "clamp_max pow bincount searchsorted random".split())


_META_DTYPES: dict = {}   # (op, argument signature) -> result dtypes


def _signature(v):
    """What of an argument decides result dtypes: a tensor's dtype and whether it is 0-d (type
    promotion treats those like numbers), a number's type, any other value itself."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.dim() == 0)
    if isinstance(v, (list, tuple)):
        return tuple(_signature(e) for e in v)
    if isinstance(v, (bool, int, float, complex)):
        return type(v)
    return v


def _meta_dtypes(name, overload, args):
    """The result dtypes of ``aten::name.overload`` on these arguments, from its meta function
    (None when it has none: data-dependent shapes, whose results are int64 indices). Cached:
    they depend only on the arguments' dtypes."""
    key = (name, overload, tuple(_signature(a) for a in args))
    if key in _META_DTYPES:
        return _META_DTYPES[key]

    def meta(a):
        return a.to("meta") if isinstance(a, torch.Tensor) else a
    margs = [[meta(v) for v in a] if isinstance(a, (list, tuple)) else meta(a) for a in args]
    o, pos, kw = _schema_call(name, overload, margs)
    try:
        out = o(*pos, **kw)
        got = [t.dtype if isinstance(t, torch.Tensor) else None
               for t in (out if isinstance(out, (tuple, list)) else (out,))]
    except NotImplementedError:  # no meta kernel (nonzero, bincount): they return int64
        got = None
    _META_DTYPES[key] = got
    return got


def _is_number(kind: str, v) -> bool:
    return (kind in ("number", "Optional[number]", "Tensor")
            and isinstance(v, (int, float)) and not isinstance(v, bool))


def _widen(op, args, order: bool, flip: bool):
    """The arguments as int64: uint16/uint32 by value, uint64 by bits (top bit flipped when
    ``order``); numbers in a Tensor slot (``x % 5`` reaches remainder.Tensor) as 0-d tensors.
    Returns the widened arguments and the originals with those numbers wrapped."""
    kinds = [str(a.type) for a in op._schema.arguments]

    def tensor(a):
        if not isinstance(a, torch.Tensor) or a.dtype not in _UNSIGNED:
            return a
        if a.dtype != torch.uint64:
            return a.to(torch.int64)
        w = a.view(torch.int64)
        return w ^ _SIGN if order else w.clone()

    def number(kind, v):
        if flip and isinstance(v, int):
            v = (v % (1 << 64)) - (1 << 63)   # in the flipped order of uint64
        return torch.tensor(v) if kind == "Tensor" else v

    wide = [[tensor(v) for v in a] if isinstance(a, (list, tuple)) else
            number(k, a) if _is_number(k, a) else tensor(a) for k, a in zip(kinds, args)]
    args = [torch.tensor(a) if _is_number(k, a) and k == "Tensor" else a
            for k, a in zip(kinds, args)]
    return wide, args


def _narrow(r, dtype, order: bool):
    if not isinstance(r, torch.Tensor) or dtype is None or r.dtype == dtype:
        return r
    if dtype == torch.uint64:
        return (r ^ _SIGN if order else r).view(torch.uint64)
    return r.to(dtype)


def _unsigned_results(op, args, wide, out, dtypes, order: bool):
    """The int64 results back in the unsigned dtypes; in-place and out= forms write the bits
    into the caller's tensors and return them."""
    written = _write_args(op)
    for i in written:
        t, w = args[i], wide[i]
        if isinstance(t, torch.Tensor) and t is not w:
            if t.shape != w.shape:
                t.resize_(w.shape)
            t.copy_(_narrow(w, t.dtype, order))
    rets = op._schema.returns
    fixed = []
    for j, (r, ret) in enumerate(zip(out if len(rets) > 1 else (out,), rets)):
        alias = ret.alias_info
        if alias is not None and alias.is_write:
            r = next(args[i] for i in written
                     if op._schema.arguments[i].alias_info.before_set == alias.before_set)
        elif dtypes is not None:
            r = _narrow(r, dtypes[j], order)
        fixed.append(r)
    return fixed[0] if len(rets) == 1 else tuple(fixed)


def _unsigned(name, overload, args):
    kinds = {t.dtype for a in args
             for t in (a if isinstance(a, (list, tuple)) else (a,))
             if isinstance(t, torch.Tensor) and t.dtype in _UNSIGNED}
    if not kinds:
        return None
    base = _base(name)
    if torch.uint64 in kinds and base not in _U64_SAME | _U64_ORDER:
        raise NotImplementedError(
            f"aten::{name} of uint64 on neuron: CPU has no kernel, and through int64 only "
            f"modular arithmetic, bit operations and ordering are exact ({name} differs on "
            f"values >= 2**63); use uint32 or int64")
    order = base in _U64_ORDER
    op = _schema_call(name, overload, args)[0]
    wide, args = _widen(op, args, order, flip=order and torch.uint64 in kinds)
    dtypes = _meta_dtypes(name, overload, args) if base != "random" else None
    op, pos, kw = _schema_call(name, overload, wide)
    return _unsigned_results(op, args, wide, op(*pos, **kw), dtypes, order)


_SPECIAL = {"histc": _histc_int, "abs": _abs_bool, "trace": _trace, "nansum": _nansum_complex}


def cpu_refuses(base: str, dtype: torch.dtype) -> bool:
    """Whether CPU's kernel of ``aten::base`` refuses a first argument of ``dtype`` where the
    device computes CUDA's result (the compiler then keeps such a graph off the host path,
    whose CPU meta functions refuse it too)."""
    base = base.rstrip("_")
    if base == "histc":
        return dtype in _INTS
    if base in ("abs", "trace"):
        return dtype == torch.bool
    if base == "nansum":
        return dtype.is_complex
    return base in _UPCAST and dtype == torch.complex32


def _policy_ahead(name: str, overload: str, args: tuple):
    """Asked with the device tensors before the host would wait for the device to run CPU's
    kernel: the special rules, where CPU's kernel refuses the dtype (so that attempt could
    only fail), computed with device ops."""
    base = name.split("::", 1)[1]
    x = args[0] if args else None
    if not (base in _SPECIAL and isinstance(x, torch.Tensor) and cpu_refuses(base, x.dtype)):
        return None
    # Charged as the one op it is on the chip (as when the policy ran after CPU's refusal),
    # its device ops unrecorded
    from .. import _state, cost_model
    from .nkilib_routes import charged_as
    cfg = _state.config()
    nbytes = cost_model.priced_nbytes(x)
    seconds, engine, flops = cost_model.op_seconds(cfg.profile, cfg.lnc, base, [tuple(x.shape)],
                                                   x.dtype, nbytes, 0)
    with charged_as(x.device, base, seconds, engine=engine, flops=flops, hbm_bytes=nbytes):
        return _policy(name, overload, args)


def _base(name: str) -> str:
    """``add`` for ``add_``; dunder names (``__lshift__``) as they are."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _policy(name: str, overload: str, args: tuple):
    base = name.split("::", 1)[1]
    if _base(base) in _UNSIGNED_OPS:
        got = _unsigned(base, overload, list(args))
        if got is not None:
            return got
    rule = _SPECIAL.get(base)
    if rule is not None:
        return rule(base, overload, list(args))
    if base.rstrip("_") in _UPCAST:  # and the in-place forms, exp_ for exp
        return _upcast(base, overload, list(args))
    return None


# torch.fft's composites refuse half precision on any device but CUDA before reaching a
# kernel ("Unsupported dtype Half"). On neuron they are wrapped above autograd: half and
# complex32 inputs are widened (through autograd) and the result rounded back, as CUDA's
# half FFT computes in float32; other dtypes run the composite itself.
_FFT = [n for n in dir(torch.ops.aten) if n.startswith("fft_") and "fftfreq" not in n
        and "fftshift" not in n]
_autograd_lib = torch.library.Library("aten", "IMPL")


def _fft_wrapper(op):
    def kernel(*args, **kwargs):
        x = args[0]
        if x.dtype not in (torch.float16, torch.complex32) or "out" in kwargs:
            return op.decompose(*args, **kwargs)
        y = op(x.to(_WIDER[x.dtype]), *args[1:], **kwargs)
        return y.to(torch.complex32 if y.is_complex() else torch.float16)
    return kernel


def _policy_dtypes() -> dict:
    """Per op, the argument dtypes its rules take: only an argument of one of them makes the
    fallback keep a refused op's arguments for the policy."""
    rules = [(_UPCAST_HALF, (torch.float16, torch.bfloat16, torch.complex32)),
             (_UPCAST_CHALF, (torch.complex32,)), (_UNSIGNED_OPS, _UNSIGNED),
             ({"histc"}, _INTS), ({"abs", "trace"}, (torch.bool,)),
             ({"nansum"}, (torch.complex32, torch.complex64, torch.complex128))]
    out: dict = {}
    for ops, dtypes in rules:
        for base in ops:
            out.setdefault(base, set()).update(dtypes)
    assert set(_SPECIAL) <= set(out), "every special rule names its dtypes"
    return out


def _register():
    for name in _FFT:
        op = getattr(torch.ops.aten, name).default
        _autograd_lib.impl(op, _fft_wrapper(op), "AutogradPrivateUse1")
    for base, dtypes in sorted(_policy_dtypes().items()):
        for name in (base, base + "_"):
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                _C._add_dtype_policy_op("aten::" + name, "" if overload == "default" else overload,
                                        base in _SPECIAL, sorted(dtypes, key=str))
    _C._set_dtype_policy(_policy)
    _C._set_dtype_policy_ahead(_policy_ahead)


_register()
