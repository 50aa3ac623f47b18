"""Transformers' own architectures this project's examples do not use: BERT with padded
attention masks and T5 (encoder-decoder, relative position bias), trained with AdamW on
neuron and on the CPU in one process; losses and gradients equal bit for bit, and T5's beam
search generates the CPU's tokens. Dropout is off: the devices' generators are seeded alike
but the CPU's also drew the initial weights."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _bert():
    cfg = transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=64, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def _padded(g, shape, ends):
    """Token ids and an attention mask whose rows end where ``ends`` says (row -> length)."""
    x = torch.randint(2, 256, shape, generator=g)
    mask = torch.ones_like(x)
    for row, end in ends.items():
        mask[row, end:] = 0
    return x, mask


def _bert_batch(g):
    x, mask = _padded(g, (8, 32), {2: 20, 5: 7})
    return dict(input_ids=x, attention_mask=mask, labels=torch.randint(0, 3, (8,), generator=g))


def _t5():
    cfg = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def _t5_batch(g):
    x, mask = _padded(g, (4, 24), {1: 18, 3: 10})
    labels = torch.randint(2, 256, (4, 12), generator=g)
    return dict(input_ids=x, attention_mask=mask, labels=labels)


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
    make, batch = {"bert": (_bert, _bert_batch), "t5": (_t5, _t5_batch)}[name]
    losses, grads = _train(make, batch, "neuron")
    want_losses, want_grads = _train(make, batch, "cpu")
    assert losses == want_losses
    assert grads.keys() == want_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], want_grads[n]), n


def test_t5_beam_search_equals_cpu():
    torch.manual_seed(0)
    model = _t5().eval()
    g = torch.Generator().manual_seed(2)
    batch = _t5_batch(g)
    kw = dict(num_beams=3, max_new_tokens=8, do_sample=False)
    want = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kw)
    model.to("neuron")
    got = model.generate(input_ids=batch["input_ids"].to("neuron"),
                         attention_mask=batch["attention_mask"].to("neuron"), **kw)
    assert torch.equal(got.cpu(), want)
