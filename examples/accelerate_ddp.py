"""Train a tiny Llama with Hugging Face Accelerate, unchanged: DDP on two neuron devices.

    accelerate launch --num_processes 2 examples/accelerate_ddp.py [--steps 6]
    accelerate launch --num_processes 2 --mixed_precision bf16 examples/accelerate_ddp.py
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 torchrun --nproc_per_node 2 examples/accelerate_ddp.py
                                                  # the same script on CPU with gloo (the peer)

A plain Accelerate script: it never names a device or a backend. With torchneuron installed,
``Accelerator()`` finds the neuron devices (``DistributedType.MULTI_NEURON``), each rank trains
on ``neuron:LOCAL_RANK`` and DDP's gradient all-reduces run on the "neuron" c10d backend.
Halfway it saves the whole training state (``save_state``), trains on, then reloads the state
(``load_state``) and trains the second half again: both halves must give the same losses.
Rank 0 prints one JSON line with the device, the mixed precision and the gathered losses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama  # noqa: E402


def train(accelerator, model, opt, loader, steps: int) -> list:
    losses = []
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        # every rank's loss, gathered with all_gather_into_tensor (a flat output, as on CUDA)
        losses.append(accelerator.gather(loss.detach()[None]).tolist())
    return losses


def main(argv=None) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--state_dir", default="out/accelerate_state")
    args = parser.parse_args(argv)

    accelerator = Accelerator()
    set_seed(0)
    tok = tiny_llama.tokenizer()
    model = tiny_llama.model(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = torch.utils.data.DataLoader(tiny_llama.Examples(tok), batch_size=4, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    half = args.steps // 2
    first = train(accelerator, model, opt, loader, half)
    accelerator.save_state(args.state_dir)
    second = train(accelerator, model, opt, accelerator.skip_first_batches(loader, half), half)
    # map_location="cpu": multi-process load_state reads safetensors "on_device", and
    # safetensors (0.8) knows no device string "neuron:N"; the weights are copied into the
    # neuron parameters either way (docs/ecosystem.md, known limits).
    accelerator.load_state(args.state_dir, map_location="cpu")
    again = train(accelerator, model, opt, accelerator.skip_first_batches(loader, half), half)
    accelerator.wait_for_everyone()
    # Leave the process group before exit, as PyTorch asks: a gloo group torn down at
    # interpreter exit can abort a rank ("terminate called without an active exception"),
    # seen once on the CPU peer run under load.
    accelerator.end_training()
    return {"device": str(accelerator.device), "distributed_type": str(accelerator.distributed_type),
            "mixed_precision": accelerator.mixed_precision, "num_processes": accelerator.num_processes,
            "losses": first + second, "resumed": again}


if __name__ == "__main__":
    result = main()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
