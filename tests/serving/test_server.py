"""vLLM's OpenAI-compatible server on neuron, driven over HTTP on 127.0.0.1."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_offline import prompt_ids, transformers_greedy

MAX_LEN = 128


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch(llama_dir, tmp_path_factory, *extra):
    """vLLM's OpenAI server on the tiny model at 127.0.0.1 (``extra``: more CLI arguments);
    yields (url, log file) once /health answers."""
    port = free_port()
    prom = tmp_path_factory.mktemp("prometheus")
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom),
               TORCH_NEURONX_VLLM_LOG_EVERY="0")
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(llama_dir),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8",
         "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0", *extra],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"vLLM server did not start (exit {proc.poll()}):\n{log.read()[-4000:]}")
        time.sleep(0.5)
    try:
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with launch(llama_dir, tmp_path_factory) as got:
        yield got


def post(url, path, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream(url, path, body):
    """The text of every server-sent event of a streaming request, in order."""
    req = urllib.request.Request(url + path, data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append(None)
                break
            events.append(json.loads(line[6:]))
    return events


def completion(prompt, max_tokens=12):
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def test_models_lists_the_served_model(server):
    url, _ = server
    with urllib.request.urlopen(url + "/v1/models") as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny"]


def test_completion_equals_transformers(server, llama_dir):
    url, _ = server
    ids = prompt_ids()[4]
    status, body = post(url, "/v1/completions", completion(ids))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == transformers_greedy(llama_dir, [ids], 12)[0]
    assert choice["text"]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12,
                             "total_tokens": len(ids) + 12, **{k: v for k, v in
                             body["usage"].items() if k not in ("prompt_tokens",
                             "completion_tokens", "total_tokens")}}


def test_streaming_completion_equals_non_streaming(server):
    url, _ = server
    body = completion("the cat sat on the mat and", 10)
    _, whole = post(url, "/v1/completions", body)
    events = stream(url, "/v1/completions", body)
    assert events[-1] is None and len(events) > 2      # several chunks, then [DONE]
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert [t for c in chunks for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


def test_chat_completion_and_stream(server):
    url, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a dog ran under the tree"}],
            "max_tokens": 8, "temperature": 0}
    status, whole = post(url, "/v1/chat/completions", body)
    assert status == 200, whole
    msg = whole["choices"][0]["message"]
    assert msg["role"] == "assistant" and whole["usage"]["completion_tokens"] <= 8
    events = stream(url, "/v1/chat/completions", body)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if e["choices"])
    assert text == msg["content"]


def test_eight_concurrent_requests(server, llama_dir):
    url, _ = server
    prompts = prompt_ids()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: post(url, "/v1/completions", completion(p, 8)),
                                prompts))
    assert all(status == 200 for status, _ in results), results
    want = transformers_greedy(llama_dir, prompts, 8)
    assert [body["choices"][0]["token_ids"] for _, body in results] == want


def still_serving(url):
    status, body = post(url, "/v1/completions", completion([5, 6, 7], 2))
    return status == 200 and body["usage"]["completion_tokens"] == 2


def test_too_long_prompt_is_refused(server):
    url, _ = server
    status, body = post(url, "/v1/completions", completion(list(range(4, 4 + MAX_LEN + 10)), 4))
    assert status == 400, body
    assert "maximum context length" in body["error"]["message"] or \
        str(MAX_LEN) in body["error"]["message"]
    assert still_serving(url)


def test_unknown_model_is_404(server):
    url, _ = server
    status, body = post(url, "/v1/completions", dict(completion("a cat", 2), model="nope"))
    assert status == 404, body
    assert "nope" in body["error"]["message"]
    assert still_serving(url)


def test_malformed_json_is_400(server):
    url, _ = server
    status, body = post(url, "/v1/completions", b'{"model": "tiny", "prompt": ', raw=True)
    assert status == 400, body
    assert still_serving(url)


def test_metrics_report_modelled_serving_time(server):
    url, _ = server
    assert still_serving(url)
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    assert "vllm:" in text                         # vLLM's own series are still there
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
             if ln.startswith("neuron:modelled") and " " in ln}
    ttft = [v for k, v in lines.items() if k.startswith(
        "neuron:modelled_time_to_first_token_seconds_count")]
    busy = [v for k, v in lines.items() if k.startswith("neuron:modelled_busy_seconds_total")]
    assert ttft and ttft[0] >= 1 and busy and busy[0] > 0, text[-3000:]
