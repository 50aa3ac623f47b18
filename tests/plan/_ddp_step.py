"""One DDP training step of the demo GPT on neuron, traced, then profiled and read back from
the profiler's Parquet export; prints both as JSON. Run as a
rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity

from torch_neuronx import plan
from torch_neuronx.demo.gpt import GPT, GPTConfig
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler


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
    # the same step again, profiled, and read back from the profiler's Parquet export
    with tempfile.TemporaryDirectory() as out:
        cfg = NeuronConfig(profile_output_dir=out, capture_enabled_for_nc=str(rank))
        handler = NeuronProfiler(cfg)
        torch.neuron.synchronize(dev)
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
                                    experimental_config=cfg, on_trace_ready=handler.export_trace):
            step()
        handler.close()
        p = plan.StepTrace.from_profile(os.path.join(out, "trace_0"), device=rank)
    print("TRACE " + json.dumps({"seconds": t.seconds, "collectives": t.collectives,
                                 "flops": t.flops, "hbm_bytes": t.hbm_bytes,
                                 "link_bytes": t.link_bytes, "launches": t.launches,
                                 "replay2": t.replay(2), "replay4": t.replay(4),
                                 "layout2": t.replay_layout(dp=2).seconds,
                                 "layout4": t.replay_layout(dp=4).seconds,
                                 "profile": {"seconds": p.seconds, "collectives": p.collectives,
                                             "flops": p.flops, "hbm_bytes": p.hbm_bytes,
                                             "link_bytes": p.link_bytes,
                                             "launches": p.launches, "replay2": p.replay(2),
                                             "replay4": p.replay(4),
                                             "layout4": p.replay_layout(dp=4).seconds}}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
