"""Sliding-window attention (Mistral, Gemma 2) and Gemma 2's attention logit soft cap through
``vllm.LLM`` on neuron: greedy generation equals Transformers' eager attention on the CPU.
The configs make both matter: a window of 8 tokens under prompts of up to 40, and a soft cap
of 0.05 (without it, or without the window, the tokens differ: checked by hand on both
paths)."""
import sys

import pytest
import torch
from conftest import EXAMPLES
from test_offline import make_llm, prompt_ids

WINDOW = 8
STEPS = 12


def _build(path, arch, head_dim):
    sys.path.insert(0, str(EXAMPLES))
    import tiny_llama
    tok = tiny_llama.tokenizer()
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  sliding_window=WINDOW)
    if arch == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM
        # Gemma ties its embeddings; weights this narrow keep its scaled embeddings and
        # final soft cap from saturating every logit.
        model = Gemma2ForCausalLM(Gemma2Config(
            head_dim=head_dim, query_pre_attn_scalar=16, attn_logit_softcapping=0.05,
            tie_word_embeddings=True, initializer_range=0.05, **common))
    else:
        from transformers import MistralConfig, MistralForCausalLM
        model = MistralForCausalLM(MistralConfig(head_dim=head_dim, tie_word_embeddings=False,
                                                 initializer_range=0.3, **common))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _reference(path, prompts):
    """Transformers on CPU with eager attention (its SDPA path has no soft cap), argmax of a
    full forward per step."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(STEPS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(ids):])
    return out


# Head size 16: the plain-torch path; 32: vLLM's fused CPU kernels, each layer's window
# (Gemma 2: 8 and none, in one cache group) and cap as their arguments (checked by hand: the
# fused kernels ran, and dropping either argument changes the tokens).
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_greedy_equals_transformers(tmp_path, arch, head_dim):
    from vllm import SamplingParams
    path = _build(tmp_path / arch, arch, head_dim)
    prompts = prompt_ids(6)                     # 3 to 31 tokens: most longer than the window
    want = _reference(path, prompts)
    llm = make_llm(path)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)

        def run(batch):
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        assert run(prompts) == want             # batched prompts, then decoding
        # Alone again: a prefix-cache hit, so the prompt's tail attends as a chunk after
        # cached tokens.
        assert run([prompts[-1]]) == [want[-1]]
    finally:
        llm.llm_engine.engine_core.shutdown()
