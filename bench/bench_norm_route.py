"""What charging ``rms_norm`` as NKI-lib's kernel adds to a call's host time on neuron.

    .venv/bin/python bench/bench_norm_route.py [--pairs N]

Routed: ``F.rms_norm`` (the Python kernel: window closes, unrecorded ops, one cached
charge). Unrouted: the same composite called directly, each op charged by the roofline.
Both run the same ATen ops; pairs alternate in one process, each timing a block of calls
plus a synchronize and the cost model's drain. Two settings: the norm alone, called in a
loop (Adaptive Eager may then fuse one call's ops with the next call's, which the routed
call's window closes prevent), and, for decode-sized rows, the norm after a matmul, as in a
model. Printed: median
ms per call of each, and the ratio of medians (routed / unrouted).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch._C import DispatchKey

from torch_neuronx import cost_model

PAIRS = int(sys.argv[sys.argv.index("--pairs") + 1]) if "--pairs" in sys.argv else 15
CALLS = 20


def _block(fn):
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.neuron.synchronize()
    cost_model._drain()
    return (time.perf_counter() - t0) / CALLS * 1e3


def main():
    composite = torch.ops.aten.rms_norm.default._op_dk
    for rows, H in ((1, 4096), (32, 4096), (2048, 4096)):
        x = torch.randn(rows, H, dtype=torch.bfloat16, device="neuron")
        w = torch.randn(H, dtype=torch.bfloat16, device="neuron")
        u = torch.randn(rows, 64, dtype=torch.bfloat16, device="neuron")
        m = torch.randn(64, H, dtype=torch.bfloat16, device="neuron")
        settings = [("alone", lambda: x)]
        if rows <= 32:      # a large matmul would drown the norm
            settings.append(("after a matmul", lambda: u @ m))
        for setting, pre in settings:
            def routed():
                F.rms_norm(pre(), (H,), w, 1e-6)

            def unrouted():
                composite(DispatchKey.CompositeImplicitAutograd, pre(), (H,), w, 1e-6)
            routed(), unrouted()
            a, b = [], []
            for _ in range(PAIRS):
                a.append(_block(routed))
                b.append(_block(unrouted))
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"rms_norm [{rows}, {H}] bf16, {setting}: routed {ma:.3f} ms, unrouted "
                  f"{mb:.3f} ms, ratio {ma / mb:.2f}")


if __name__ == "__main__":
    main()
