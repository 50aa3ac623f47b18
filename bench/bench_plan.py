"""The planner's speed: a sweep of 100 layouts of a 1B-parameter model (Llama 3.2 1B shape) on
a Trn2 UltraServer, timed; the issue's target is under 10 s. Then a traced step's sweep
(``StepTrace.sweep``): a tiny Transformers Llama (4 layers) traced once on one device with
AdamW, every layout of 64 devices on 4 nodes replayed (time and HBM) and ranked. No peer runs
the same model; the numbers are reported as they are. Run: .venv/bin/python bench/bench_plan.py
"""
from __future__ import annotations

import statistics
import time

from torch_neuronx import plan


def main():
    model = plan.PRESETS["llama-1b"]
    c = plan.cluster("trn2-ultraserver", chips=64)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        ests = plan.sweep(model, c, batch=1024, max_layouts=100)
        times.append(time.perf_counter() - t0)
    assert len(ests) == 100, len(ests)
    print(f"sweep of {len(ests)} layouts of {model.name} ({model.params() / 1e9:.2f}B) on {c.name} "
          f"x {c.chips}: median {statistics.median(times) * 1e3:.1f} ms over 5 runs (target < 10 s)")
    print("best:", ests[0])
    trace_sweep()


def trace_sweep(layers: int = 4, devices: int = 64, nodes: int = 4):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch_neuronx
    torch_neuronx.set_adaptive_eager(False)   # the replays price op by op (docs/plan.md)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=128)
    torch.manual_seed(0)
    dev = torch.device("neuron")
    model = LlamaForCausalLM(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (8, 48), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    step()
    with plan.trace(dev, model, optimizer=opt) as t:
        step()
    blocks = [f"model.layers.{i}" for i in range(layers)]
    tp_plan = {}
    for b in blocks:
        tp_plan.update({f"{b}.self_attn.{p}_proj": "colwise" for p in "qkv"})
        tp_plan.update({f"{b}.self_attn.o_proj": "rowwise", f"{b}.mlp.gate_proj": "colwise",
                        f"{b}.mlp.up_proj": "colwise", f"{b}.mlp.down_proj": "rowwise"})
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        rows = t.sweep(devices, ids.numel(), tp_plan=tp_plan, fsdp_units=blocks + [""],
                       pp_blocks=blocks, nodes=nodes)
        times.append(time.perf_counter() - t0)
    replayed = sum(r.replay is not None for r in rows)
    print(f"traced sweep of {len(rows)} layouts ({replayed} replayed) of a {layers}-layer Llama "
          f"({len(t.ops)} traced ops) on {devices} devices x {nodes} nodes: median "
          f"{statistics.median(times) * 1e3:.1f} ms over 5 runs")
    print("best:", rows[0])


if __name__ == "__main__":
    main()
