"""uint16/uint32/uint64 (PyTorch's barebones unsigned dtypes) where CUDA's kernels take them
and CPU's refuse them: neuron computes CUDA's results. Reference: NumPy's unsigned integers,
which wrap as C's do."""
import numpy as np
import pytest
import torch

DEV = "neuron"
_NP = {torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}


def _values(dtype):
    bits = np.iinfo(_NP[dtype]).bits
    v = [0, 1, 2, 3, 7, 250, (1 << bits) - 1, (1 << (bits - 1)) + 5, (1 << (bits - 1)) - 1,
         12345 % (1 << bits), 40000 % (1 << bits), 9]
    return np.array(v, dtype=_NP[dtype])


def _tensor(a):
    return torch.from_numpy(a.copy()).to(DEV)


def _numpy(t):
    t = t.cpu()
    if t.dtype in _NP:
        return t.numpy()
    return t.numpy()


A = 3  # a shift, divisor and scalar operand
# name -> (torch on the device tensors a, b; NumPy on arrays a, b)
_ALL = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "add_scalar": (lambda a, b: a + A, lambda a, b: a + a.dtype.type(A)),
    "sub": (lambda a, b: a - b, lambda a, b: a - b),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "neg": (lambda a, b: -a, lambda a, b: np.negative(a)),
    "bitwise_not": (lambda a, b: ~a, lambda a, b: np.invert(a)),
    "lshift": (lambda a, b: a << A, lambda a, b: np.left_shift(a, a.dtype.type(A))),
    "lt": (lambda a, b: a < b, lambda a, b: a < b),
    "ge_scalar": (lambda a, b: a >= 250, lambda a, b: a >= 250),
    "maximum": (lambda a, b: torch.maximum(a, b), np.maximum),
    "minimum": (lambda a, b: torch.minimum(a, b), np.minimum),
    "amax": (lambda a, b: a.amax(), lambda a, b: a.max()),
    "amin": (lambda a, b: a.amin(), lambda a, b: a.min()),
    "max": (lambda a, b: a.max(), lambda a, b: a.max()),
    "argmax": (lambda a, b: a.argmax(), lambda a, b: np.int64(a.argmax())),
    "argmin": (lambda a, b: a.argmin(), lambda a, b: np.int64(a.argmin())),
    "topk": (lambda a, b: a.topk(4)[0], lambda a, b: np.sort(a)[::-1][:4]),
    "topk_indices": (lambda a, b: a.topk(1)[1], lambda a, b: np.array([a.argmax()])),
    "where": (lambda a, b: torch.where(a > b, a, b), lambda a, b: np.where(a > b, a, b)),
    "flip": (lambda a, b: a.flip(0), lambda a, b: a[::-1]),
    "index_select": (lambda a, b: a.index_select(0, torch.tensor([6, 0, 6], device=DEV)),
                     lambda a, b: a[[6, 0, 6]]),
    "gather": (lambda a, b: a.gather(0, torch.tensor([7, 1], device=DEV)), lambda a, b: a[[7, 1]]),
    "masked_fill": (lambda a, b: a.masked_fill(a > b, 9),
                    lambda a, b: np.where(a > b, a.dtype.type(9), a)),
    "nonzero": (lambda a, b: (a - b).nonzero().flatten(), lambda a, b: np.nonzero(a - b)[0]),
    "count_nonzero": (lambda a, b: torch.count_nonzero(a - b),
                      lambda a, b: np.int64(np.count_nonzero(a - b))),
    "isin": (lambda a, b: torch.isin(a, b[:5]), lambda a, b: np.isin(a, b[:5])),
}
# uint64 computes only these exactly through int64: the others raise for it
_NARROW = {
    "floor_divide": (lambda a, b: a // A, lambda a, b: a // a.dtype.type(A)),
    "remainder": (lambda a, b: a % 7, lambda a, b: a % a.dtype.type(7)),
    "rshift": (lambda a, b: a >> A, lambda a, b: np.right_shift(a, a.dtype.type(A))),
    "pow": (lambda a, b: a ** 3, lambda a, b: a ** a.dtype.type(3)),
    "abs": (lambda a, b: a.abs(), lambda a, b: a),
    "clamp": (lambda a, b: a.clamp(2, 300), lambda a, b: np.clip(a, 2, 300)),
    "bincount": (lambda a, b: torch.bincount(a % 11), lambda a, b: np.bincount(a % 11)),
    "searchsorted": (lambda a, b: torch.searchsorted(a.sort()[0], b),
                     lambda a, b: np.searchsorted(np.sort(a), b)),
}


def _cases():
    for dtype in _NP:
        for name in _ALL:
            yield pytest.param(dtype, name, _ALL[name], id=f"{name}-{str(dtype)[6:]}")
        if dtype != torch.uint64:
            for name in _NARROW:
                yield pytest.param(dtype, name, _NARROW[name], id=f"{name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("dtype,name,fns", list(_cases()))
def test_unsigned_op_matches_numpy(dtype, name, fns):
    a = _values(dtype)
    b = np.roll(a, 3)
    with np.errstate(over="ignore"):
        want = np.asarray(fns[1](a, b))
    got = fns[0](_tensor(a), _tensor(b))
    assert got.device.type == DEV
    if want.dtype.kind == "u":
        assert got.dtype == dtype
    np.testing.assert_array_equal(_numpy(got), want)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_in_place_and_out(dtype):
    a, b = _values(dtype), np.roll(_values(dtype), 1)
    x = _tensor(a)
    x.add_(_tensor(b))
    np.testing.assert_array_equal(_numpy(x), a + b)
    out = torch.empty(0, dtype=dtype, device=DEV)
    torch.maximum(_tensor(a), _tensor(b), out=out)
    np.testing.assert_array_equal(_numpy(out), np.maximum(a, b))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32])
def test_unsigned_random_covers_the_range(dtype):
    torch.neuron.manual_seed(0)
    r = torch.empty(20000, dtype=dtype, device=DEV).random_()
    assert r.dtype == dtype
    wide = r.cpu().to(torch.int64)
    top = 1 << np.iinfo(_NP[dtype]).bits
    assert wide.min() >= 0 and wide.max() < top and wide.max() > top // 2
    s = torch.empty(1000, dtype=dtype, device=DEV).random_(5, 9).cpu().to(torch.int64)
    assert set(s.tolist()) == {5, 6, 7, 8}


def test_uint64_division_is_a_clear_error_and_the_device_stays_usable():
    x = torch.tensor([5, -3], dtype=torch.int64).view(torch.uint64).to(DEV)
    with pytest.raises(NotImplementedError, match="floor_divide of uint64 on neuron"):
        (x // 2).cpu()
    assert ((x + x) == x * 2).all().item()
