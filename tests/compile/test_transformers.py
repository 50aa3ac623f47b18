"""Hugging Face generate() with a static cache, compiled through backend "neuron"."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_generate_static_cache_compiles_with_neuron_backend():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.tensor([[1, 5, 9, 13]])
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        ref = model.generate(ids, **kw)

    used = []
    import torch_neuronx.compile.backend as backend_mod
    inner = backend_mod.neuron_backend

    def spy(gm, example_inputs, **kwargs):
        used.append(gm)
        return inner(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    dev_model = model.to("neuron")
    from torch._dynamo.backends import registry
    registry._COMPILER_FNS["neuron"] = spy      # transformers asks for backend "neuron"
    try:
        with torch.no_grad():
            out = dev_model.generate(ids.to("neuron"), **kw)
    finally:
        registry._COMPILER_FNS["neuron"] = inner
    assert used, "generate() did not compile through backend 'neuron'"
    assert out.cpu().tolist() == ref.tolist()
