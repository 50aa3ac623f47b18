"""Parquet export of a 100k-event trace (target < 5 s), and profiler overhead on a small
train step: neuron with/without stacks vs CPU's own profiler overhead on CPU (paired medians,
interleaved in one process)."""
import statistics
import tempfile
import time

import torch

import torch_neuronx  # noqa: F401
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler, export_parquet


def _export_100k():
    dev = [(i % 2, i % 4, ("add", "mm", "relu")[i % 3], "op", 1e-6 * (1 + i % 7), 1) for i in range(100_000)]
    times = []
    for _ in range(3):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            export_parquet(d, device_events=dev)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _timed(device, mode, model, opt, x, tmp):
    t0 = time.perf_counter()
    if mode == "off":
        _step(model, opt, x)
    else:
        acts = [torch.profiler.ProfilerActivity.CPU]
        cfg = NeuronConfig(profile_output_dir=tmp)
        handler = NeuronProfiler(cfg) if device == "neuron" else None
        with torch.profiler.profile(activities=acts, with_stack=(mode == "stack"), experimental_config=cfg):
            _step(model, opt, x)
        if handler is not None:
            handler.close()
    return time.perf_counter() - t0


def main():
    print(f"parquet export, 100k events: median {_export_100k():.2f} s (target < 5 s)")
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for device in ("neuron", "cpu"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)]).to(device)
            opt = torch.optim.AdamW(model.parameters())
            x = torch.randn(32, 128, device=device)
            t = {m: [] for m in ("off", "events", "stack")}
            for _ in range(3):
                for m in t:
                    _timed(device, m, model, opt, x, tmp)
            for _ in range(15):
                for m in t:
                    t[m].append(_timed(device, m, model, opt, x, tmp))
            med = {m: statistics.median(v) for m, v in t.items()}
            ratios[device] = (med["events"] / med["off"], med["stack"] / med["off"])
            print(f"{device}: step {med['off'] * 1e3:.2f} ms; profiled/unprofiled "
                  f"{ratios[device][0]:.2f}x, with stacks {ratios[device][1]:.2f}x")


if __name__ == "__main__":
    main()
