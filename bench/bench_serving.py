"""vLLM serving on neuron against vLLM's own CPU path, in the same run.

A small Llama (examples/tiny_llama.py's, widened to hidden 256, 4 layers, 4 heads of 64 (vLLM's
CPU attention has no head size 16), 2 KV heads; random weights) served offline by
``vllm.LLM``: 32 prompts of 8-40 tokens, greedy, 32 new tokens each. Each side runs in its
own process (vLLM picks its platform once per process): neuron through the plugin, CPU with
the plugin standing aside (``NEURON_RT_NUM_CORES=0``), prefix caching off. The sides alternate
``--pairs`` times; each warms up once, then times ``generate`` ``--reps`` times; reports the
median host tokens/s of each side over all its timed runs, their ratio
(target: neuron >= 0.8x CPU) and the plugin's modelled trn2 TTFT, inter-token latency and
tokens/s per chip of the last neuron side's timed runs.

    .venv-serving/bin/python bench/bench_serving.py [--pairs 2] [--reps 3] [--prompts 32]
        [--tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(path: str) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import tiny_llama
    tok = tiny_llama.tokenizer()
    tiny_llama.model(tok, seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)
    tok.save_pretrained(path)


def side(model: str, prompts: int, tokens: int, reps: int) -> dict:
    """One side, in this process: median tokens/s over ``reps`` timed generate calls."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    rng = random.Random(0)
    batch = [{"prompt_token_ids": [rng.randrange(4, 150) for _ in range(rng.randint(8, 40))]}
             for _ in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    # No prefix caching: every timed run prefills its prompts again, as new traffic would.
    llm = LLM(model=model, dtype="float32", max_model_len=128, max_num_seqs=prompts,
              kv_cache_memory_bytes=64 << 20, seed=0, enable_prefix_caching=False)
    llm.generate(batch, params, use_tqdm=False)        # warm-up
    modelled = None
    if current_platform.device_type == "neuron":
        llm.collective_rpc("reset_modelled_summary")
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    if current_platform.device_type == "neuron":
        modelled = llm.collective_rpc("modelled_summary")[0]
    return {"device": current_platform.device_type, "tokens_per_s": statistics.median(rates),
            "runs": rates, "modelled": modelled}


def spawn(model: str, args, **env) -> dict:
    cmd = [sys.executable, __file__, "--side", model, "--prompts", str(args.prompts),
           "--tokens", str(args.tokens), "--reps", str(args.reps)]
    out = subprocess.run(cmd, env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", **env),
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench side failed ({env}):\n{out.stderr[-4000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise SystemExit(f"bench side printed no result ({env}):\n{out.stdout[-2000:]}"
                         f"\n{out.stderr[-2000:]}")
    return json.loads(line[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--side")
    args = ap.parse_args()
    if args.side:
        print("RESULT " + json.dumps(side(args.side, args.prompts, args.tokens, args.reps)),
              flush=True)
        return
    with tempfile.TemporaryDirectory() as d:
        build(d)
        cpu, neuron = [], []
        for _ in range(args.pairs):     # alternate, so load from elsewhere hits both sides
            cpu.append(spawn(d, args, NEURON_RT_NUM_CORES="0"))
            neuron.append(spawn(d, args))
    assert {c["device"] for c in cpu} == {"cpu"} and {n["device"] for n in neuron} == {"neuron"}
    cpu = {"tokens_per_s": statistics.median(r for c in cpu for r in c["runs"]),
           "runs": [r for c in cpu for r in c["runs"]]}
    m = neuron[-1]["modelled"]
    neuron = {"tokens_per_s": statistics.median(r for n in neuron for r in n["runs"]),
              "runs": [r for n in neuron for r in n["runs"]]}
    ratio = neuron["tokens_per_s"] / cpu["tokens_per_s"]
    print(f"offline generate, {args.prompts} prompts x {args.tokens} tokens, small Llama fp32 "
          f"(median of {args.pairs} x {args.reps} runs per side):")
    print(f"  vLLM CPU path     {cpu['tokens_per_s']:9.1f} tokens/s  runs "
          f"{[round(r, 1) for r in cpu['runs']]}")
    print(f"  vLLM on neuron    {neuron['tokens_per_s']:9.1f} tokens/s  runs "
          f"{[round(r, 1) for r in neuron['runs']]}")
    print(f"  neuron / CPU      {ratio:9.3f}  (target >= 0.8)")
    print(f"  modelled {m['platform']}: TTFT median {m['ttft_median_s'] * 1e3:.3f} ms, "
          f"ITL median {m['itl_median_s'] * 1e3:.3f} ms, "
          f"{m['tokens_per_s_per_chip']:.0f} tokens/s per chip "
          f"({m['requests']} requests, {m['tokens']} tokens, {m['steps']} steps)")


if __name__ == "__main__":
    main()
