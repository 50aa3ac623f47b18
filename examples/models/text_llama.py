"""Text: a Llama-style decoder (Transformers ``LlamaForCausalLM``), trained a few steps and
sampled with ``generate``. Run: ``python examples/models/text_llama.py``."""

try:
    from ._harness import causal_lm, main
except ImportError:
    from _harness import causal_lm, main


def build():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


FAMILY = causal_lm("text (Llama)", build, seed=1)

if __name__ == "__main__":
    main(FAMILY)
