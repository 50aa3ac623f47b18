"""Stochastic rounding of fp32 results to bf16 and fp16 (``NEURON_RT_STOCHASTIC_ROUNDING_EN``).

NeuronCores compute in fp32 and round each bf16/fp16 result once, to nearest even by default
or, with the runtime's switch on, stochastically: up with probability equal to the distance
from the value below, in units of the gap between the two. The switch is read at import, as
AWS's runtime reads it when it loads a model. While it is on:

* a cast to bf16/fp16 on the device (``.to``, ``copy_``) rounds stochastically (the C++ copy
  kernel hands it to :func:`_copy`);
* an op with a bf16/fp16 tensor or dtype among its arguments goes to :func:`_op` (from the
  boxed fallback, before the launch path and the Adaptive Eager window, and from the
  convolution kernels): if its Meta kernel says it produces or writes bf16/fp16, it runs in
  fp32 (arguments widened exactly) and each narrow result is rounded stochastically.

The random bits come from the device's generator (``torch.manual_seed``,
``torch.neuron.manual_seed``), or, when ``NEURON_RT_STOCHASTIC_ROUNDING_SEED`` is set, from a
generator of their own seeded with it, as AWS's runtime seeds its rounding unit.
Switched off, none of this runs: the C++ checks one flag.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from .. import _C
from ._meta import to_meta

_NARROW = (torch.float16, torch.bfloat16)
_CODE = {5: torch.float16, 15: torch.bfloat16}  # c10::ScalarType as dtype arguments arrive
_FLOAT_CODE = 6
# Significand bits and smallest normal exponent of each target: its spacing is
# 2**(max(exponent, emin) - bits).
_GRID = {torch.float16: (10, -14), torch.bfloat16: (7, -126)}
_BITS = 16  # random bits per rounding

# Ops whose bf16/fp16 results are input values or constants (movement, selection, fills):
# nothing is rounded from fp32, so they keep their narrow CPU kernels. Constants (fill_,
# masked_fill, clamp bounds) are converted to nearest even once, as a compiler folds them.
_EXACT = frozenset("""
cat stack gather index_select index take masked_select masked_scatter masked_fill masked_fill_
scatter scatter_ index_fill index_fill_ fill fill_ zero zero_ where clone contiguous
neg neg_ abs abs_ relu relu_ sign sign_ floor floor_ ceil ceil_ trunc trunc_ copysign
max min amax amin maximum minimum fmax fmin sort topk kthvalue median nanmedian mode
flip roll repeat repeat_interleave constant_pad_nd reflection_pad1d reflection_pad2d
reflection_pad3d replication_pad1d replication_pad2d replication_pad3d narrow_copy
slice_scatter select_scatter diagonal_scatter as_strided_scatter tril triu tril_ triu_ diag_embed
embedding max_pool2d_with_indices max_pool3d_with_indices nonzero unique _unique2
unique_consecutive unique_dim empty_like zeros_like ones_like full_like new_empty new_zeros
new_ones new_full new_empty_strided alias detach lift_fresh lift _unsafe_view nextafter
equal eq ne lt le gt ge isnan isinf isfinite argmax argmin clamp clamp_ clamp_min clamp_max
clamp_min_ clamp_max_ hardtanh hardtanh_ threshold threshold_ permute_copy expand_copy
transpose_copy t_copy unsqueeze_copy squeeze_copy view_copy slice_copy select_copy
""".split())

_on_import = False  # the switch as read at import, for docs and tests
_seed_env = None
_generators: dict = {}
_infos: dict = {}


def _env_switch(name: str) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    warnings.warn(f"{name}={raw!r} is not a boolean (1/0, true/false): stochastic rounding "
                  "stays off", stacklevel=2)
    return False


def _env_seed(name: str):
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw.strip(), 0)
    except ValueError:
        warnings.warn(f"{name}={raw!r} is not an integer: stochastic rounding draws from the "
                      "device's generator", stacklevel=2)
        return None


def _set_stochastic_rounding(enabled: bool) -> None:
    """Turns stochastic rounding on or off for the whole process (tests; AWS has only the
    environment variable). Compiled graphs keep rounding to nearest even (docs/precision.md)."""
    _C._synchronize_all()
    _C._set_stochastic_rounding(bool(enabled))


def _stochastic_rounding_enabled() -> bool:
    return bool(_C._stochastic_rounding_enabled())


# --- the rounding -------------------------------------------------------------------------

def _random_bits(shape, device) -> torch.Tensor:
    """Uniform integers in [0, 2**16), one per element."""
    if _seed_env is None:
        return torch.randint(0, 1 << _BITS, shape, dtype=torch.int32, device=device)
    idx = device.index if device.index is not None else torch.neuron.current_device()
    gen = _generators.get(idx)
    if gen is None:
        gen = _generators[idx] = torch.Generator().manual_seed(_seed_env)
    return torch.randint(0, 1 << _BITS, shape, dtype=torch.int32, generator=gen).to(device)


def _round_bf16_from_fp32(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of fp32: adding 16 random bits to the pattern and dropping the
    # low half rounds up exactly when the random bits reach the dropped fraction. The sign
    # bit stays put, so magnitudes round; the largest finite values may carry into inf, the
    # bf16 value after bf16's maximum on an unbounded grid.
    y = (x.view(torch.int32) + r).bitwise_and_(-(1 << 16)).view(torch.float32)
    return torch.where(torch.isnan(x), x, y).to(torch.bfloat16)


def _round_fp16_from_fp32(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    # fp16 keeps 10 of fp32's 23 significand bits: as for bf16, with 13 random bits. Below
    # fp16's smallest normal the spacing stays 2**-24: adding 2**-14 moves |x| into the
    # binade where fp32 keeps exactly 13 bits more than that spacing (the addition rounds
    # only bits below 2**-37), and subtracting it afterwards is exact. Values that carry
    # past 65504 land on 65536 or beyond, which the conversion makes inf.
    a = x.abs()
    tiny = a < 2.0 ** -14
    shifted = torch.where(tiny, a + 2.0 ** -14, a)
    y = (shifted.view(torch.int32) + (r >> 3)).bitwise_and_(-(1 << 13)).view(torch.float32)
    y = torch.where(tiny, y - 2.0 ** -14, y).copysign(x)
    return torch.where(torch.isnan(x), x, y).to(torch.float16)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    # 2**k in float64 built from its exponent field: exact (ldexp's pow goes through the
    # default dtype, fp32, which overflows at bf16's subnormal spacing 2**-133).
    return ((k + 1023) << 52).view(torch.float64)


def _round_on_grid(x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # fp64 sources. In float64, where the sums below are exact: scale |x| so
    # the target's spacing at |x| is 1 (subnormals share the smallest normal spacing), add
    # the random fraction, floor. Past the target's maximum the grid continues with the top
    # binade's spacing, and the conversion turns what lands beyond it into inf.
    bits, emin = _GRID[dtype]
    a = x.to(torch.float64).abs()
    _, e = torch.frexp(a)
    step = torch.clamp(e.to(torch.int64) - 1, min=emin) - bits
    n = torch.floor(a * _pow2(-step) + r.to(torch.float64) * 2.0 ** -_BITS)
    y = (n * _pow2(step)).copysign(x.to(torch.float64))
    return torch.where(torch.isfinite(x), y, x.to(torch.float64)).to(dtype)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (a wider float) rounded stochastically to ``dtype`` (bf16 or fp16)."""
    r = _random_bits(x.shape, x.device)
    if x.dtype == torch.float64:
        return _round_on_grid(x, r, dtype)
    x = x.to(torch.float32).contiguous()  # exact from bf16/fp16
    if dtype == torch.bfloat16:
        return _round_bf16_from_fp32(x, r)
    return _round_fp16_from_fp32(x, r)


def _applies(dtype) -> bool:
    """Whether a result rounded to ``dtype`` now rounds stochastically: the switch is on and
    the dtype is bf16/fp16 (the kernels that write device memory directly ask this)."""
    return dtype in _NARROW and _stochastic_rounding_enabled()


def _nki_rounder(device):
    """The NKI simulator's rounder for a kernel running on ``device`` (nki_bridge.rounding):
    bf16/fp16 writes of the kernel's engines round stochastically from the device's
    generator, as the hardware's output stage does with the switch on; None with it off."""
    if not _stochastic_rounding_enabled():
        return None
    rounders = {"bfloat16": _round_bf16_from_fp32, "float16": _round_fp16_from_fp32}

    def rnd(name, values):
        x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        r = _random_bits(x.shape, device).cpu()
        return rounders[name](x, r).float().numpy()
    return rnd


def _round_into(dst: torch.Tensor, wide: torch.Tensor) -> None:
    if dst.shape != wide.shape:
        dst.resize_(wide.shape)
    dst.copy_(_round(wide, dst.dtype))


def _copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` where it narrows a float to bf16/fp16 on the device."""
    wide_dtype = torch.float64 if src.dtype == torch.float64 else torch.float32
    wide = src.to(device=dst.device, dtype=wide_dtype)
    if wide.shape != dst.shape:
        wide = wide.expand(dst.shape)  # each destination element rounds on its own
    dst.copy_(_round(wide, dst.dtype))


# --- ops ----------------------------------------------------------------------------------

class _Info:
    """What the handler needs of an op's schema, computed once per op."""

    def __init__(self, op, overload: str):
        args = op._schema.arguments
        self.op = op
        self.kwarg_only = [a.kwarg_only for a in args]
        self.names = [a.name for a in args]
        self.dtype_args = [i for i, a in enumerate(args) if "ScalarType" in str(a.real_type)]
        self.writes = [i for i, a in enumerate(args)
                       if a.alias_info is not None and a.alias_info.is_write]
        self.ret_arg = []  # per return: the argument it is, or -1
        for ret in op._schema.returns:
            j = -1
            if ret.alias_info is not None and ret.alias_info.is_write:
                for i in self.writes:
                    if args[i].alias_info.before_set == ret.alias_info.before_set:
                        j = i
            self.ret_arg.append(j)
        # (scatter's reduce overloads sum: not exact)
        self.exact = op._schema.name.split("::", 1)[1] in _EXACT and "reduce" not in overload


def _info(name: str, overload: str) -> _Info:
    key = (name, overload)
    info = _infos.get(key)
    if info is None:
        ns, base = name.split("::", 1)
        op = getattr(getattr(getattr(torch.ops, ns), base), overload or "default")
        info = _infos[key] = _Info(op, overload)
    return info


def _call(info: _Info, args):
    pos, kw = [], {}
    for flag, name, v in zip(info.kwarg_only, info.names, args):
        if flag:
            kw[name] = v
        else:
            pos.append(v)
    return info.op(*pos, **kw)


def _is_narrow(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype in _NARROW


def _tensors(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _signature(v):
    """What a Meta kernel's outcome can depend on; None: not cacheable."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, tuple(v.shape), tuple(v.stride()), v.device.type)
    if isinstance(v, (list, tuple)):
        parts = tuple(_signature(t) for t in v)
        return None if any(p is None for p in parts) else parts
    if isinstance(v, _PLAIN):
        return (type(v), v)
    return None


_meta_cache: dict = {}
_FAILED = object()


def _result_dtypes_cached(info: _Info, args):
    """_result_dtypes, remembered per argument signature (training loops repeat them;
    the Meta kernel is half the handler's time). _FAILED: the Meta kernel raised."""
    parts = tuple(_signature(a) for a in args)
    key = None if any(p is None for p, a in zip(parts, args) if a is not None) else (info, parts)
    if key is not None and key in _meta_cache:
        return _meta_cache[key]
    try:
        got = _result_dtypes(info, args)
    except Exception:  # noqa: BLE001 - the op then runs as it is and raises CPU's error
        got = _FAILED
    if key is not None:
        if len(_meta_cache) > 20000:
            _meta_cache.clear()
        _meta_cache[key] = got
    return got


def _result_dtypes(info: _Info, args):
    """Per return, the dtype (or list of dtypes) the op produces; None if it has no Meta
    kernel for these arguments. An error from the Meta kernel is re-raised by the caller
    running the op as it is."""
    try:
        out = _call(info, [to_meta(a) for a in args])
    except NotImplementedError:
        return None
    if len(info.ret_arg) == 1:
        out = (out,)
    elif not info.ret_arg:
        out = ()
    return [[t.dtype for t in _tensors(o)] if isinstance(o, (list, tuple))
            else (o.dtype if isinstance(o, torch.Tensor) else None) for o in out]


def _guess_dtypes(info: _Info, args):
    # Without a Meta kernel: results are narrow when every float input is of one narrow
    # dtype (the op's type promotion cannot widen them); mixed inputs are not guessed.
    floats = {t.dtype for a in args for t in _tensors(a) if t.is_floating_point()}
    for i in info.dtype_args:
        if args[i] is not None:
            floats.add(_CODE.get(args[i], args[i]) if isinstance(args[i], int) else args[i])
    if len(floats) != 1 or next(iter(floats)) not in _NARROW:
        return None
    return next(iter(floats))


def _mixed(args) -> bool:
    return len({t.dtype for a in args for t in _tensors(a)
                if t.is_floating_point() and t.dim() > 0}) > 1


def _widen(v):
    if _is_narrow(v):
        return v.to(torch.float32)
    if isinstance(v, (list, tuple)) and any(_is_narrow(t) for t in v):
        return type(v)(_widen(t) for t in v)
    return v


def _narrow_back(r, dtype):
    if (isinstance(r, torch.Tensor) and dtype in _NARROW and r.dtype != dtype
            and r.is_floating_point()):
        return _round(r, dtype)
    return r


def _op(name: str, overload: str, args: tuple):
    """The op computed in fp32 with its narrow results rounded stochastically, or None
    (nothing to round: the fallback runs it as it is)."""
    info = _info(name, overload)
    if info.exact:
        return None
    args = list(args)
    if any(t.layout != torch.strided for a in args for t in _tensors(a)):
        return None  # sparse: rounds to nearest even (docs/precision.md)
    dtypes = _result_dtypes_cached(info, args)
    if dtypes is _FAILED:
        return None
    writes_narrow = any(_is_narrow(t) for i in info.writes for t in _tensors(args[i]))
    if dtypes is None:
        guess = _guess_dtypes(info, args)
        if guess is None:
            return None
        dtypes = [guess] * len(info.ret_arg)
    elif not writes_narrow and (_mixed(args) or not any(
            d in _NARROW or (isinstance(d, list) and any(x in _NARROW for x in d))
            for d in dtypes)):
        # Mixed float operands with a narrow functional result: an op that does not
        # promote (mm(bf16, fp32)), whose Meta kernel may not check what CPU refuses.
        return None

    wide = [_widen(a) for a in args]
    for i in info.dtype_args:
        v = wide[i]
        if v in _NARROW or (isinstance(v, int) and v in _CODE):
            wide[i] = torch.float32 if isinstance(v, torch.dtype) else _FLOAT_CODE
    out = _call(info, wide)

    for i in info.writes:
        for t, w in zip(_tensors(args[i]), _tensors(wide[i])):
            if t is not w:
                _round_into(t, w)

    if not info.ret_arg:
        return ()  # (None would mean "not handled" to the fallback)
    outs = (out,) if len(info.ret_arg) == 1 else tuple(out)
    results = []
    for o, arg, d in zip(outs, info.ret_arg, dtypes):
        if arg >= 0:
            results.append(args[arg])
        elif isinstance(o, (list, tuple)):
            ds = d if isinstance(d, list) else [d] * len(o)
            results.append([_narrow_back(t, x) for t, x in zip(o, ds)])
        else:
            results.append(_narrow_back(o, d))
    return results[0] if len(results) == 1 else tuple(results)


def _install() -> None:
    global _on_import, _seed_env
    _C._set_stochastic_rounding_hooks(_op, _copy)
    _seed_env = _env_seed("NEURON_RT_STOCHASTIC_ROUNDING_SEED")
    _on_import = _env_switch("NEURON_RT_STOCHASTIC_ROUNDING_EN")
    if _on_import:
        _C._set_stochastic_rounding(True)


_install()
