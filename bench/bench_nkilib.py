"""NKI-lib kernels: simulator speed against PyTorch on CPU, modelled FlashAttention
throughput on trn2/trn3, and what routing SDPA's cost through NKI-lib adds to a call.

    .venv/bin/python bench/bench_nkilib.py [--quick] [--tflops]

``--tflops`` runs part 2 only (deterministic: the modelled numbers do not depend on the host).

1. Host time of the simulated kernel vs the PyTorch reference of the same math on CPU
   (a report: the simulator executes every instruction in NumPy).
2. Modelled TFLOPS of attention_cte at seq 4096/8192, d=128, bf16, causal and not, as a
   fraction of one NeuronCore's TensorE bf16 peak, with the engines' busy shares.
3. SDPA on neuron, forward + modelled-time drain, with the NKI-lib cost route and without
   it (the roofline), in alternating pairs: the ratio of medians.
"""
from __future__ import annotations

import statistics
import sys
import time

import ml_dtypes
import numpy as np
import torch

import nki
from neuronhw import get_profile
from nkilib.core.attention.attention_bwd import attention_bwd
from nkilib.core.attention.attention_cte import attention_cte

QUICK = "--quick" in sys.argv
BF16 = ml_dtypes.bfloat16


def _wall(fn, reps=3):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def simulator_vs_torch():
    print("1. simulator host time vs PyTorch on CPU (fp32, one head)")
    for S, d, causal in ((512, 64, True), (1024, 128, False), (2048, 128, True)):
        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, S, d), dtype=np.float32)
        k = rng.standard_normal((1, d, S), dtype=np.float32)
        v = rng.standard_normal((1, S, d), dtype=np.float32)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k.transpose(0, 2, 1).copy(), v))
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(   # noqa: E731
            tq[None], tk[None], tv[None], is_causal=causal)
        sdpa()
        sim = _wall(lambda: attention_cte(q, k, v, scale=d ** -0.5, causal_mask=causal))
        ref = _wall(lambda: torch.nn.functional.scaled_dot_product_attention(
            tq[None], tk[None], tv[None], is_causal=causal))
        print(f"   attention_cte S={S} d={d} causal={causal}: simulator {sim * 1e3:.1f} ms, "
              f"torch {ref * 1e3:.2f} ms, ratio {sim / ref:.1f}x")
        if S <= 1024:
            lse = np.zeros((1, 1, 128, S // 128), np.float32)
            T = lambda a: a.transpose(0, 2, 1).copy()[None]   # noqa: E731
            simb = _wall(lambda: attention_bwd(T(q), k[None], T(v), T(q), T(q), lse,
                                               use_causal_mask=causal))
            qg = tq.clone().requires_grad_()

            def torch_bwd():
                o = torch.nn.functional.scaled_dot_product_attention(qg[None], tk[None], tv[None],
                                                                     is_causal=causal)
                o.sum().backward()
            torch_bwd()
            refb = _wall(torch_bwd)
            print(f"   attention_bwd S={S} d={d} causal={causal}: simulator {simb * 1e3:.1f} ms, "
                  f"torch fwd+bwd {refb * 1e3:.2f} ms, ratio {simb / refb:.1f}x")


def flash_tflops():
    print("2. modelled attention_cte throughput (bf16, d=128, one head, one physical core)")
    rows = []
    for target in ("trn2", "trn3"):
        peak = get_profile(target).core_tflops["bfloat16"]
        for S in ((4096,) if QUICK else (4096, 8192)):
            rng = np.random.default_rng(0)
            q = rng.standard_normal((1, S, 128)).astype(BF16)
            k = rng.standard_normal((1, 128, S)).astype(BF16)
            v = rng.standard_normal((1, S, 128)).astype(BF16)
            for causal in (False, True):
                r = nki.benchmark(attention_cte, target=target)(q, k, v, scale=128 ** -0.5,
                                                                causal_mask=causal)
                flops = 4 * S * S * 128 * (0.5 if causal else 1.0)
                tf = flops / r.latency_ns / 1e3
                busy = {e: 2 * b for e, b in r.engine_busy_pct.items()}   # one of LNC=2 cores
                rows.append((target, S, causal, r.latency_us, tf, tf / peak))
                print(f"   {target} S={S} causal={causal}: {r.latency_us:.0f} us, {tf:.1f} TFLOPS "
                      f"= {100 * tf / peak:.0f}% of TensorE peak ({peak:.0f}); busy: "
                      + ", ".join(f"{e} {b:.0f}%" for e, b in busy.items() if e != "dma"))
    return rows


def routing_overhead(pairs=15):
    print("3. SDPA on neuron + modelled-time drain: NKI-lib cost route vs roofline")
    from torch_neuronx import cost_model
    from torch_neuronx.kernels import nkilib_routes as routes
    q = torch.randn(4, 8, 512, 64, device="neuron")
    saved = dict(cost_model.KERNEL_COSTS)

    def call():
        for _ in range(5):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.neuron.synchronize()
        cost_model.modelled_time(reset=True)
    call()          # simulates the head once; later calls hit the cache
    routed, roof = [], []
    for _ in range(pairs):
        cost_model.KERNEL_COSTS.update(saved)
        routed.append(_wall(call, 1))
        cost_model.KERNEL_COSTS.pop(routes.FWD, None)
        roof.append(_wall(call, 1))
    cost_model.KERNEL_COSTS.update(saved)
    a, b = statistics.median(routed), statistics.median(roof)
    print(f"   5 calls + drain: routed {a * 1e3:.2f} ms, roofline {b * 1e3:.2f} ms, "
          f"ratio {a / b:.3f} (median of {pairs} pairs)")


if __name__ == "__main__":
    if "--tflops" in sys.argv:
        flash_tflops()
    else:
        simulator_vs_torch()
        flash_tflops()
        routing_overhead()
