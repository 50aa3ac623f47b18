"""LoRA fine-tuning of a tiny Llama with PEFT, unchanged: a plain PyTorch loop, or Trainer.

    python examples/peft_lora.py [--trainer] [--steps 6] [--device cpu]

The plain loop runs on ``torch.accelerator.current_accelerator()`` (neuron with torchneuron
installed, as CUDA code would pick cuda); ``--trainer`` lets Trainer pick the device. After
training the adapters are merged into the base weights (``merge_and_unload``) and the merged
model must give the same logits as the adapted one. Prints the losses as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama  # noqa: E402


def lora_model(tok):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                     task_type="CAUSAL_LM", init_lora_weights="gaussian")
    torch.manual_seed(1)   # the gaussian adapter init draws from the default generator
    return get_peft_model(tiny_llama.model(tok), cfg)


def plain_loop(tok, steps: int, device) -> tuple:
    model = lora_model(tok).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    loader = torch.utils.data.DataLoader(tiny_llama.Examples(tok), batch_size=4)
    losses = []
    for _, batch in zip(range(steps), loader):
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def with_trainer(tok, steps: int, extra: list) -> tuple:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir="out/peft", max_steps=steps, logging_steps=1,
                             per_device_train_batch_size=4, learning_rate=5e-3,
                             lr_scheduler_type="constant", report_to="none", save_strategy="no",
                             seed=0, use_cpu="--use_cpu" in extra)
    trainer = Trainer(model=lora_model(tok), args=args, train_dataset=tiny_llama.Examples(tok))
    trainer.train()
    return trainer.model, [e["loss"] for e in trainer.state.log_history if "loss" in e]


def merge(model, tok) -> tuple:
    """Merge the adapters into the base weights; return (merged model, adapted logits,
    merged logits) on the same input."""
    ids = torch.tensor([tok("the cat sat on the mat")["input_ids"]], device=model.device)
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged_model = model.merge_and_unload()
        merged = merged_model(input_ids=ids).logits
    return merged_model, adapted, merged


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default=None, help="plain loop only (default: the accelerator)")
    args, extra = parser.parse_known_args(argv)
    tok = tiny_llama.tokenizer()
    if args.trainer:
        model, losses = with_trainer(tok, args.steps, extra)
    else:
        device = torch.device(args.device) if args.device else torch.accelerator.current_accelerator()
        model, losses = plain_loop(tok, args.steps, device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    merged_model, adapted, merged = merge(model, tok)
    return {"device": str(merged_model.device), "losses": losses, "trainable": trainable,
            "adapted": adapted.cpu(), "merged": merged.cpu(), "model": merged_model}


if __name__ == "__main__":
    out = main()
    print(json.dumps({"device": out["device"], "losses": out["losses"],
                      "trainable_params": out["trainable"],
                      "merge_max_diff": (out["adapted"] - out["merged"]).abs().max().item()}))
