"""One pipeline-parallel training step of the two-block MLP of ``_replay_step`` on neuron:
``torch.distributed.pipelining`` with one ``PipelineStage`` per rank (block i on rank i) and
``ScheduleGPipe`` or ``Schedule1F1B`` over MICROBATCHES micro-batches, the "neuron" backend.
``_pp_step.py SCHEDULE MICROBATCHES``; prints each rank's trace as JSON after "TRACE "."""
import json
import os
import sys

import torch
import torch.distributed as dist

import torch_neuronx
from torch_neuronx import plan

import _replay_step as step_script


def loss_fn(out, target):
    # the single-device step's loss, per micro-batch (the schedule averages the gradients)
    return out.square().mean()


def main():
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    schedule, m = sys.argv[1], int(sys.argv[2])
    torch_neuronx.set_adaptive_eager(False)   # as _replay_step: the replay prices op by op
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("neuron")
    dev = torch.device("neuron", rank)
    torch.neuron.set_device(dev)
    torch.manual_seed(0)
    # PP_TP=T > 1: TP=T inside each stage, a (pp, tp) mesh (TorchTitan's order: pp outermost)
    tp = int(os.environ.get("PP_TP", "1"))
    # PP_FSDP=N > 1: FSDP2 over N ranks inside each stage (a (pp, dp) mesh), not resharded
    # after forward, as TorchTitan does under PP
    dp = int(os.environ.get("PP_FSDP", "1"))
    # PP_REPLICATE=R > 1: HSDP inside each stage, a (pp, replicate, dp) mesh
    rep = int(os.environ.get("PP_REPLICATE", "1"))
    pp, group = world // tp // dp // rep, None
    model = step_script.MLP(n=pp)
    block = model.blocks[rank // tp // dp // rep].to(dev)
    if tp > 1 or dp > 1 or rep > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("neuron", (pp, rep, dp, tp),
                                mesh_dim_names=("pp", "rep", "dp", "tp"))
        if tp > 1:
            parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(),
                                                   "fc2": RowwiseParallel()})
        if dp > 1 or rep > 1:
            fully_shard(block, mesh=mesh["rep", "dp"] if rep > 1 else mesh["dp"],
                        reshard_after_forward=False)
        group = mesh["pp"].get_group()
    stage = PipelineStage(block, rank // tp // dp // rep, pp, dev, group=group)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, m, loss_fn=loss_fn)
    opt = torch.optim.SGD(block.parameters(), lr=0.01)
    x = torch.randn(step_script.TOKENS, step_script.DIM,
                    generator=torch.Generator().manual_seed(0)).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        if rank // tp // dp // rep == 0:
            sched.step(x)
        elif rank // tp // dp // rep == pp - 1:
            sched.step(target=x, losses=[])
        else:
            sched.step()
        opt.step()

    step()
    step()
    with plan.trace(dev, block) as t:
        step()
    out = {"seconds": t.seconds, "flops": t.flops, "collectives": t.collectives,
           "memory_peak": t.memory_peak, "memory_start": t.memory_start,
           "ops": [[o.charge.name, o.charge.count, o.charge.seconds,
                    [list(s) for s in o.charge.shapes or ()], o.module, o.backward,
                    o.charge.bytes_in, o.charge.bytes_out] for o in t.ops]}
    print("TRACE " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
