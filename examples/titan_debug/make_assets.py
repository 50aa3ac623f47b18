"""Tiny local assets for TorchTitan's debug model: a byte-level BPE tokenizer (vocabulary of
2048, the debug model's) and a JSON-lines text dataset, both made here from generated text, so
`torchtitan.train` runs with no download (its own test assets live in its git repository,
not in the wheel).

    python examples/titan_debug/make_assets.py DIR
    PYTHONPATH=examples/titan_debug torchrun --nproc_per_node 2 -m torchtitan.train \
        --module llama3 --config llama3_debugmodel --parallelism.spmd-backend partial_dtensor \
        --hf_assets_path DIR/tokenizer --dataloader.dataset_path DIR/text ...

(`PYTHONPATH=examples/titan_debug` adds `sitecustomize.py`, which supplies the one torch API
TorchTitan 0.3.0 calls that torch 2.13 lacks; see that file.)
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

_WORDS = ("the a neuron core runs every kernel on its engines while the queue keeps order "
          "tensor vector scalar engine moves data from memory to the chip and back again "
          "models train faster when work overlaps and nothing waits").split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words)) + "."


def make_assets(root: str | Path, n_docs: int = 400, seed: int = 0) -> tuple:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(root)
    rng = random.Random(seed)
    docs = [_text(rng, rng.randint(20, 200)) for _ in range(n_docs)]
    data = root / "text"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.json", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=2048, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tdir = root / "tokenizer"
    tdir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tdir / "tokenizer.json"))
    (tdir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True,
         "add_eos_token": True}))
    return tdir, data


if __name__ == "__main__":
    t, d = make_assets(sys.argv[1] if len(sys.argv) > 1 else "titan_assets")
    print(t, d)
