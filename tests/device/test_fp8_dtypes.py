"""FP8, E8M0 and FP4 tensors on neuron behave exactly as on CPU: storage, casts, views,
indexing, printing, save/load, and the same errors where CPU has no kernel."""
import io

import pytest
import torch

DEV = "neuron"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
ALL = FP8 + [torch.float8_e8m0fnu, torch.float4_e2m1fn_x2]


def _sample(dtype, shape=(6, 8)):
    """Every byte pattern (NaNs, infinities, subnormals, both zeros) shows up over the tests."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)


def _bits(t):
    return t.cpu().view(torch.uint8)


def _same(got, want):
    assert got.device.type == "neuron" and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(_bits(got), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", ALL)
def test_round_trip_and_factories(dtype):
    c = _sample(dtype)
    _same(c.to(DEV), c)
    _same(torch.zeros(3, 5, dtype=dtype, device=DEV), torch.zeros(3, 5, dtype=dtype))
    e = torch.empty(4, dtype=dtype, device=DEV)
    assert e.dtype == dtype and e.device.type == DEV
    _same(c.to(DEV).clone(), c)
    _same(torch.empty_like(c.to(DEV)).copy_(c.to(DEV)), c)
    _same(torch.empty(c.shape, dtype=dtype, device=DEV).copy_(c), c)  # host -> device copy_


@pytest.mark.parametrize("dtype", FP8 + [torch.float8_e8m0fnu])
@pytest.mark.parametrize("wide", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_casts_both_ways_match_cpu(dtype, wide):
    c = _sample(dtype)
    got, want = c.to(DEV).to(wide).cpu(), c.to(wide)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    # Rounding into the narrow type (saturation, NaN, subnormals, ties to even) as CPU does.
    x = torch.cat([torch.randn(512) * 3.0 ** torch.arange(-8, 8).repeat(32),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e6, -1e6, 1e-9])])
    x = x.to(wide)
    _same(x.to(DEV).to(dtype), x.to(dtype))


@pytest.mark.parametrize("dtype", FP8)
def test_casts_between_fp8_and_ints(dtype):
    c = _sample(dtype)
    _same(c.to(DEV).to(torch.float8_e5m2), c.to(torch.float8_e5m2))
    _same(c.to(DEV).to(torch.float8_e4m3fn), c.to(torch.float8_e4m3fn))
    i = torch.arange(-20, 20, dtype=torch.int32)
    _same(i.to(DEV).to(dtype), i.to(dtype))


def test_float4_casts_refused_as_on_cpu():
    c = _sample(torch.float4_e2m1fn_x2)
    with pytest.raises(NotImplementedError) as cpu:
        c.to(torch.float32)
    with pytest.raises(NotImplementedError) as dev:
        c.to(DEV).to(torch.float32).cpu()
    assert str(cpu.value) in str(dev.value)


@pytest.mark.parametrize("dtype", ALL)
def test_views_and_indexing(dtype):
    c = _sample(dtype)
    n = c.to(DEV)
    _same(n.view(torch.uint8), c.view(torch.uint8))
    _same(n.view(torch.int8).view(dtype), c)
    _same(n[1:5, ::3], c[1:5, ::3])
    _same(n.t().contiguous(), c.t().contiguous())
    _same(n.reshape(4, 12), c.reshape(4, 12))
    _same(n[2], c[2])
    _same(n.narrow(1, 2, 3).contiguous(), c.narrow(1, 2, 3).contiguous())
    _same(n.flip(0), c.flip(0))
    _same(n[:1].expand(3, 8).contiguous(), c[:1].expand(3, 8).contiguous())
    _same(torch.cat([n, n[:2]]), torch.cat([c, c[:2]]))
    _same(torch.stack([n, n]), torch.stack([c, c]))
    for part_n, part_c in zip(n.chunk(3, 1), c.chunk(3, 1)):
        _same(part_n.contiguous(), part_c.contiguous())


@pytest.mark.parametrize("dtype", FP8 + [torch.float8_e8m0fnu])
def test_advanced_indexing_matches_cpu(dtype):
    c = _sample(dtype)
    idx = torch.tensor([4, 0, 4, 2])
    _same(c.to(DEV)[idx.to(DEV)], c[idx])
    mask = torch.arange(6) % 2 == 0
    _same(c.to(DEV)[mask.to(DEV)], c[mask])
    _same(torch.where(mask[:, None].to(DEV), c.to(DEV), c.to(DEV).flip(0)),
          torch.where(mask[:, None], c, c.flip(0)))


def _values_printed(s):
    return s.split("device=")[0].split("dtype=")[0].replace(",", " ").split()


@pytest.mark.parametrize("dtype", ALL)
def test_print_matches_cpu(dtype):
    c = _sample(dtype, (3, 4))
    got = str(c.to(DEV))
    assert _values_printed(got) == _values_printed(str(c))
    assert f"device='{DEV}:0'" in got and f"dtype={dtype}" in got
    cpu_exc, cpu = _outcome(lambda: repr(c[0, 0]))  # a float4 scalar has no value to print
    dev_exc, dev = _outcome(lambda: repr(c.to(DEV)[0, 0]))
    assert cpu_exc == dev_exc
    assert cpu in dev if cpu_exc else _values_printed(dev) == _values_printed(cpu)


@pytest.mark.parametrize("dtype", ALL)
def test_save_load_round_trip(dtype):
    c = _sample(dtype)
    buf = io.BytesIO()
    torch.save({"w": c.to(DEV), "v": c.to(DEV)[1:3]}, buf)
    buf.seek(0)
    back = torch.load(buf)
    _same(back["w"], c)
    _same(back["v"], c[1:3])
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert torch.equal(on_cpu["w"].view(torch.uint8), c.view(torch.uint8))
    buf = io.BytesIO()
    torch.save(c, buf)
    buf.seek(0)
    _same(torch.load(buf, map_location=DEV), c)


def _outcome(fn):
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - the outcome compared is the exception itself
        return type(e), str(e)
    return None, r


_OPS = {
    "mul": lambda t: t * t, "add": lambda t: t + t, "neg": lambda t: -t, "sum": lambda t: t.sum(),
    "index_copy": lambda t: t.clone().index_copy_(0, torch.tensor([0], device=t.device), t[:1]),
    "gather": lambda t: t.gather(0, torch.zeros(1, 8, dtype=torch.long, device=t.device)),
    "sort": lambda t: t.sort()[0], "arange": lambda t: torch.arange(3, dtype=t.dtype, device=t.device),
    "rand": lambda t: torch.rand(2, dtype=t.dtype, device=t.device), "abs": lambda t: t.abs(),
    "eq": lambda t: t == t, "max": lambda t: t.max(), "clamp": lambda t: t.clamp(0, 1),
    "fill": lambda t: t.clone().fill_(1.0), "mm": lambda t: t @ t.t(),
    "stack_inner": lambda t: torch.stack([t, t], 1),
}


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("op", _OPS)
def test_ops_as_cpu_or_the_same_error(dtype, op):
    c = _sample(dtype)
    if dtype in FP8:
        c = torch.randn(6, 8).to(dtype)  # finite values, so results compare bit for bit
    cpu_exc, cpu = _outcome(lambda: _OPS[op](c))
    dev_exc, dev = _outcome(lambda: _OPS[op](c.to(DEV)).cpu())
    assert cpu_exc == dev_exc, (cpu, dev)
    if cpu_exc is not None:
        assert cpu in dev  # CPU's message, with the device's context around it
    else:
        assert dev.dtype == cpu.dtype and torch.equal(dev.view(torch.uint8) if dev.dtype.itemsize == 1
                                                       and dev.dtype != torch.bool else dev,
                                                       cpu.view(torch.uint8) if cpu.dtype.itemsize == 1
                                                       and cpu.dtype != torch.bool else cpu)
    assert (torch.ones(2, device=DEV) + 1).cpu().tolist() == [2.0, 2.0]  # the device stays usable
