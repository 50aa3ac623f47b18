"""Blocks as users write them: neuron compiled vs Inductor on CPU, Adaptive Eager on vs off.

    .venv/bin/python bench/bench_blocks.py [--reps 7] [--only NAME] [--json FILE]

A varied set, not written around any one fusion pattern: module forms (``nn.LayerNorm``,
``nn.GELU``) mixed with written-out math, both rotary forms (interleaved through strided
slices and ``stack(...).flatten(-2)``, half-split through ``cat``), softmax followed by
element-wise work, residual chains, attention written out with a causal mask, a SwiGLU MLP
with RMSNorm, an AdamW step; fp32 and bf16; forward, and forward + backward.

Each row, same process, alternates batches of calls of the two sides so that drift hits
both alike (medians over ``--reps`` pairs of batches; ``_batch`` says why batches):
- ``compiled/inductor``: ``torch.compile(backend="neuron")`` on neuron over
  ``torch.compile`` (Inductor) on CPU;
- ``AE on/off``: neuron eager with Adaptive Eager off over on (> 1: fusion helps), and the
  ops -> kernels it made of the block;
- ``compiled vs AE off``: neuron eager with Adaptive Eager off over neuron compiled.
Every neuron measurement ends with ``torch.neuron.synchronize()``.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_neuronx
from bench_compile import _time  # noqa: E402 - this folder is on sys.path when run
from torch_neuronx.runtime.queue import adaptive_eager_stats

B, S, D = 16, 256, 1024


class IssueBlock(nn.Module):
    """LayerNorm, GELU, RMSNorm, interleaved rotary, softmax, residual (issue 22's block)."""

    def __init__(self, d=D):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.act = nn.GELU()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x, cos, sin):
        h = self.act(self.ln(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        x1, x2 = h[..., ::2], h[..., 1::2]
        r = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return torch.softmax(r, dim=-1) + x


class Norms(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d)

    def forward(self, x):
        return self.rms(self.ln(x) + x)


def rms_written(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def rope_half(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return x * torch.cat((cos, cos), -1) + rot * torch.cat((sin, sin), -1)


def rope_interleaved(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def softmax_then(x, bias):
    p = torch.softmax(x * 0.125 + bias, dim=-1)
    return p * (p > 1e-4) + 0.5 * x.tanh()


def residual_chain(x, a, b):
    h = x + F.silu(a) * b
    h = h + 0.5 * F.gelu(h, approximate="tanh")
    h = F.layer_norm(h, h.shape[-1:]) + x
    return h * torch.sigmoid(b) + a


def gelu_modules(x):
    return nn.functional.gelu(x) * torch.sigmoid(x) + nn.functional.silu(x)


class Attention(nn.Module):
    def __init__(self, d=512, heads=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, s, d)) + x


class SwiGLU(nn.Module):
    def __init__(self, d=512, hidden=1376):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h)) + x


def _case(name, make, inputs, *, dtype=torch.float32, backward=False, memory_bound=True):
    return dict(name=name, make=make, inputs=inputs, dtype=dtype, backward=backward,
                memory_bound=memory_bound)


def cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return lambda: torch.randn(*shape, generator=g)

    out = []
    for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        out += [
            _case(f"issue block {tag}", IssueBlock, [r(B, S, D), r(S, D // 2), r(S, D // 2)],
                  dtype=dt),
            _case(f"LayerNorm+RMSNorm modules {tag}", Norms, [r(B, S, D)], dtype=dt),
            _case(f"RMSNorm written out {tag}", lambda: rms_written, [r(B, S, D), r(D)],
                  dtype=dt),
            _case(f"rotary interleaved {tag}", lambda: rope_interleaved,
                  [r(B, S, D), r(S, D // 2), r(S, D // 2)], dtype=dt),
            _case(f"rotary half (cat) {tag}", lambda: rope_half,
                  [r(B, S, D), r(S, D // 2), r(S, D // 2)], dtype=dt),
            _case(f"softmax then elementwise {tag}", lambda: softmax_then,
                  [r(B, S, D), r(S, D)], dtype=dt),
            _case(f"residual chain {tag}", lambda: residual_chain,
                  [r(B, S, D), r(B, S, D), r(B, S, D)], dtype=dt),
            _case(f"activations {tag}", lambda: gelu_modules, [r(B, S, D)], dtype=dt),
        ]
    out += [
        _case("issue block fp32 fwd+bwd", IssueBlock, [r(8, S, D), r(S, D // 2), r(S, D // 2)],
              backward=True),
        _case("rotary half fp32 fwd+bwd", lambda: rope_half,
              [r(8, S, D), r(S, D // 2), r(S, D // 2)], backward=True),
        _case("residual chain bf16 fwd+bwd", lambda: residual_chain,
              [r(8, S, D), r(8, S, D), r(8, S, D)], dtype=torch.bfloat16, backward=True),
        _case("attention causal fp32 fwd+bwd", Attention, [r(8, 256, 512)], backward=True,
              memory_bound=False),
        _case("SwiGLU MLP + RMSNorm bf16 fwd+bwd", SwiGLU, [r(8, 256, 512)],
              dtype=torch.bfloat16, backward=True, memory_bound=False),
        _case("SwiGLU MLP + RMSNorm fp32 fwd", SwiGLU, [r(8, 256, 512)], memory_bound=False),
    ]
    return out


def _build(case, device, compiled):
    torch.manual_seed(0)
    mod = case["make"]()
    if isinstance(mod, nn.Module):
        mod = mod.to(device=device, dtype=case["dtype"])
    args = [f().to(device=device, dtype=case["dtype"]) for f in case["inputs"]]
    if case["backward"]:
        for a in args[:1]:
            a.requires_grad_(True)
    fn = torch.compile(mod, backend="neuron" if device == "neuron" else "inductor") \
        if compiled else mod

    def run():
        out = fn(*args)
        if case["backward"]:
            out.float().sum().backward()
            return None
        return out

    if case["backward"]:
        return run
    return lambda: torch.no_grad()(run)()


def _batch(fn, device, calls=5):
    """Median time of one call over a batch of calls, after one call that is not timed.

    CPU kernels run on the host thread's OpenMP team, neuron kernels on the executor's; a
    team spins for a while after its last parallel loop, so the first call after the other
    side's would pay for the other team's spinning (up to 1.7x on a 2 ms block).
    """
    _time(fn, device)
    return statistics.median(_time(fn, device) for _ in range(calls))


def paired(fa, da, fb, db, reps):
    """Median of b/a over alternating pairs of batches, and the medians of a and b."""
    _batch(fa, da), _batch(fb, db)
    ta, tb = [], []
    for _ in range(reps):
        ta.append(_batch(fa, da))
        tb.append(_batch(fb, db))
    ratio = statistics.median(b / a for a, b in zip(ta, tb))
    return statistics.median(ta), statistics.median(tb), ratio


def _ae(on: bool):
    torch_neuronx._C._set_adaptive_eager(on)


def measure(case, reps):
    row = {"block": case["name"], "memory_bound": case["memory_bound"]}
    comp_n = _build(case, "neuron", True)
    comp_c = _build(case, "cpu", True)
    t_i, t_n, ratio = paired(comp_c, "cpu", comp_n, "neuron", reps)
    row.update(compiled_ms=t_n * 1e3, inductor_ms=t_i * 1e3, compiled_over_inductor=ratio)

    eager = _build(case, "neuron", False)
    on, off = [], []
    _ae(True)
    eager()
    torch.neuron.synchronize()
    adaptive_eager_stats(reset=True)
    eager()
    torch.neuron.synchronize()
    st = adaptive_eager_stats(reset=True)
    row["ops_to_kernels"] = f"{st['ops']} -> {st['kernels']} ({st['fused_kernels']} fused)"
    for _ in range(reps):
        _ae(False)
        off.append(_time(eager, "neuron"))
        _ae(True)
        on.append(_time(eager, "neuron"))
    _ae(True)
    row.update(ae_on_ms=statistics.median(on) * 1e3, ae_off_ms=statistics.median(off) * 1e3,
               ae_off_over_on=statistics.median(b / a for a, b in zip(on, off)))
    row["ae_off_over_compiled"] = row["ae_off_ms"] / row["compiled_ms"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", default=None, help="run blocks whose name contains this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of "
          f"{args.reps} pairs")
    print(f"{'block':38s} {'compiled':>9s} {'inductor':>9s} {'c/ind':>6s} "
          f"{'AE on':>8s} {'AE off':>8s} {'off/on':>6s} {'off/comp':>8s}  ops -> kernels")
    for case in cases():
        if args.only and args.only not in case["name"]:
            continue
        row = measure(case, args.reps)
        rows.append(row)
        print(f"{row['block']:38s} {row['compiled_ms']:8.2f}m {row['inductor_ms']:8.2f}m "
              f"{row['compiled_over_inductor']:6.3f} {row['ae_on_ms']:7.2f}m "
              f"{row['ae_off_ms']:7.2f}m {row['ae_off_over_on']:6.2f} "
              f"{row['ae_off_over_compiled']:8.2f}  {row['ops_to_kernels']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
