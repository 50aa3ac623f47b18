"""AWS's nki.language.NkiTensor methods, name by name (its reference page's autosummary), and
the view operations checked against numpy's views of the same data."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E
from nki.simulator.tensor import NkiTensor

# nki.language.NkiTensor: Methods and Attributes (AWS's NKI API reference)
METHODS = ["ap", "broadcast", "expand_dim", "flatten_dims", "get_pattern", "indirect",
           "is_contiguous", "is_indirect", "permute", "rearrange", "reshape", "reshape_dim",
           "select", "slice", "squeeze_dim", "vector_select", "view", "reinterpret_cast"]
# not implemented here: a clear UnsupportedError naming the alternative
UNSUPPORTED = {"indirect", "vector_select", "rearrange", "view", "reinterpret_cast"}


@pytest.mark.parametrize("name", METHODS)
def test_documented_method_exists(name):
    assert name in dir(NkiTensor)


def _through(view_fn, x, out_shape, buffer=nl.sbuf):
    """Load x into a tile in ``buffer``, copy ``view_fn(tile)`` into a fresh tile, store it."""
    @nki.jit
    def kernel(x):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=buffer)
        nisa.dma_copy(dst=t, src=x)
        u = nl.ndarray(out_shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=view_fn(t))
        out = nl.ndarray(out_shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=u)
        return out
    return np.asarray(kernel(x))


X = np.arange(128 * 4 * 32, dtype=np.float32).reshape(128, 4, 32)


@pytest.mark.parametrize("view, ref", [
    (lambda t: t.slice(2, 3, 27, 2), lambda x: x[:, :, 3:27:2]),
    (lambda t: t.slice(-1, 0, 16), lambda x: x[:, :, :16]),
    (lambda t: t.select(1, 2), lambda x: x[:, 2]),
    (lambda t: t.permute((0, 2, 1)), lambda x: x.transpose(0, 2, 1)),
    (lambda t: t.reshape_dim(2, (4, -1)), lambda x: x.reshape(128, 4, 4, 8)),
    (lambda t: t.flatten_dims(1, 2), lambda x: x.reshape(128, 128)),
    (lambda t: t.expand_dim(1).squeeze_dim(1), lambda x: x),
    (lambda t: t.select(1, 0).expand_dim(1).broadcast(1, 3), lambda x: np.repeat(x[:, :1], 3, 1)),
    (lambda t: t.ap(t.get_pattern()), lambda x: x),
])
def test_views_read_as_numpy_s(view, ref):
    want = ref(X)
    np.testing.assert_array_equal(_through(view, X, want.shape), want)


def test_views_write_through():
    @nki.jit
    def kernel(x):
        t = nl.ndarray((128, 4, 32), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        nisa.dma_copy(dst=t.permute((0, 2, 1)).select(2, 1), src=x)   # column 1 of dim 1
        out = nl.ndarray((128, 4, 32), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    x = np.arange(128 * 32, dtype=np.float32).reshape(128, 32)
    want = np.zeros((128, 4, 32), np.float32)
    want[:, 1, :] = x
    np.testing.assert_array_equal(np.asarray(kernel(x)), want)


def test_contiguity_and_patterns():
    seen = {}

    @nki.jit
    def kernel(x):
        t = nl.ndarray((128, 4, 32), dtype=nl.float32, buffer=nl.sbuf)
        seen.update(whole=t.is_contiguous(), part=t.slice(2, 0, 16).is_contiguous(),
                    rows=t.slice(0, 0, 64).is_contiguous(), pattern=t.get_pattern(),
                    indirect=t.is_indirect())
        return x
    kernel(np.ones((1, 1), np.float32))
    assert seen == dict(whole=True, part=False, rows=True,
                        pattern=[[128, 128], [32, 4], [1, 32]], indirect=False)


@pytest.mark.parametrize("bad, error, match", [
    (lambda t: t.select(0, 3), E.ShapeMismatchError, "partition dimension"),
    (lambda t: t.permute((1, 0, 2)), E.ShapeMismatchError, "partition dimension"),
    (lambda t: t.flatten_dims(0, 1), E.ShapeMismatchError, "partition dimension"),
    (lambda t: t.squeeze_dim(1), E.ShapeMismatchError, "has size 4, not 1"),
    (lambda t: t.broadcast(2, 8), E.ShapeMismatchError, "has size 32, not 1"),
    (lambda t: t.select(1, 4), E.IndexOutOfBoundsError, "out of range"),
    (lambda t: t.slice(3, 0, 1), E.ShapeMismatchError, "dim 3 out of range"),
    (lambda t: t.permute((0, 1, 1)), E.ShapeMismatchError, "not a permutation"),
    (lambda t: t.rearrange("p a b -> p b a"), E.UnsupportedError, "rearrange"),
    (lambda t: t.reinterpret_cast, E.UnsupportedError, "reinterpret_cast"),
])
def test_bad_views_are_refused(bad, error, match):
    @nki.jit
    def kernel(x):
        bad(nl.ndarray((128, 4, 32), dtype=nl.float32, buffer=nl.sbuf))
        return x
    with pytest.raises(error, match=match):
        kernel(np.ones((1, 1), np.float32))


def test_hbm_views_may_use_dim_0():
    @nki.jit
    def kernel(x):
        out = nl.ndarray((32, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((32, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.select(0, 5).permute((1, 0)))
        nisa.dma_copy(dst=out, src=t)
        return out
    x = np.arange(8 * 4 * 32, dtype=np.float32).reshape(8, 4, 32)
    np.testing.assert_array_equal(np.asarray(kernel(x)), x[5].T)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED - {"reinterpret_cast"}))
def test_unimplemented_methods_say_so(name):
    @nki.jit
    def kernel(x):
        getattr(nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf), name)(nl.float32)
        return x
    with pytest.raises(E.UnsupportedError, match=name):
        kernel(np.ones((1, 1), np.float32))
