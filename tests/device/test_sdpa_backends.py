"""F.scaled_dot_product_attention when a program allows only CUDA's memory-efficient or cuDNN
kernels (``sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)``), which CPU's selection refuses: on
neuron those ops run, forward and backward, eager and compiled, and equal CPU's SDPA."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_neuronx  # noqa: F401

BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _inputs(dtype, mask, grad_mask=False, m=37, n=37):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, m, 16, generator=g).to(dtype)
    k = torch.randn(2, 3, n, 16, generator=g).to(dtype)
    v = torch.randn(2, 3, n, 16, generator=g).to(dtype)
    bias = torch.randn(1, 3, m, n, generator=g).to(dtype) if mask else None
    cpu = [t.clone().requires_grad_(t is not bias or grad_mask) if t is not None else None
           for t in (q, k, v, bias)]
    dev = [t.detach().to("neuron").requires_grad_(t.requires_grad) if t is not None else None
           for t in cpu]
    return cpu, dev


def _run(args, backend, causal, fn=F.scaled_dot_product_attention):
    q, k, v, bias = args
    with sdpa_kernel(backend) if backend is not None else sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        out = fn(q, k, v, attn_mask=bias, is_causal=causal)
    grads = torch.autograd.grad((out.float() ** 2).sum(), [t for t in args if t is not None
                                                            and t.requires_grad])
    return out, grads


def _close(a, b, dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(a.cpu(), b, **tol)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal,mask", [(False, False), (True, False), (False, True)])
def test_forward_and_backward_equal_cpu(backend, dtype, causal, mask):
    cpu, dev = _inputs(dtype, mask)
    ref, ref_grads = _run(cpu, None, causal)
    out, grads = _run(dev, backend, causal)
    _close(out, ref, dtype)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        _close(g, r, dtype)


def test_efficient_attention_returns_the_bias_gradient():
    cpu, dev = _inputs(torch.float32, mask=True, grad_mask=True, m=40, n=24)
    cpu[3] = cpu[3].detach()[:, :, :1].requires_grad_()   # broadcast over queries
    dev[3] = dev[3].detach()[:, :, :1].requires_grad_()
    ref, ref_grads = _run(cpu, SDPBackend.MATH, False)
    out, grads = _run(dev, SDPBackend.EFFICIENT_ATTENTION, False)
    _close(out, ref, torch.float32)
    assert grads[3].shape == (1, 3, 1, 24)
    for g, r in zip(grads, ref_grads):
        _close(g, r, torch.float32)


def test_ops_match_their_meta_layouts():
    q = torch.randn(2, 3, 37, 16, device="neuron")
    for op, args in ((torch.ops.aten._scaled_dot_product_efficient_attention, (None, True)),
                     (torch.ops.aten._scaled_dot_product_cudnn_attention, (None, True))):
        real = op(q, q, q, *args)
        meta = op(q.to("meta"), q.to("meta"), q.to("meta"), *args)
        for r, m in zip(real, meta):
            if isinstance(m, torch.Tensor):
                assert (r.shape, r.stride(), r.dtype) == (m.shape, m.stride(), m.dtype), op
            else:
                assert r == m


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_compiled_equals_cpu(backend):
    cpu, dev = _inputs(torch.float32, mask=False)
    ref, ref_grads = _run(cpu, None, True)
    f = torch.compile(F.scaled_dot_product_attention, backend="neuron", fullgraph=True)
    out, grads = _run(dev, backend, True, fn=f)
    _close(out, ref, torch.float32)
    for g, r in zip(grads, ref_grads):
        _close(g, r, torch.float32)


def test_dropout_and_gqa_give_clear_errors():
    q = torch.randn(1, 4, 8, 16, device="neuron")
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        with pytest.raises(NotImplementedError, match="efficient_attention.*dropout"):
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        kv = torch.randn(1, 2, 8, 16, device="neuron")
        with pytest.raises(RuntimeError, match="No viable backend"):
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    out = F.scaled_dot_product_attention(q, q, q)   # the device stays usable
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q.cpu(), q.cpu(), q.cpu()))
