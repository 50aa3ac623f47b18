"""Fine-tune a tiny Llama with Hugging Face ``transformers.Trainer``, unchanged.

    python examples/hf_trainer_finetune.py [any TrainingArguments flag, e.g. --bf16
        --torch_compile --gradient_accumulation_steps 2 --gradient_checkpointing
        --resume_from_checkpoint out/trainer/checkpoint-4 --use_cpu]

The script never names a device: with torchneuron installed, Trainer finds the neuron device
(``is_torch_neuron_available()``), trains on ``neuron:0`` (or ``neuron:LOCAL_RANK`` under
torchrun) and, with ``--torch_compile``, compiles with backend "neuron". It prints the loss
of every step and the modelled Trainium time of the run.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama  # noqa: E402

DEFAULTS = ["--output_dir", "out/trainer", "--max_steps", "8", "--logging_steps", "1",
            "--per_device_train_batch_size", "4", "--learning_rate", "2e-3",
            "--lr_scheduler_type", "constant", "--report_to", "none", "--save_strategy", "no",
            "--seed", "0", "--dataloader_num_workers", "0"]


def main(argv=None):
    """Train; return (trainer, per-step losses)."""
    from transformers import HfArgumentParser, Trainer, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        DEFAULTS + list(sys.argv[1:] if argv is None else argv))
    tok = tiny_llama.tokenizer()
    trainer = Trainer(model=tiny_llama.model(tok), args=args,
                      train_dataset=tiny_llama.Examples(tok))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, losses


if __name__ == "__main__":
    trainer, losses = main()
    device = trainer.args.device
    print(json.dumps({"device": str(device), "losses": losses}))
    if device.type == "neuron":
        import torch_neuronx
        print(f"modelled Trainium time: {torch_neuronx.modelled_time(device).seconds * 1e3:.3f} ms")
