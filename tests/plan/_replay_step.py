"""One training step of a small MLP stack on neuron, traced: ``single`` on one device (per op,
with the module each op ran under), ``fsdp`` (FSDP2 ``fully_shard`` per block and the root)
or ``tp`` (``parallelize_module`` with the Megatron plan ``TP_PLAN``) over WORLD_SIZE ranks.
Prints the trace as JSON after "TRACE ". Run as a rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in
the environment); ``single`` also runs without them."""
import json
import os
import sys

import torch
import torch.nn as nn

import torch_neuronx
from torch_neuronx import plan

DIM, BLOCKS, TOKENS = 256, 2, 128
TP_PLAN = {f"blocks.{i}.{name}": style for i in range(BLOCKS)
           for name, style in (("fc1", "colwise"), ("fc2", "rowwise"))}
FSDP_UNITS = [f"blocks.{i}" for i in range(BLOCKS)] + [""]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, d=DIM, n=BLOCKS):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build(mode: str, dev):
    """The model and its optimizer, laid out for ``mode``."""
    torch.manual_seed(0)
    model = MLP().to(dev)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for name in FSDP_UNITS:
            fully_shard(model.get_submodule(name))
    elif mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("neuron", (int(os.environ["WORLD_SIZE"]),))
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, mesh, {k: styles[v]() for k, v in TP_PLAN.items()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt


def _traced_step(mode: str, dev, rank: int):
    model, opt = build(mode, dev)
    # TP ranks must see the same tokens; FSDP ranks (data parallel) see their own.
    g = torch.Generator().manual_seed(rank if mode == "fsdp" else 0)
    x = torch.randn(TOKENS, DIM, generator=g).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    step()  # warm-up: FSDP's lazy init, DTensor's sharding propagation caches
    step()
    with plan.trace(dev, model if mode == "single" else None) as t:
        step()
    return t


def main():
    """``_replay_step.py MODES [WORLD]``: MODES is ``single`` or a comma-separated list of
    ``fsdp``/``tp``, run one after the other in this process group; ``single`` prints its
    replays for WORLD ranks (default 2)."""
    modes = sys.argv[1].split(",")
    # The replay prices op by op; Adaptive Eager windows (fused pointwise kernels) close at
    # every collective and stream wait of the real runs, which the single-device step does
    # not have, so both sides run unfused (docs/plan.md, "Replaying a traced step");
    # REPLAY_ADAPTIVE_EAGER=1 keeps it on, to measure what that costs the replay.
    torch_neuronx.set_adaptive_eager(os.environ.get("REPLAY_ADAPTIVE_EAGER") == "1")
    rank = int(os.environ.get("RANK", "0"))
    distributed = modes != ["single"]
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("neuron")
    dev = torch.device("neuron", rank)
    torch.neuron.set_device(dev)
    out = {}
    for mode in modes:
        t = _traced_step(mode, dev, rank)
        out[mode] = {"seconds": t.seconds, "flops": t.flops, "collectives": t.collectives,
                     "ops": [[o.charge.name, o.charge.count, o.charge.seconds,
                              [list(s) for s in o.charge.shapes or ()], o.module, o.backward,
                              o.charge.bytes_in, o.charge.bytes_out, o.charge.stream,
                              o.charge.epoch] for o in t.ops]}
        if mode == "single":
            world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
            for name, r in (("fsdp", t.replay_layout(fsdp=world, fsdp_units=FSDP_UNITS)),
                            ("tp", t.replay_layout(tp=world, tp_plan=TP_PLAN))):
                out[mode][name] = {"seconds": r.seconds, "collectives": r.collectives}
    print("TRACE " + json.dumps(out), flush=True)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
