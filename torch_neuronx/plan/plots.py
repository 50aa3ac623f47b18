"""Plots of the what-if (matplotlib, written to PNG): the step-time breakdown of the best
layouts, and the scaling of step time and tokens/s over chip counts."""
from __future__ import annotations

from .cluster import cluster
from .sweep import sweep


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt
    return plt


def plot_breakdown(estimates, path: str, top: int = 8) -> list:
    """Stacked bars of each term for the ``top`` first estimates; returns the plotted rows."""
    plt = _pyplot()
    rows = estimates[:top]
    terms = [k for k in rows[0].breakdown if any(e.breakdown[k] > 0 for e in rows)] if rows else []
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.5))
    left = [0.0] * len(rows)
    for term in terms:
        vals = [e.breakdown[term] * 1e3 for e in rows]
        ax.barh([str(e.layout) for e in rows], vals, left=left, label=term)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("modelled step time (ms)")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [(str(e.layout), {t: e.breakdown[t] for t in terms}) for e in rows]


def plot_scaling(model, instance: str, chip_counts, batch_per_device: int, path: str) -> list:
    """Best fitting layout's step time and tokens/s per chip count (the global batch grows
    with the devices); returns (chips, layout, step seconds, tokens/s) per point."""
    plt = _pyplot()
    points = []
    for chips in chip_counts:
        c = cluster(instance, chips)
        ests = [e for e in sweep(model, c, batch_per_device * c.devices) if e.fits]
        if ests:
            points.append((chips, str(ests[0].layout), ests[0].step_seconds, ests[0].tokens_per_second))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p[0] for p in points], [p[3] for p in points], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"{instance} chips")
    ax.set_ylabel("tokens/s (best fitting layout)")
    for p in points:
        ax.annotate(p[1], (p[0], p[3]), fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return points
