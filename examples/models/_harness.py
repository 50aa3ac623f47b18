"""What every model-family example shares: a seeded tiny model, a few AdamW steps, inference,
and the numbers a user wants (loss, steps/s, modelled Trainium ms per step).

A family is four functions: ``build()`` returns the model on the CPU (seeded random weights,
no download), ``batch()`` returns CPU tensors, ``loss(model, batch)`` and ``infer(model, batch)``.
``run`` takes them to any device, so the tests can run the same code on CPU and on neuron.
Nothing here is neuron-specific except the modelled time it reads when the device is neuron.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Family:
    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[], tuple]
    loss: Callable[[torch.nn.Module, tuple], torch.Tensor]
    infer: Callable[[torch.nn.Module, tuple], object]
    lr: float = 1e-3


@dataclass
class Result:
    losses: list = field(default_factory=list)
    output: object = None
    steps_per_s: float = 0.0
    modelled_ms: dict = field(default_factory=dict)   # platform -> ms per training step
    bound: str = ""                                    # engine the cost model charges most


def causal_lm(name: str, build: Callable[[], torch.nn.Module], seed: int, vocab: int = 128) -> Family:
    """A family for a Transformers causal LM: next-token loss on random tokens, greedy
    ``generate`` for inference."""
    def batch():
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(3, vocab, (2, 16), generator=g),)

    def loss(model, b):
        return model(input_ids=b[0], labels=b[0]).loss

    def infer(model, b):
        return model.generate(b[0][:, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)

    return Family(name, build, batch, loss, infer)


def to(tree, device):
    """``tree`` (tensors in tuples, lists and dicts) on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, (list, tuple)):
        return type(tree)(to(t, device) for t in tree)
    if isinstance(tree, dict):
        return {k: to(v, device) for k, v in tree.items()}
    return tree


def _sync(device):
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()


def trainer(family: Family, device="neuron", dtype=None, compile_backend=None, seed: int = 0):
    """``(model, batch, amp, step)``: ``step()`` runs one AdamW step and returns the loss.

    ``dtype``: autocast to it. ``compile_backend``: compile the model's forward
    (``model.compile(backend=...)``), the way users do; loss and optimizer stay eager.
    """
    torch.manual_seed(seed)
    model = family.build().to(device)
    # Training draws from the model's device generator (dropout, sampling): seed it here, after
    # initialisation drew the weights from the CPU's, so every device starts the same stream.
    torch.manual_seed(seed + 1)
    if compile_backend:
        model.compile(backend=compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=family.lr)
    batch = to(family.batch(), device)
    dev = torch.device(device)
    amp = (torch.autocast(dev.type, dtype=dtype) if dtype is not None else contextlib.nullcontext())

    def step():
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = family.loss(model, batch)
        loss.backward()
        opt.step()
        return loss.detach().float().cpu().item()
    return model, batch, amp, step


def run(family: Family, device="neuron", steps: int = 3, dtype=None, compile_backend=None,
        seed: int = 0, infer: bool = True) -> Result:
    """Train ``steps`` steps, then run inference; the modelled time is the last step's."""
    model, batch, amp, step = trainer(family, device, dtype, compile_backend, seed)
    neuron = torch.device(device).type == "neuron"
    res = Result()
    t_steps = 0.0
    for i in range(steps):
        if neuron and i == steps - 1:
            import torch_neuronx
            _sync(device)
            torch_neuronx.reset_modelled_time(device)
        t0 = time.perf_counter()
        res.losses.append(step())
        if i > 0 or steps == 1:
            t_steps += time.perf_counter() - t0
    res.steps_per_s = max(steps - 1, 1) / t_steps if t_steps else 0.0
    if neuron:
        import torch_neuronx
        _sync(device)
        t = torch_neuronx.modelled_time(device)
        res.modelled_ms[t.platform] = t.seconds * 1e3
        if t.by_engine:
            res.bound = max(t.by_engine, key=t.by_engine.get)
    if infer:
        model.eval()
        with torch.no_grad(), amp:
            res.output = to(family.infer(model, batch), "cpu")
    return res


def main(family: Family, argv=None) -> None:
    """Each example's command line: eager, then compiled, on neuron."""
    p = argparse.ArgumentParser(description=f"Train and run a tiny {family.name} on neuron.")
    p.add_argument("--device", default="neuron")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    args = p.parse_args(argv)
    modes = [("eager", None)] + ([] if args.no_compile else [("compiled", "neuron")])
    for label, backend in modes:
        r = run(family, args.device, steps=args.steps, dtype=torch.bfloat16,
                compile_backend=backend if torch.device(args.device).type == "neuron" else
                ("inductor" if backend else None))
        modelled = ", ".join(f"{k} {v:.3f} ms/step" for k, v in r.modelled_ms.items())
        print(f"{family.name} [{label}] losses {' '.join(f'{x:.4f}' for x in r.losses)} | "
              f"{r.steps_per_s:.2f} steps/s | modelled {modelled or 'n/a'}"
              + (f" (bound: {r.bound})" if r.bound else ""))
