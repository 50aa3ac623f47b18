"""``vllm serve`` with ``--tensor-parallel-size 2`` on neuron: the OpenAI server's two workers
run on neuron:0 and neuron:1 (collectives through the "neuron" c10d backend) and answer as
the single-device server does: completions equal Transformers' greedy output on CPU, streamed
or not, several requests at once."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_offline import prompt_ids, transformers_greedy
from test_server import completion, launch, post, stream


@pytest.fixture(scope="module")
def tp_server(llama_dir, tmp_path_factory):
    with launch(llama_dir, tmp_path_factory, "--tensor-parallel-size", "2") as got:
        yield got


def test_tp2_server_completions_equal_transformers(tp_server, llama_dir):
    url, _ = tp_server
    prompts = prompt_ids()[:4]
    want = transformers_greedy(llama_dir, prompts, 12)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ids: post(url, "/v1/completions", completion(ids)), prompts))
    for (status, body), tokens in zip(got, want):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == tokens


def test_tp2_server_streams_the_same_tokens(tp_server):
    url, _ = tp_server
    ids = prompt_ids()[1]
    status, body = post(url, "/v1/completions", completion(ids))
    assert status == 200, body
    events = stream(url, "/v1/completions", completion(ids))
    assert events[-1] is None and len(events) > 2      # several chunks, then [DONE]
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert [t for c in chunks for t in c["token_ids"]] == body["choices"][0]["token_ids"]
    assert "".join(c["text"] for c in chunks) == body["choices"][0]["text"]
