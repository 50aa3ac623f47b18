"""FlexAttention compiled on neuron, forward and backward, against dense CPU references."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

DEV = "neuron"
B, H, S, D = 1, 2, 256, 16
WINDOW = 64


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= WINDOW)


_DOC = torch.arange(S) // 96            # three documents of 96, 96, 64 tokens


def _doc_mask(doc):
    def document(b, h, q, kv):
        return doc[q] == doc[kv]
    return document


def _alibi(slopes):
    def alibi(score, b, h, q, kv):
        return score + (kv - q) * slopes[h]
    return alibi


def _dense(q, k, v, allowed, bias=None):
    """Plain softmax attention on CPU with an explicit [S, S] mask and [H, S, S] bias."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, float("-inf"))
    return s.softmax(-1) @ v


_I = torch.arange(S)
_SLOPES = torch.tensor([0.5, 0.25])
CASES = {
    "causal": (causal, None, _I[:, None] >= _I[None, :], None),
    "sliding_window": (sliding, None, (_I[:, None] >= _I[None, :]) &
                       (_I[:, None] - _I[None, :] <= WINDOW), None),
    "document": ("document", None, _DOC[:, None] == _DOC[None, :], None),
    "alibi_causal": (causal, "alibi", _I[:, None] >= _I[None, :],
                     (_I[None, :] - _I[:, None])[None] * _SLOPES[:, None, None]),
}


@pytest.mark.parametrize("backend", ["neuron", "inductor"])
@pytest.mark.parametrize("name", list(CASES))
def test_flex_attention_forward_backward(name, backend):
    mask_fn, score_kind, allowed, bias = CASES[name]
    torch.manual_seed(0)
    qc, kc, vc = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    ref = _dense(qc, kc, vc, allowed, bias)
    grad = torch.randn_like(ref)
    ref.backward(grad)

    if mask_fn == "document":
        mask_fn = _doc_mask(_DOC.to(DEV))
    score_mod = _alibi(_SLOPES.to(DEV)) if score_kind == "alibi" else None
    block_mask = create_block_mask(mask_fn, B, H, S, S, device=DEV)
    q, k, v = (t.detach().to(DEV).requires_grad_() for t in (qc, kc, vc))
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod,
                                                      block_mask=block_mask),
                       backend=backend, fullgraph=True)
    out = fn(q, k, v)
    out.backward(grad.to(DEV))
    assert out.device.type == DEV
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=2e-5, rtol=2e-5)
    for a, b in ((q, qc), (k, kc), (v, vc)):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-4, rtol=1e-4)


def test_block_sparsity_skips_work():
    """A causal mask does about half the matmul work of a full mask (modelled TensorE)."""
    import torch_neuronx
    s = 1024
    q, k, v = (torch.randn(1, 2, s, D, device=DEV) for _ in range(3))

    def full(b, h, q_, kv):
        return q_ >= 0

    flops = {}
    for name, fn_mask in (("full", full), ("causal", causal)):
        bm = create_block_mask(fn_mask, 1, 2, s, s, device=DEV)
        fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=bm),
                           backend="neuron", fullgraph=True)
        fn(q, k, v)
        torch_neuronx.reset_modelled_time()
        fn(q, k, v)
        flops[name] = torch_neuronx.modelled_time().flops
    ratio = flops["causal"] / flops["full"]
    assert 0.45 < ratio < 0.6, ratio


def test_flex_attention_without_a_block_mask():
    """flex_attention(q, k, v) builds its empty block mask inside the compiled graph (vmap)."""
    torch.manual_seed(0)
    qc, kc, vc = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    ref = torch.softmax(qc @ kc.transpose(-1, -2) / math.sqrt(D) * 0.5, -1) @ vc
    ref.sum().backward()
    q, k, v = (t.detach().to(DEV).requires_grad_() for t in (qc, kc, vc))
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5),
                       backend="neuron")
    out = fn(q, k, v)
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=2e-5, rtol=2e-5)
    for a, b in ((q, qc), (k, kc), (v, vc)):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-4, rtol=1e-4)


def test_default_inductor_flex_layouts_and_cached_graph(tmp_path):
    # TorchTitan's form: torch.compile(flex_attention) with the default backend, q/k/v as
    # transposed views ([B, S, H, D] -> [B, H, S, D]); and a second process that loads the
    # compiled graph from Inductor's cache (so no lowering runs there) must still find the
    # score_mod and mask_mod.
    import subprocess
    import sys
    import textwrap
    prog = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        torch.manual_seed(0)
        x = [torch.randn(2, 128, 4, 16, requires_grad=True) for _ in range(3)]
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in x), is_causal=True)
        ref.sum().backward()
        xn = [t.detach().to("neuron").requires_grad_() for t in x]
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, 2, 4, 128, 128, device="neuron")
        out = torch.compile(flex_attention)(*(t.transpose(1, 2) for t in xn), block_mask=mask)
        out.sum().backward()
        torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=2e-5, rtol=2e-5)
        for a, b in zip(xn, x):
            torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-4, rtol=1e-4)
        print("flex ok")
    """)
    env = dict(__import__("os").environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True,
                             text=True, timeout=300)
        assert "flex ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("backend", ["neuron", "inductor"])
def test_gradient_through_the_returned_logsumexp(backend):
    # Transformers asks for the logsumexp off the CPU (return_lse), and AOTAutograd then
    # passes its gradient to the backward even when the loss does not use it
    from torch.nn.attention.flex_attention import AuxRequest
    torch.manual_seed(0)
    L = 128
    allowed = _I[:L, None] >= _I[None, :L]
    qc, kc, vc = (torch.randn(2, 2, L, D, requires_grad=True) for _ in range(3))
    s = (qc @ kc.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
    ref, ref_lse = s.softmax(-1) @ vc, s.logsumexp(-1)
    (ref.square().sum() + ref_lse.square().sum()).backward()

    block_mask = create_block_mask(causal, 2, None, L, L, device=DEV)
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask,
                                                      return_aux=AuxRequest(lse=True)),
                       backend=backend)
    q, k, v = (t.detach().to(DEV).requires_grad_() for t in (qc, kc, vc))
    out, aux = fn(q, k, v)
    (out.square().sum() + aux.lse.square().sum()).backward()
    torch.testing.assert_close(aux.lse.detach().cpu(), ref_lse.detach(), atol=2e-5, rtol=2e-5)
    for a, b in ((q, qc), (k, kc), (v, vc)):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["neuron", "inductor"])
def test_captured_padding_mask_across_dynamic_recompiles(backend):
    # A mask_mod reading a padding tensor captures its sizes once shapes go dynamic (the
    # second length recompiles dynamically): generate() with flex attention does this
    fa = torch.compile(flex_attention, backend=backend)
    for L in (16, 24, 32):
        pad = torch.ones(2, L, dtype=torch.bool)
        pad[1, L - 4:] = False
        pad_d = pad.to(DEV)

        def mask_mod(b, h, q_idx, kv_idx):
            return pad_d[b, kv_idx] & (kv_idx <= q_idx)

        block_mask = create_block_mask(mask_mod, 2, None, L, L, device=DEV)
        q = torch.randn(2, 4, L, 8)
        out = fa(q.to(DEV), q.to(DEV), q.to(DEV), block_mask=block_mask)
        i = torch.arange(L)
        allowed = pad[:, None, None, :] & (i[None, None, None, :] <= i[None, None, :, None])
        s = (q @ q.transpose(-1, -2) / math.sqrt(8)).masked_fill(~allowed, float("-inf"))
        torch.testing.assert_close(out.cpu(), s.softmax(-1) @ q, atol=2e-5, rtol=2e-5)
