"""How kernels split a transfer into DMA instructions."""
from __future__ import annotations


def runs(n, parts=4):
    """``n`` consecutive slices as up to ``parts`` runs ``(first, count)``, one DMA each: a DMA
    spreads over 4 of the 16 queues, so four keep them all busy, and the first consumers need
    only the first run."""
    step = -(-n // parts) if n else 1
    return [(j0, min(step, n - j0)) for j0 in range(0, n, step)]
