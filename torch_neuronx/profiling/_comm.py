"""Communication exposed vs overlapped for ``torchneuron explore``: on the modelled timeline,
how much of each collective runs while another queue of its device computes."""
from __future__ import annotations

import numpy as np


def communication(hw, union, overlap, top: int) -> dict:
    """Each collective's modelled interval against the union of the non-collective kernels on
    the other queues of its device (work on its own queue runs before or after it, never
    beside it). ``union``/``overlap`` are explore's interval helpers."""
    coll = hw[hw.engine == "collective"]
    per, exposed_total, overlapped_total = [], 0, 0
    for d, c in coll.groupby("device"):
        others = hw[(hw.device == d) & (hw.engine != "collective")]
        for r in c.itertuples():
            o = others[others.queue != r.queue]
            busy = union(o.modelled_start_ns.to_numpy(), (o.modelled_start_ns + o.modelled_ns).to_numpy())
            mine = (np.array([r.modelled_start_ns]), np.array([r.modelled_start_ns + r.modelled_ns]))
            hidden = overlap(mine, busy)
            exposed = int(r.modelled_ns) - hidden
            exposed_total += exposed
            overlapped_total += hidden
            per.append({"name": r.name, "device": int(d), "queue": int(r.queue),
                        "modelled_ns": int(r.modelled_ns), "exposed_ns": exposed,
                        "overlapped_ns": hidden, "file": r.source_file, "line": int(r.source_line)})
    per.sort(key=lambda x: -x["exposed_ns"])
    total = exposed_total + overlapped_total
    return {"communication_ns": total, "communication_exposed_ns": exposed_total,
            "communication_overlapped_ns": overlapped_total,
            "communication_exposed_share": exposed_total / total if total else None,
            "collectives": per[:top]}
