"""Benchmark of torch.compile on neuron (backend "neuron") against its peers, same run.

    .venv/bin/python bench/bench_compile.py [--reps 7]

Prints medians of paired runs and their ratios:
- GPT training step (hidden 512): compiled on neuron vs Inductor on CPU;
- memory-bound blocks (LayerNorm, GELU, RMSNorm, RoPE, softmax over ~32 MB): compiled vs
  neuron eager;
- FlexAttention: causal vs full block mask (wall time and modelled TensorE FLOPs);
- cold compile (empty cache dir, fresh process) vs Inductor on CPU, and warm start (the
  same compile in a new process with the persistent cache).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "compile"))
from models import GPT  # noqa: E402


def _time(fn, device):
    if device == "neuron":
        torch.neuron.synchronize()
    t = time.perf_counter()
    fn()
    if device == "neuron":
        torch.neuron.synchronize()
    return time.perf_counter() - t


def paired(fa, da, fb, db, reps):
    """Median seconds of a and b, alternating runs so drift hits both alike."""
    for _ in range(2):
        fa(), fb()
    ta, tb = [], []
    for _ in range(reps):
        ta.append(_time(fa, da))
        tb.append(_time(fb, db))
    return statistics.median(ta), statistics.median(tb)


def gpt_step(reps):
    torch.manual_seed(0)
    cfg = dict(vocab=512, d=512, heads=8, layers=2, ctx=128)
    idx = torch.randint(0, 512, (8, 128))
    tgt = torch.randint(0, 512, (8, 128))

    def make(device, backend):
        m = GPT(**cfg).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        cm = torch.compile(m, backend=backend)
        i, t = idx.to(device), tgt.to(device)

        def step():
            loss = cm(i, t)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return paired(make("neuron", "neuron"), "neuron", make("cpu", "inductor"), "cpu", reps)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


BLOCKS = {
    "layernorm": lambda x, w, c, s: F.layer_norm(x, (x.shape[-1],), w, w),
    "gelu": lambda x, w, c, s: F.gelu(x * w + 1.0),
    "rmsnorm": lambda x, w, c, s: _rms(x, w),
    "rope": lambda x, w, c, s: _rope(x, c, s),
    "softmax": lambda x, w, c, s: (x * w).softmax(-1),
}


def memory_bound(reps):
    rows, d = 8192, 1024          # 32 MB of fp32 per tensor
    x = torch.randn(rows, d, device="neuron")
    w = torch.randn(d, device="neuron")
    c = torch.randn(d // 2, device="neuron")
    s = torch.randn(d // 2, device="neuron")
    out = {}
    for name, fn in BLOCKS.items():
        cf = torch.compile(fn, backend="neuron")
        tc, te = paired(lambda: cf(x, w, c, s), "neuron", lambda: fn(x, w, c, s), "neuron", reps)
        out[name] = (tc, te)
    return out


def flex(reps):
    import torch_neuronx
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    s, d = 2048, 64
    q, k, v = (torch.randn(1, 4, s, d, device="neuron") for _ in range(3))
    res = {}
    for name, mask in (("full", lambda b, h, i, j: i >= 0), ("causal", lambda b, h, i, j: i >= j)):
        bm = create_block_mask(mask, 1, 4, s, s, device="neuron")
        fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=bm),
                           backend="neuron", fullgraph=True)
        fn(q, k, v)
        torch_neuronx.reset_modelled_time()
        fn(q, k, v)
        flops = torch_neuronx.modelled_time().flops
        t = statistics.median(_time(lambda: fn(q, k, v), "neuron") for _ in range(reps))
        res[name] = (t, flops)
    return res


_COMPILE_SCRIPT = """
import sys, time, json, torch
sys.path.insert(0, {models!r})
from models import GPT
dev, backend = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = GPT(vocab=512, d=512, heads=8, layers=2, ctx=128).to(dev)
idx = torch.randint(0, 512, (8, 128)).to(dev)
cm = torch.compile(m, backend=backend)
t = time.perf_counter()
cm(idx, idx).backward()
print(json.dumps({{"seconds": time.perf_counter() - t}}))
"""


def compile_times():
    models = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "compile")
    script = _COMPILE_SCRIPT.format(models=models)

    def run(dev, backend, cache):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCH_NEURONX_COMPILE_CACHE_DIR=cache)
        r = subprocess.run([sys.executable, "-c", script, dev, backend], env=env,
                           capture_output=True, text=True, check=True)
        return json.loads(r.stdout.strip().splitlines()[-1])["seconds"]
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        cold_neuron = run("neuron", "neuron", a)
        warm_neuron = run("neuron", "neuron", a)
        cold_cpu = run("cpu", "inductor", b)
    return cold_neuron, warm_neuron, cold_cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    import torch_neuronx
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"profile {torch_neuronx._state.config().profile.name}")
    tn, tc = gpt_step(args.reps)
    print(f"GPT training step (hidden 512): neuron compiled {tn * 1e3:.1f} ms, "
          f"Inductor CPU {tc * 1e3:.1f} ms, ratio {tn / tc:.3f}x (target <= 1.05)")
    for name, (tcomp, teager) in memory_bound(args.reps).items():
        print(f"{name:10s} 32 MB: compiled {tcomp * 1e3:.2f} ms, eager {teager * 1e3:.2f} ms, "
              f"speedup {teager / tcomp:.2f}x (target >= 2)")
    fl = flex(max(3, args.reps // 2))
    print(f"FlexAttention S=2048: causal/full wall {fl['causal'][0] / fl['full'][0]:.2f}, "
          f"modelled TensorE FLOPs {fl['causal'][1] / fl['full'][1]:.2f} "
          f"(full {fl['full'][0] * 1e3:.1f} ms, causal {fl['causal'][0] * 1e3:.1f} ms)")
    cold, warm, cold_cpu = compile_times()
    print(f"cold compile: neuron {cold:.1f} s, Inductor CPU {cold_cpu:.1f} s, ratio "
          f"{cold / cold_cpu:.2f}x (target <= 1.2); warm start {warm:.1f} s = "
          f"{warm / cold * 100:.0f}% of cold (target <= 10%)")
    g = torch_neuronx.compile.modelled_graph_time()
    print(g)


if __name__ == "__main__":
    main()
