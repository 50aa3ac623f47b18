"""Train the small GPT on the virtual trn2 device: eager, then compiled."""
from __future__ import annotations

import time

import torch

from .. import cost_model
from .corpus import TEXT
from .gpt import GPT, GPTConfig, batches, decode, encode, lr_at, make_step


def _train(label, model, steps, batch, device, autocast, seed=0):
    from tqdm import tqdm

    cfg = model.cfg
    data = encode(TEXT)
    gen = torch.Generator().manual_seed(seed)
    stream = batches(data, cfg.block_size, batch, device, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=True)
    step = make_step(model, opt, torch.bfloat16 if autocast else None)
    cost_model.reset_modelled_time(device)
    from ..compile import reset_modelled_graph_time
    tokens = batch * cfg.block_size
    losses, modelled, start, warm = [], 0.0, None, 3
    bar = tqdm(range(steps), desc=f"{label:>8}", unit="step", dynamic_ncols=True)
    first_step_s = None
    for i in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(i, steps, 3e-3)
        x, y = next(stream)
        t0 = time.perf_counter()
        loss = step(x, y)
        value = loss.item()
        if i == 0:
            first_step_s = time.perf_counter() - t0
        if i == warm:
            start = time.perf_counter()
            cost_model.reset_modelled_time(device)
            reset_modelled_graph_time(device)
        losses.append(value)
        if i >= warm and (i % 10 == 0 or i == steps - 1):
            elapsed = time.perf_counter() - start
            done = i - warm + 1
            modelled = cost_model.modelled_time(device).seconds / done
            bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{tokens * done / elapsed:,.0f}",
                            trn2_ms=f"{modelled * 1e3:.2f}")
    bar.close()
    elapsed = time.perf_counter() - start
    measured = steps - warm
    mt = cost_model.modelled_time(device)
    step_s = elapsed / measured
    return {
        "loss_first": sum(losses[:5]) / 5, "loss_last": sum(losses[-10:]) / 10,
        "tokens_s": tokens * measured / elapsed, "step_ms": step_s * 1e3,
        # The first step's time beyond a steady step: tracing and compiling (compiled), or
        # first-use costs (eager).
        "first_step_s": first_step_s, "setup_s": max(0.0, first_step_s - step_s),
        "modelled_ms": mt.seconds / measured * 1e3,
        "launches": mt.launches / measured, "top": [(k, v / measured) for k, v in mt.top(3)],
        "peak_mib": torch.neuron.max_memory_allocated(device) / 2**20,
    }


def _report(label, r, platform, compiled=False):
    top = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in r["top"])
    first = (f"compile {r['setup_s']:.1f} s" if compiled else
             f"first step {r['first_step_s']:.2f} s")
    print(f"{label}: loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} | steady state "
          f"{r['tokens_s']:,.0f} tokens/s, {r['step_ms']:.1f} ms/step on this host "
          f"({first}) | peak memory {r['peak_mib']:.1f} MiB")
    print(f"{'':>{len(label)}}  modelled {platform} time: {r['modelled_ms']:.3f} ms/step over "
          f"{r['launches']:.0f} launches/step; busiest: {top}")


def run(steps=500, batch=16, compile=True, device="neuron", autocast=False) -> int:
    from .._state import config
    cfg = config()
    platform = cfg.profile.name
    device = torch.device(device)
    print(f"torchneuron demo: a small GPT on {device} = {torch.neuron._describe(device)}")
    gcfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(gcfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {gcfg.n_layer} layers, {gcfg.n_embd} wide, {n_params / 1e6:.2f} M parameters; "
          f"{steps} steps of {batch} x {gcfg.block_size} byte tokens"
          f"{' under bf16 autocast' if autocast else ''}")
    eager = _train("eager", model, steps, batch, device, autocast)
    _report("eager", eager, platform)
    results = {"eager": eager}
    if compile:
        torch.manual_seed(0)
        cmodel = GPT(gcfg).to(device)
        compiled = torch.compile(cmodel, backend="neuron")
        compiled.cfg = gcfg
        torch._dynamo.reset()
        r = _train("compiled", compiled, steps, batch, device, autocast)
        _report("compiled", r, platform, compiled=True)
        from ..compile import modelled_graph_time
        g = modelled_graph_time(device)
        for name, rec in g.by_graph.items():
            busy = ", ".join(f"{e} {v / rec.runs * 1e3:.3f}" for e, v in rec.busy.items() if v)
            print(f"{'':>8}  {name.split(' @ ')[0]} graph as one {platform} program: "
                  f"{rec.seconds / rec.runs * 1e3:.3f} ms, {rec.bound}-bound "
                  f"(engines busy ms: {busy})")
        print(f"compiled vs eager: {eager['step_ms'] / r['step_ms']:.2f}x host speed, "
              f"{eager['modelled_ms'] / max(r['modelled_ms'], 1e-9):.2f}x modelled {platform} speed")
        results["compiled"] = r
        model = cmodel
    prompt = encode("The tensor engine").unsqueeze(0).to(device)
    out = model.generate(prompt, 120, generator=torch.Generator(device=device).manual_seed(0))
    print("sample: " + decode(out[0].cpu()).replace("\n", " "))
    _what_if(gcfg, batch)
    return 0


def _what_if(gcfg, batch) -> None:
    """The same GPT step planned on a cluster (torch_neuronx.plan), under the best layout."""
    from .. import plan
    model = plan.TransformerConfig(layers=gcfg.n_layer, hidden=gcfg.n_embd, heads=gcfg.n_head,
                                   vocab=gcfg.vocab_size, seq=gcfg.block_size, name="demo GPT")
    for name in ("trn2.48xlarge", "trn2-ultraserver"):
        c = plan.cluster(name)
        # The demo's batch on every device: the global batch grows with the cluster.
        global_batch = batch * c.devices
        best = plan.sweep(model, c, global_batch)[0]
        print(f"what-if, {name} ({c.chips} chips, {c.devices} devices), batch {global_batch}: "
              f"best layout {best.layout}: {best.step_seconds * 1e3:.3f} ms/step, "
              f"{best.tokens_per_second:,.0f} tokens/s, MFU {best.mfu * 100:.1f}%")
