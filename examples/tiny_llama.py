"""A tiny Llama, a tokenizer and a dataset built offline, for the ecosystem examples.

Nothing is downloaded: the model comes from a ``LlamaConfig`` with seeded random weights, the
tokenizer is a byte-level BPE trained in memory on a small generated corpus, and the dataset
is that corpus tokenized into fixed-length causal-LM examples. Nothing here names a device.
"""
from __future__ import annotations

import random

import torch

WORDS = ("the a one cat dog bird sat ran flew on under over mat tree house river stone "
         "light dark small big red blue green fast slow and then").split()


def corpus(n: int = 160, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 40))) + "."
            for _ in range(n)]


def tokenizer(vocab_size: int = 160):
    """A ``PreTrainedTokenizerFast`` over a BPE trained in memory on ``corpus()``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


def config(tok, **overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def model(tok, seed: int = 0, **overrides):
    """``LlamaForCausalLM`` with random weights drawn from ``seed`` (on the CPU, as
    ``from_pretrained`` loads them; the Trainer or the user moves it)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = config(tok, **overrides)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


class Examples(torch.utils.data.Dataset):
    """The corpus tokenized, concatenated and cut into ``seq_len`` causal-LM examples."""

    def __init__(self, tok, seq_len: int = 32):
        ids = []
        for line in corpus():
            ids += [tok.bos_token_id] + tok(line)["input_ids"] + [tok.eos_token_id]
        n = len(ids) // seq_len
        self.rows = torch.tensor(ids[:n * seq_len]).view(n, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i) -> dict:
        row = self.rows[i]
        return {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row}
