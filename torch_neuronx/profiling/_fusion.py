"""Fusion opportunities for ``torchneuron explore``: chains of small elementwise kernels that
ran one after another on a queue without Adaptive Eager fusing them."""
from __future__ import annotations

# Engines of unfused elementwise kernels; "fused" kernels are Adaptive Eager's already.
_ELEMENTWISE = ("vector", "scalar")
# Random fills draw from the generator in launch order rather than compute on a tensor, so
# Adaptive Eager has nothing to fuse them with.
_RANDOM = frozenset({"normal_", "uniform_", "random_", "bernoulli_", "exponential_",
                     "cauchy_", "log_normal_", "geometric_"})


def fusion_opportunities(hw, launch_ns: float, top: int) -> list:
    """Runs of two or more consecutive launches on one (device, queue), in modelled order, each
    elementwise and small (mean under twice ``launch_ns``, the cost model's fixed cost per
    launch: launch overhead plus kernel latency). The export carries no tensor identities, so
    data flow between the kernels is not checked: a chain is a candidate, its lines say where.
    A fused kernel pays the fixed cost once instead of once per launch, so the modelled saving
    is (launches - 1) * launch_ns; the intermediate HBM traffic it would also save is not
    counted (it is negligible for kernels this small)."""
    chains = []
    for (dev, queue), k in hw.sort_values("modelled_start_ns").groupby(["device", "queue"]):
        run = []
        for r in k.itertuples():
            small = (r.engine in _ELEMENTWISE and r.name not in _RANDOM and r.launches > 0
                     and r.modelled_ns / r.launches < 2 * launch_ns)
            if small:
                run.append(r)
                continue
            _close(run, dev, queue, launch_ns, chains)
            run = []
        _close(run, dev, queue, launch_ns, chains)
    chains.sort(key=lambda c: -c["saved_ns"])
    return chains[:top]


def _close(run, dev, queue, launch_ns, chains) -> None:
    launches = sum(int(r.launches) for r in run)
    if launches < 2:
        return
    lines = []
    for r in run:
        where = {"file": r.source_file, "line": int(r.source_line)}
        if r.source_line >= 0 and where not in lines:
            lines.append(where)
    chains.append({"device": int(dev), "queue": int(queue), "launches": launches,
                   "kernels": [r.name for r in run][:16],
                   "modelled_start_ns": int(run[0].modelled_start_ns),
                   "modelled_ns": int(sum(int(r.modelled_ns) for r in run)),
                   "saved_ns": int(round((launches - 1) * launch_ns)),
                   "source_lines": lines[:16]})
