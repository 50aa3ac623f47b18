"""One rank of tests/profiler/test_explore.py's collective profiles (started by
tests/distributed/_launch.py): an all_reduce alone on the default queue ("exposed") or beside a
matmul on a side stream ("overlapped"), profiled into OUT/rank<r>."""
import os
import sys

import torch
import torch.distributed as dist

import torch_neuronx  # noqa: F401  (registers the neuron backend)
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler

RANK = int(os.environ["RANK"])


def main(mode: str, out: str) -> None:
    dist.init_process_group("neuron")
    dev = torch.device("neuron", torch.neuron.current_device())
    x_cpu = torch.full((1 << 22,), float(RANK + 1))
    x = x_cpu.to(dev)
    a = torch.randn(2048, 2048, device=dev)
    torch.neuron.synchronize()
    cfg = NeuronConfig(profile_output_dir=os.path.join(out, f"rank{RANK}"))
    handler = NeuronProfiler(cfg)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.PrivateUse1],
                                    experimental_config=cfg, on_trace_ready=handler.export_trace):
            if mode == "overlapped":
                side = torch.neuron.Stream()
                with torch.neuron.stream(side):
                    b = a @ a
            dist.all_reduce(x)
            torch.neuron.synchronize()
    finally:
        handler.close()
    world = dist.get_world_size()
    assert torch.equal(x.cpu(), torch.full_like(x_cpu, world * (world + 1) / 2)), "all_reduce result"
    if mode == "overlapped":
        assert torch.allclose(b.cpu(), a.cpu() @ a.cpu(), rtol=1e-4, atol=1e-3), "side-stream matmul"
    dist.destroy_process_group()
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
