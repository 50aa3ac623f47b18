"""Paired timing with each side in a fresh process, shared by the benchmarks that compare
neuron with the CPU on small steps.

In one process the CPU peer is not measured fairly: once the device's executor thread has run
a parallel kernel, the process holds two OpenMP teams, and on a host with fewer cores than
their threads libgomp shortens every team's spin-wait (docs/device.md), slowing the CPU steps
that follow. So each side runs in a process of its own, the order alternating between pairs.
"""
from __future__ import annotations

import statistics
import subprocess
import sys


def seconds_in_fresh_process(script: str, args: list[str]) -> float:
    """Runs ``python script *args``; its last line of output, a number of seconds."""
    out = subprocess.run([sys.executable, script, *args], check=True, capture_output=True,
                         text=True).stdout
    return float(out.strip().splitlines()[-1])


def alternating(run_cpu, run_dev, pairs: int):
    """``pairs`` runs of each, alternating which goes first; returns the median ratio
    dev/cpu, the median CPU and device times, and every pair's ratio."""
    ratios, tc, td = [], [], []
    for i in range(pairs):
        if i % 2 == 0:
            c, d = run_cpu(), run_dev()
        else:
            d, c = run_dev(), run_cpu()
        ratios.append(d / c)
        tc.append(c)
        td.append(d)
    return statistics.median(ratios), statistics.median(tc), statistics.median(td), ratios
