"""Transformers' own BERT (padded attention masks) and T5 (encoder-decoder, relative position
bias), architectures the other examples do not use (examples/hf_strangers.py), trained with
AdamW on neuron and on the CPU in one process; losses and gradients equal bit for bit, and T5's beam
search generates the CPU's tokens."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from hf_strangers import MODELS, t5, t5_batch  # noqa: E402  (examples/ is on sys.path: conftest)


def _train(make, batch, device, steps=3):
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        out = model(**{k: v.to(device) for k, v in batch(g).items()})
        out.loss.backward()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses, grads


@pytest.mark.parametrize("name", ["bert", "t5"])
def test_training_equals_cpu_bitwise(name):
    make, batch = MODELS[name]
    losses, grads = _train(make, batch, "neuron")
    want_losses, want_grads = _train(make, batch, "cpu")
    assert losses == want_losses
    assert grads.keys() == want_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], want_grads[n]), n


def test_t5_beam_search_equals_cpu():
    torch.manual_seed(0)
    model = t5().eval()
    g = torch.Generator().manual_seed(2)
    batch = t5_batch(g)
    kw = dict(num_beams=3, max_new_tokens=8, do_sample=False)
    want = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kw)
    model.to("neuron")
    got = model.generate(input_ids=batch["input_ids"].to("neuron"),
                         attention_mask=batch["attention_mask"].to("neuron"), **kw)
    assert torch.equal(got.cpu(), want)
