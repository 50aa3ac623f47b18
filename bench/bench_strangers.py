"""Models this project did not write: Transformers' own BERT (sequence classification, padded
attention masks) and T5 (encoder-decoder), built from small configs, trained with AdamW on
neuron against the CPU, eager and compiled (neuron's backend against Inductor).

The models are examples/hf_strangers.py's. Each side runs in a fresh process (``_fresh_pairs``, the order alternating), times ``--steps``
steps after 3 warm-up steps and reports their median and its last loss; ratios are medians
over pairs, and the losses of the two sides must agree. Run: .venv/bin/python bench/bench_strangers.py [--pairs N] [--steps S] [--model NAME ...]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
import warnings

import torch

import _fresh_pairs  # bench/, this script's directory

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from hf_strangers import MODELS  # noqa: E402

WARMUP = 3


def _bert():
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))




def _one(name: str, device: str, compiled: bool, steps: int) -> dict:
    """In a fresh process: the median step time and the last loss."""
    import transformers
    if device == "neuron":
        import torch_neuronx  # noqa: F401
    transformers.logging.set_verbosity_error()
    make, batch = MODELS[name]
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backend = "neuron" if device == "neuron" else "inductor"
    run = torch.compile(model, backend=backend) if compiled else model
    times, loss = [], None
    for i in range(WARMUP + steps):
        b = {k: v.to(device) for k, v in batch(torch.Generator().manual_seed(i)).items()}
        t0 = time.perf_counter()
        out = run(**b)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()   # waits for the device
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times[WARMUP:]), "loss": loss}


def _fresh(name, device, compiled, steps):
    args = [sys.executable, __file__, "--one", name, device, str(int(compiled)), str(steps)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", nargs="*", default=sorted(MODELS))
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        name, device, compiled, steps = a.one
        warnings.simplefilter("ignore")
        print(json.dumps(_one(name, device, compiled == "1", int(steps))))
        return
    print("model      mode      neuron ms   CPU ms   ratio (pairs)                losses")
    for name in a.model:
        for compiled in (False, True):
            losses = {"cpu": [], "neuron": []}

            def run(device):
                r = _fresh(name, device, compiled, a.steps)
                losses[device].append(r["loss"])
                return r["seconds"]
            ratio, tc, td, ratios = _fresh_pairs.alternating(
                lambda: run("cpu"), lambda: run("neuron"), a.pairs)
            diff = max(abs(x - y) for x, y in zip(losses["cpu"], losses["neuron"]))
            mode = "compiled" if compiled else "eager"
            print(f"{name:10s} {mode:9s} {td * 1e3:8.2f} {tc * 1e3:8.2f}   {ratio:.3f} "
                  f"({', '.join(f'{x:.2f}' for x in ratios)})   "
                  + ("equal" if diff == 0 else f"differ by up to {diff:.2g}"))

if __name__ == "__main__":
    main()
