"""Hugging Face Trainer on neuron against the same Trainer on CPU, in one process.

The tiny Llama of examples/tiny_llama.py (hidden 64, 2 layers, batch 4 x 32 tokens) trained
by ``transformers.Trainer``: neuron picked by Trainer itself, the peer with ``use_cpu=True``.
Each pair runs CPU and neuron in two fresh processes, the order alternating between pairs
(``_fresh_pairs``: in one process the CPU steps that followed neuron work ran 2.4x slower,
7.1 ms before any neuron work and 17 ms after; ``--same-process`` keeps that scheme to show
it); a run's step time is the median of its step-to-step intervals after a warm-up run in the
same process (Trainer's setup excluded). Reports the median ratio over the
pairs for eager and ``torch_compile=True`` (backend "neuron" against CPU eager and against
Inductor on CPU), and the modelled Trainium time of one step.

    .venv/bin/python bench/bench_ecosystem.py [--pairs 5] [--steps 12]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import tiny_llama  # noqa: E402

import _fresh_pairs  # noqa: E402  (bench/, this script's directory)


def run(tok, steps: int, cpu: bool, compile: bool) -> float:
    """One Trainer run; the median step-to-step interval in seconds."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if not cpu:
                torch.neuron.synchronize()
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, max_steps=steps, per_device_train_batch_size=4,
                                 learning_rate=2e-3, report_to="none", save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, seed=0,
                                 use_cpu=cpu, torch_compile=compile,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=tiny_llama.model(tok), args=args,
                          train_dataset=tiny_llama.Examples(tok), callbacks=[Clock()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return statistics.median(b - a for a, b in zip(ends[1:], ends[2:]))


def _fresh(steps: int, cpu: bool, compile: bool) -> float:
    """One warmed-up run in a fresh process; its median step in seconds."""
    return _fresh_pairs.seconds_in_fresh_process(
        __file__, ["--one", "cpu" if cpu else "neuron", "--steps", str(steps)]
        + (["--compile"] if compile else []))


def paired(tok, pairs: int, steps: int, dev_compile: bool, cpu_compile: bool,
           same_process: bool = False):
    if not same_process:
        return _fresh_pairs.alternating(lambda: _fresh(steps, True, cpu_compile),
                                        lambda: _fresh(steps, False, dev_compile), pairs)
    run(tok, 4, True, cpu_compile), run(tok, 4, False, dev_compile)   # warm-up (and compile)
    ratios, tc, td = [], [], []
    for _ in range(pairs):
        c = run(tok, steps, True, cpu_compile)
        d = run(tok, steps, False, dev_compile)
        ratios.append(d / c)
        tc.append(c)
        td.append(d)
    return statistics.median(ratios), statistics.median(tc), statistics.median(td), ratios


def modelled_step(tok, steps: int, compile: bool) -> float:
    import torch_neuronx
    run(tok, 3, False, compile)
    torch.neuron.synchronize()
    torch_neuronx.reset_modelled_time()
    run(tok, steps, False, compile)
    torch.neuron.synchronize()
    return torch_neuronx.modelled_time(0).seconds / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--same-process", action="store_true",
                    help="run CPU and neuron alternately in this process (unfair to CPU: see above)")
    ap.add_argument("--one", choices=("cpu", "neuron"), help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    tok = tiny_llama.tokenizer()
    if a.one:
        cpu = a.one == "cpu"
        run(tok, 4, cpu, a.compile)
        print(run(tok, a.steps, cpu, a.compile))
        return
    rows = [("Trainer step, eager (neuron / CPU eager)", False, False, "<= 1.05"),
            ("Trainer step, torch_compile (neuron / CPU eager)", True, False, "report"),
            ("Trainer step, torch_compile (neuron / Inductor on CPU)", True, True, "report")]
    print(f"tiny Llama Trainer, {a.pairs} pairs x {a.steps} steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, "
          f"{'one process' if a.same_process else 'a fresh process per run'}")
    print("| benchmark | CPU | neuron | ratio (pairs) | target |\n|---|---|---|---|---|")
    for name, dev_c, cpu_c, target in rows:
        r, c, d, rs = paired(tok, a.pairs, a.steps, dev_c, cpu_c, a.same_process)
        print(f"| {name} | {c * 1e3:.2f} ms | {d * 1e3:.2f} ms | {r:.3f} "
              f"({', '.join(f'{x:.3f}' for x in rs)}) | {target} |", flush=True)
    for name, compile in (("eager", False), ("torch_compile", True)):
        print(f"modelled trn2 time per Trainer step ({name}): "
              f"{modelled_step(tok, a.steps, compile) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
