"""One DDP training step of the demo GPT on neuron, traced; prints the trace as JSON. Run as a
rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torch_neuronx import plan
from torch_neuronx.demo.gpt import GPT, GPTConfig


def main():
    rank = int(os.environ["RANK"])
    dist.init_process_group("neuron")
    dev = torch.device("neuron", rank)
    torch.neuron.set_device(dev)
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = DDP(GPT(cfg).to(dev), device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, x)
        loss.backward()
        opt.step()

    step()  # warm-up: DDP builds its buckets on the first backward
    step()
    with plan.trace(dev) as t:
        step()
    print("TRACE " + json.dumps({"seconds": t.seconds, "collectives": t.collectives,
                                 "replay2": t.replay(2), "replay4": t.replay(4),
                                 "layout2": t.replay_layout(dp=2).seconds,
                                 "layout4": t.replay_layout(dp=4).seconds}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
