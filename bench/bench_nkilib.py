"""NKI-lib kernels: simulator speed against PyTorch on CPU, modelled FlashAttention
throughput on trn2/trn3, and what routing SDPA's cost through NKI-lib adds to a call.

    .venv/bin/python bench/bench_nkilib.py [--quick] [--tflops] [--moe] [--moe-cte]

``--tflops`` runs part 2 only, ``--moe`` part 4 only, ``--moe-cte`` part 5 only
(deterministic: the modelled numbers do not depend on the host).

1. Host time of the simulated kernel vs the PyTorch reference of the same math on CPU
   (a report: the simulator executes every instruction in NumPy).
2. Modelled TFLOPS of attention_cte at seq 4096/8192 and of attention_bwd at seq
   2048/4096 (one head) and 2048 (four heads), d=128, bf16, causal and not, as a fraction of
   one NeuronCore's TensorE bf16 peak, with the engines' busy shares.
3. SDPA on neuron, forward + modelled-time drain, with the NKI-lib cost route and without
   it (the roofline), in alternating pairs: the ratio of medians.
4. MoE decode: modelled moe_tkg latency against the time to stream the picked experts'
   weights (the core's share of HBM or its DMA queues, whichever is less), and the fused
   moe_block_tkg against RMSNorm + router + experts as three kernels.
5. MoE prefill: modelled moe_cte latency and TFLOPS (every slot of every block computed,
   padding included) against one core's TensorE peak, with the engines' busy shares; and
   Transformers' Mixtral experts on neuron, modelled as one NKI-lib kernel vs as their ops.
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
    print("   attention_bwd (8·S²·d useful FLOPs, halved for causal)")
    for target in ("trn2", "trn3"):
        peak = get_profile(target).core_tflops["bfloat16"]
        for S, H in (((2048, 1),) if QUICK else ((2048, 1), (4096, 1), (2048, 4))):
            rng = np.random.default_rng(0)
            q, o, dy = (rng.standard_normal((1, H, 128, S)).astype(BF16) for _ in range(3))
            k, v = (rng.standard_normal((1, H, 128, S)).astype(BF16) for _ in range(2))
            lse = (rng.standard_normal((1, H, 128, S // 128)) + 5).astype(np.float32)
            for causal in (False, True):
                r = nki.benchmark(attention_bwd, target=target)(q, k, v, o, dy, lse,
                                                                use_causal_mask=causal)
                tf = 8 * S * S * 128 * H * (0.5 if causal else 1.0) / r.latency_ns / 1e3
                busy = {e: 2 * b for e, b in r.engine_busy_pct.items()}   # one of LNC=2 cores
                rows.append((target, S, causal, r.latency_us, tf, tf / peak))
                print(f"   {target} S={S} heads={H} causal={causal}: {r.latency_us:.0f} us, "
                      f"{tf:.1f} TFLOPS = {100 * tf / peak:.0f}% of TensorE peak; busy: "
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


def moe_decode():
    from nki.simulator.timing import Timeline
    from nkilib.core.moe.moe_tkg.moe_tkg import moe_tkg
    from nkilib.core.moe_block.moe_block_tkg import moe_block_tkg
    from nkilib.core.router_topk.router_topk import router_topk
    from nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg
    from nkilib.core.utils.common_types import ExpertAffinityScaleMode, RouterActFnType
    print("4. modelled MoE decode (bf16, top-2 of 8 experts, POST_SCALE)")
    post = dict(expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE)
    soft = RouterActFnType.SOFTMAX
    shapes = [(1, 2048, 1024), (4, 2048, 1024), (32, 2048, 1024)]
    if not QUICK:
        shapes.append((8, 4096, 1792))
    for target in ("trn2", "trn3"):
        p = get_profile(target)
        rate = min(Timeline(p).hbm_bytes_per_ns, p.dma_queues * p.dma_queue_bytes_per_ns)
        for T, H, I in shapes:
            rng = np.random.default_rng(0)
            x = rng.standard_normal((T, H)).astype(BF16)
            gamma = np.ones((1, H), BF16)
            wr = (rng.standard_normal((H, 8)) / np.sqrt(H)).astype(BF16)
            wgu = (rng.standard_normal((8, H, 2, I)) / np.sqrt(H)).astype(BF16)
            wd = (rng.standard_normal((8, I, H)) / np.sqrt(I)).astype(BF16)
            for all_expert in (False, True):
                rk = np.zeros((1, 1), np.int32)
                block = nki.benchmark(moe_block_tkg, target=target)(
                    x, gamma, wr, wgu, wd, top_k=2, router_act_fn=soft, is_all_expert=all_expert,
                    rank_id=rk, **post)
                norm = nki.benchmark(rmsnorm_tkg, target=target)(x, gamma)
                router = nki.benchmark(router_topk, target=target)(
                    norm.outputs, wr, None, None, None, None, soft, 2, 1, 0)
                _, idx, aff = router.outputs
                exp = nki.benchmark(moe_tkg, target=target)(
                    norm.outputs, wgu, wd, aff, idx.astype(np.int32), all_expert, rank_id=rk,
                    mask_unselected_experts=True, **post)
                used = 8 if all_expert else len(set(np.asarray(idx).ravel().tolist()))
                floor = used * 3 * H * I * 2 / rate / 1e3
                parts = norm.latency_us + router.latency_us + exp.latency_us
                mode = "all-expert" if all_expert else "selective"
                busy = " / ".join(f"{2 * exp.engine_busy_pct[e]:.0f}"     # one of LNC=2 cores
                                  for e in ("tensor", "vector", "scalar", "gpsimd", "dma"))
                print(f"   {target} T={T} H={H} I={I} {mode}: {used} experts' weights stream in "
                      f"{floor:.1f} us; moe_tkg {exp.latency_us:.1f} us ({floor / exp.latency_us:.0%} "
                      f"of the bound; busy T/V/S/G/DMA {busy}%); block {block.latency_us:.1f} us "
                      f"vs three kernels {parts:.1f} us ({parts / block.latency_us:.2f}x)")


def moe_prefill():
    from nkilib.core.moe.moe_cte.blocks import routing_blocks
    from nkilib.core.moe.moe_cte.moe_cte import moe_cte
    print("5. modelled MoE prefill: moe_cte, bf16, top-2 of 8 experts, random routing")
    T, H, I, E, k, B = 2048, 1024, 1024, 8, 2, 512
    rng = np.random.default_rng(0)
    top = np.argsort(-rng.standard_normal((T, E)), axis=1)[:, :k]
    aff = np.zeros((T + 1, E), np.float32)
    np.put_along_axis(aff[:T], top, 1.0 / k, axis=1)
    pos, b2e = routing_blocks(top, E, B)
    h = rng.standard_normal((T + 1, H)).astype(BF16)
    h[T] = 0
    wgu = (rng.standard_normal((E, H, 2, I)) / np.sqrt(H)).astype(BF16)
    wd = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(BF16)
    for target in ("trn2", "trn3"):
        peak = get_profile(target).peak_flops("bfloat16", 1)
        r = nki.benchmark(moe_cte, target=target)(
            h, aff.astype(BF16).reshape(-1, 1), wgu, wd, pos, b2e, B)
        flops = len(b2e) * B * 6 * H * I
        tf = flops / (r.latency_ns * 1e-9) / 1e12
        busy = " / ".join(f"{2 * r.engine_busy_pct[e]:.0f}"     # one of LNC=2 cores
                          for e in ("tensor", "vector", "scalar", "gpsimd", "dma"))
        print(f"   {target} T={T} H={H} I={I} E={E} top-{k} B={B}: {len(b2e)} blocks, "
              f"{r.latency_us:.1f} us, {tf:.1f} TFLOPS ({tf * 1e12 / peak:.0%} of peak), "
              f"busy T/V/S/G/DMA {busy}%")
    experts_as_kernel_vs_ops()


def experts_as_kernel_vs_ops():
    """Transformers' Mixtral experts (grouped_mm) on neuron, bf16, trn2 LNC=2: the modelled
    forward charged as one NKI-lib kernel (the route) against the same call's ATen ops each
    charged on its own (the unwrapped function)."""
    from transformers import MixtralConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    import torch_neuronx

    def charges(fn):
        torch.neuron.synchronize()
        torch_neuronx.reset_modelled_time()
        fn()
        torch.neuron.synchronize()
        return torch_neuronx.modelled_time().seconds

    print("   Mixtral experts (grouped_mm), bf16, trn2: modelled forward, ops vs kernel")
    for T, H, E in ((64, 512, 8), (512, 256, 4), (2048, 1024, 8)):
        cfg = MixtralConfig(hidden_size=H, intermediate_size=H, num_local_experts=E,
                            num_experts_per_tok=2)
        cfg._experts_implementation = "grouped_mm"
        torch.manual_seed(0)
        blk = MixtralSparseMoeBlock(cfg).to(torch.bfloat16)
        with torch.no_grad():
            for prm in blk.parameters():
                prm.normal_(std=0.05)
        blk.to("neuron")
        with torch.no_grad():
            h = torch.randn(T, H, dtype=torch.bfloat16).to("neuron")
            _, w, idx = blk.gate(h)
            kernel = charges(lambda: blk.experts(h, idx, w))
            raw = ALL_EXPERTS_FUNCTIONS["grouped_mm"].__wrapped__
            ops = charges(lambda: raw(blk.experts, h, idx, w))
        print(f"   T={T} H=I={H} E={E} top-2: ops {ops * 1e3:.3f} ms, kernel "
              f"{kernel * 1e3:.3f} ms ({ops / kernel:.1f}x)")


if __name__ == "__main__":
    if "--moe-cte" in sys.argv:
        moe_prefill()
    elif "--tflops" in sys.argv:
        flash_tflops()
    elif "--moe" in sys.argv:
        moe_decode()
    else:
        simulator_vs_torch()
        flash_tflops()
        routing_overhead()
        moe_decode()
        moe_prefill()
