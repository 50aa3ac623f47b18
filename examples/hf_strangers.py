"""Transformers' own BERT (sequence classification, padded attention masks) and T5
(encoder-decoder) from small configs: architectures the project's examples do not use, shared
by bench/bench_strangers.py and tests/ecosystem/test_hf_strangers.py. Dropout is off: the
devices' generators are seeded alike but the CPU's also draws the initial weights, so masks
would differ between the two."""
from __future__ import annotations

import torch
import transformers


def padded(g, shape, ends):
    """Token ids and an attention mask whose rows end where ``ends`` says (row -> length)."""
    x = torch.randint(2, 256, shape, generator=g)
    mask = torch.ones_like(x)
    for row, end in ends.items():
        mask[row, end:] = 0
    return x, mask


def bert():
    cfg = transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=64, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def bert_batch(g):
    x, mask = padded(g, (8, 32), {2: 20, 5: 7})
    return dict(input_ids=x, attention_mask=mask, labels=torch.randint(0, 3, (8,), generator=g))


def t5():
    cfg = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def t5_batch(g):
    x, mask = padded(g, (4, 24), {1: 18, 3: 10})
    labels = torch.randint(2, 256, (4, 12), generator=g)
    return dict(input_ids=x, attention_mask=mask, labels=labels)


MODELS = {"bert": (bert, bert_batch), "t5": (t5, t5_batch)}
