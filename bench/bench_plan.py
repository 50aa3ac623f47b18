"""The planner's speed: a sweep of 100 layouts of a 1B-parameter model (Llama 3.2 1B shape) on
a Trn2 UltraServer, timed; the issue's target is under 10 s. No peer runs the same model;
the number is reported as is. Run: .venv/bin/python bench/bench_plan.py
"""
from __future__ import annotations

import statistics
import time

from torch_neuronx import plan


def main():
    model = plan.PRESETS["llama-1b"]
    c = plan.cluster("trn2-ultraserver", chips=64)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        ests = plan.sweep(model, c, batch=1024, max_layouts=100)
        times.append(time.perf_counter() - t0)
    assert len(ests) == 100, len(ests)
    print(f"sweep of {len(ests)} layouts of {model.name} ({model.params() / 1e9:.2f}B) on {c.name} "
          f"x {c.chips}: median {statistics.median(times) * 1e3:.1f} ms over 5 runs (target < 10 s)")
    print("best:", ests[0])


if __name__ == "__main__":
    main()
