"""Serving tests run in the serving environment (``make serving-setup``, ``make
test-serving``); the main environment has no vLLM and skips this folder at collection."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# Random weights drawn this wide give well-separated logits, so greedy choices do not
# hinge on float rounding between vLLM's kernels and Transformers'.
INIT_RANGE = 0.3


def build_model(path: Path, arch: str = "llama") -> Path:
    """A tiny model and tokenizer saved to ``path``, built offline (no downloads)."""
    sys.path.insert(0, str(EXAMPLES))
    import tiny_llama
    import torch

    tok = tiny_llama.tokenizer()
    if arch == "llama":
        model = tiny_llama.model(tok, seed=0, initializer_range=INIT_RANGE)
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          tie_word_embeddings=False, initializer_range=INIT_RANGE)
        model = Qwen2ForCausalLM(cfg)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny-qwen"), "qwen2")
