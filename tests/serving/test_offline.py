"""``vllm.LLM`` on neuron: greedy generation equals Transformers' on CPU, token for token."""
import random

import pytest
import torch

PROMPTS = 8
MAX_TOKENS = 16


def prompt_ids(n=PROMPTS, seed=1):
    """Token ids of different lengths (3 to 40), so prefill covers several block counts."""
    rng = random.Random(seed)
    lengths = [3, 7, 12, 18, 25, 31, 36, 40][:n]
    return [[rng.randrange(4, 150) for _ in range(k)] for k in lengths]


def transformers_greedy(model_dir, prompts, steps):
    """Reference: Transformers on CPU, full forward each step, argmax (no cache)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(steps):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            out.append(seq[len(ids):])
    return out


def make_llm(model_dir, **kw):
    from vllm import LLM
    args = dict(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=8,
                kv_cache_memory_bytes=32 << 20, seed=0)
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def llama_llm(llama_dir):
    llm = make_llm(llama_dir)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def greedy(llm, prompts, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_platform_is_neuron(llama_llm):
    from vllm.platforms import current_platform
    assert current_platform.device_type == "neuron"
    assert llama_llm.llm_engine.vllm_config.device_config.device.type == "neuron"


def test_greedy_batch_equals_transformers(llama_llm, llama_dir):
    prompts = prompt_ids()
    got = greedy(llama_llm, prompts)
    assert got == transformers_greedy(llama_dir, prompts, MAX_TOKENS)


def test_prefix_cache_hit_equals_transformers(llama_llm, llama_dir):
    # Same 40-token prefix as the batch above plus a new tail: the cached blocks are reused
    # and the tail is a chunk that attends to them (bottom-right causal mask).
    base = prompt_ids()[-1]
    prompts = [base + [9, 10, 11], base[:33] + [12]]
    assert greedy(llama_llm, prompts) == transformers_greedy(llama_dir, prompts, MAX_TOKENS)


def test_qwen_greedy_equals_transformers(qwen_dir):
    llm = make_llm(qwen_dir)
    try:
        prompts = prompt_ids(4, seed=2)
        assert greedy(llm, prompts, 8) == transformers_greedy(qwen_dir, prompts, 8)
    finally:
        llm.llm_engine.engine_core.shutdown()
