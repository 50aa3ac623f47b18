"""vLLM's fused CPU attention kernels serving on neuron (torch_neuronx/vllm/cpu_attention.py):
a layer whose head size vLLM's CPU kernels cover (64 here) runs them on the device's queue;
greedy generation still equals Transformers' on CPU, token for token, prompts and chunks
after cached prefixes alike, and the work is charged as NKI-lib attention."""
import sys

import pytest

from conftest import EXAMPLES, INIT_RANGE
from test_offline import greedy, make_llm, prompt_ids, transformers_greedy


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    sys.path.insert(0, str(EXAMPLES))
    import tiny_llama
    path = tmp_path_factory.mktemp("tiny-llama-h64")
    tok = tiny_llama.tokenizer()
    tiny_llama.model(tok, seed=0, initializer_range=INIT_RANGE, hidden_size=256,
                     intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wide_llm(wide_dir):
    mp = pytest.MonkeyPatch()
    # collective_rpc below sends a function to the engine's worker process.
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm = make_llm(wide_dir)
    yield llm
    llm.llm_engine.engine_core.shutdown()
    mp.undo()


def _synchronous_ops(worker):
    import torch_neuronx
    return dict(torch_neuronx.queue_stats(reset=True)["synchronous_ops"])


def test_fused_kernels_serve_and_equal_transformers(wide_llm, wide_dir):
    wide_llm.collective_rpc(_synchronous_ops)
    wide_llm.collective_rpc("reset_modelled_summary")
    prompts = prompt_ids()
    assert greedy(wide_llm, prompts) == transformers_greedy(wide_dir, prompts, 16)
    # The planner reads the sequence lengths on the host once per step; nothing else waits.
    assert set(wide_llm.collective_rpc(_synchronous_ops)[0]) == {"_C::get_scheduler_metadata"}
    by_op = wide_llm.collective_rpc("modelled_summary")[0]["by_op"]
    assert by_op["paged_attention"] > 0 and by_op["cpu_attn_reshape_and_cache"] > 0
    assert not any("scaled_dot_product" in op for op in by_op)


def test_fused_chunk_after_cached_prefix_equals_transformers(wide_llm, wide_dir):
    base = prompt_ids()[-1]
    prompts = [base + [9, 10, 11], base[:33] + [12]]
    assert greedy(wide_llm, prompts) == transformers_greedy(wide_dir, prompts, 16)


def test_fused_kernels_under_tensor_parallelism_equal_transformers(wide_dir):
    # Two workers on neuron:0 and neuron:1, each with 2 query heads and 1 KV head of 64.
    llm = make_llm(wide_dir, tensor_parallel_size=2)
    try:
        llm.collective_rpc("reset_modelled_summary")
        prompts = prompt_ids(4, seed=3)
        assert greedy(llm, prompts, 8) == transformers_greedy(wide_dir, prompts, 8)
        for summary in llm.collective_rpc("modelled_summary"):
            assert summary["by_op"]["paged_attention"] > 0
    finally:
        llm.llm_engine.engine_core.shutdown()
