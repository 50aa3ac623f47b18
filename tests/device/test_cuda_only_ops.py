"""Every ATen op CUDA registers and CPU does not: on neuron, a kernel equal to CPU's math or
an error that names the op and says why. The op list is rebuilt from the installed torch's
native_functions.yaml, so a torch that adds one fails here until it is decided."""
import os

import pytest
import torch
import torch.nn.functional as F
import yaml

from torch_neuronx.kernels.cuda_only import _OPS

DEV = "neuron"


def _cuda_only_ops():
    import torchgen
    path = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "ATen", "native",
                        "native_functions.yaml")
    with open(path) as f:
        entries = yaml.safe_load(f)
    out = set()
    for e in entries:
        keys = {k.strip() for spec in (e.get("dispatch") or {}) for k in spec.split(",")}
        if not keys or any(k.startswith("Composite") for k in keys):
            continue
        if "CUDA" in keys and "CPU" not in keys:
            out.add(e["func"].split("(")[0])
    return out


def test_table_is_the_installed_torchs_cuda_only_ops():
    found = _cuda_only_ops()
    assert found, "native_functions.yaml lists no CUDA-only op: the parser is broken"
    assert set(_OPS) == found, (sorted(found - set(_OPS)), sorted(set(_OPS) - found))


@pytest.mark.parametrize("op", sorted(_OPS))
def test_each_op_has_a_neuron_kernel(op):
    name = "aten::" + op
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"), name


@pytest.mark.parametrize("op", sorted(k for k, v in _OPS.items() if v is not None))
def test_refused_ops_name_the_op_and_the_reason(op):
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name)
    fn = getattr(packet, overload or "default")
    x = torch.ones(2, device=DEV)
    with pytest.raises(NotImplementedError, match=f"aten::{op} is not available on the neuron device"):
        args, kwargs = _placeholder_args(fn, x)
        fn(*args, **kwargs)
    assert (x + 1).cpu().tolist() == [2.0, 2.0]  # the device stays usable


def _placeholder_args(fn, x):
    # A refusing kernel ignores its arguments' values; they only have to parse and route.
    def value(ty, n=None):
        kind = ty.kind()
        if kind == "OptionalType":
            return None
        if kind == "ListType":
            return [value(ty.getElementType())] * (n or 2)
        return {"TensorType": x, "IntType": 1, "SymIntType": 1, "FloatType": 0.0,
                "BoolType": False, "StringType": "none", "NumberType": 1,
                "ScalarTypeType": torch.float32}.get(kind, 1)
    args = [value(a.type, a.N) for a in fn._schema.arguments if not a.kwarg_only]
    kwargs = {a.name: DEV if a.name == "device" else value(a.type, a.N)
              for a in fn._schema.arguments if a.kwarg_only}
    return args, kwargs


def _same(a, b, **kw):
    torch.testing.assert_close(a.cpu(), b, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmuls_with_out_dtype(dtype):
    a, b = torch.randn(4, 6, dtype=dtype), torch.randn(6, 5, dtype=dtype)
    c = torch.randn(4, 5, dtype=torch.float32)
    ref = a.double() @ b.double()
    got = torch.mm(a.to(DEV), b.to(DEV), out_dtype=torch.float32)
    assert got.dtype == torch.float32
    _same(got, ref.float(), rtol=1e-6, atol=1e-6)
    got = torch.addmm(c.to(DEV), a.to(DEV), b.to(DEV), out_dtype=torch.float32, beta=0.5, alpha=2)
    _same(got, (0.5 * c.double() + 2 * ref).float(), rtol=1e-6, atol=1e-5)
    A, B = torch.randn(3, 4, 6, dtype=dtype), torch.randn(3, 6, 5, dtype=dtype)
    _same(torch.bmm(A.to(DEV), B.to(DEV), out_dtype=torch.float32), (A.double() @ B.double()).float(),
          rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="out_dtype must be the same as input dtype or fp32"):
        torch.mm(a.to(DEV), b.to(DEV), out_dtype=torch.float64)


def test_fused_dropout_and_masked_scale():
    x = torch.randn(1000, device=DEV)
    out, mask = torch._fused_dropout(x, 0.8)
    assert mask.dtype == torch.uint8 and 0.7 < mask.float().mean().item() < 0.9
    _same(out, (x.cpu() * mask.cpu() / 0.8), rtol=1e-6, atol=0)
    _same(torch._masked_scale(x, mask, 2.0), x.cpu() * mask.cpu() * 2.0)


def test_depthwise_convolutions_equal_cpu_grouped_convolution():
    x, w, b = torch.randn(2, 4, 9, 9), torch.randn(8, 1, 3, 3), torch.randn(8)
    got = torch.ops.aten._conv_depthwise2d(x.to(DEV), w.to(DEV), [3, 3], b.to(DEV), [2, 1], [1, 0], [1, 1])
    _same(got, F.conv2d(x, w, b, (2, 1), (1, 0), 1, 4), rtol=0, atol=0)
    x3, w3 = torch.randn(1, 3, 5, 6, 7), torch.randn(3, 1, 2, 2, 2)
    got = torch.ops.aten.conv_depthwise3d(x3.to(DEV), w3.to(DEV), [2, 2, 2], None, [1, 1, 1], [0, 0, 0], [1, 1, 1])
    _same(got, F.conv3d(x3, w3, None, 1, 0, 1, 3), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_backward_equals_autograd_on_cpu(dtype):
    x = torch.randn(3, 5, 16, dtype=dtype)
    w = torch.randn(16, dtype=dtype)
    g = torch.randn(3, 5, 16, dtype=dtype)
    _, rstd = torch.ops.aten._fused_rms_norm(x.to(DEV), [16], w.to(DEV), 1e-6)
    gi, gw = torch.ops.aten._fused_rms_norm_backward(g.to(DEV), x.to(DEV), [16], rstd, w.to(DEV), [True, True])
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    y = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
    y.backward(g.double())
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    _same(gi, xr.grad.to(dtype), **tol)
    _same(gw, wr.grad.to(dtype), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_batchnorm_pieces_compose_to_batch_norm(dtype):
    # Two "ranks" of a SyncBatchNorm step, gathered by hand: the result is batch norm over both.
    x0, x1 = torch.randn(3, 4, 5, dtype=dtype), torch.randn(5, 4, 5, dtype=dtype)
    w, b = torch.randn(4, dtype=dtype), torch.randn(4, dtype=dtype)
    rm, rv = torch.zeros(4, device=DEV), torch.ones(4, device=DEV)
    stats = [torch.batch_norm_stats(t.to(DEV), 1e-5) for t in (x0, x1)]
    mean_all = torch.stack([s[0] for s in stats])
    invstd_all = torch.stack([s[1] for s in stats])
    counts = torch.tensor([3 * 5, 5 * 5], dtype=torch.float32, device=DEV)
    mean, invstd = torch.batch_norm_gather_stats_with_counts(
        x0.to(DEV), mean_all, invstd_all, rm, rv, 0.1, 1e-5, counts)
    x = torch.cat([x0, x1]).double()
    ref_rm, ref_rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    ref = F.batch_norm(x.clone().requires_grad_(), ref_rm, ref_rv, w.double(), b.double(), True, 0.1, 1e-5)
    y = torch.cat([torch.batch_norm_elemt(t.to(DEV), w.to(DEV), b.to(DEV), mean, invstd, 1e-5) for t in (x0, x1)])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    _same(y, ref.detach().to(dtype), **tol)
    _same(rm, ref_rm.float(), rtol=1e-5, atol=1e-6)
    _same(rv, ref_rv.float(), rtol=1e-5, atol=1e-6)
    # Backward: per-rank reduce, summed across ranks, then the element-wise half.
    g = torch.randn(8, 4, 5, dtype=dtype)
    xr, wr, br = x.clone().requires_grad_(), w.double().requires_grad_(), b.double().requires_grad_()
    F.batch_norm(xr, None, None, wr, br, True, 0.1, 1e-5).backward(g.double())
    parts = [torch.batch_norm_backward_reduce(gg.to(DEV), t.to(DEV), mean, invstd, w.to(DEV), True, True, True)
             for gg, t in ((g[:3], x0), (g[3:], x1))]
    sum_dy = parts[0][0] + parts[1][0]
    sum_dy_xmu = parts[0][1] + parts[1][1]
    _same(parts[0][2] + parts[1][2], wr.grad.to(dtype), **tol)
    _same(parts[0][3] + parts[1][3], br.grad.to(dtype), **tol)
    count = torch.tensor([15, 25], dtype=torch.int32, device=DEV)
    gi = torch.cat([torch.batch_norm_backward_elemt(gg.to(DEV), t.to(DEV), mean, invstd, w.to(DEV), sum_dy,
                                                    sum_dy_xmu, count) for gg, t in ((g[:3], x0), (g[3:], x1))])
    _same(gi, xr.grad.to(dtype), **tol)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_entries_equal_cpu_sdpa(causal):
    q, k, v = (torch.randn(2, 3, 7, 8, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    g = torch.randn_like(ref)
    ref.backward(g)
    qn, kn, vn = (t.detach().to(DEV) for t in (q, k, v))
    for op, bwd, extra in [
        (torch.ops.aten._scaled_dot_product_flash_attention, None, ()),
        (torch.ops.aten._scaled_dot_product_fused_attention_overrideable, None, (None,)),
    ]:
        res = op(qn, kn, vn, *extra, 0.0, causal)
        _same(res[0], ref.detach(), rtol=1e-5, atol=1e-6)
        assert res[1].shape == (2, 3, 7) and res[4] == 7 and res[5] == 7
    out, lse, cq, ck, mq, mk, ps, po, _ = torch.ops.aten._scaled_dot_product_flash_attention(qn, kn, vn, 0.0, causal)
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        g.to(DEV), qn, kn, vn, out, lse, cq, ck, mq, mk, 0.0, causal, ps, po)
    for a, b in ((gq, q.grad), (gk, k.grad), (gv, v.grad)):
        _same(a, b, rtol=1e-4, atol=1e-5)
    gq2, gk2, gv2, gb = torch.ops.aten._scaled_dot_product_fused_attention_overrideable_backward(
        g.to(DEV), qn, kn, vn, torch.empty(0, device=DEV), [True, True, True, False], out, lse, cq, ck,
        mq, mk, 0.0, causal, ps, po)
    for a, b in ((gq2, q.grad), (gk2, k.grad), (gv2, v.grad)):
        _same(a, b, rtol=1e-4, atol=1e-5)
    assert gb is None
    with pytest.raises(NotImplementedError, match="has no dropout"):
        torch.ops.aten._scaled_dot_product_flash_attention(qn, kn, vn, 0.1, causal)
