"""Start N ranks of a worker as plain subprocesses (what torchrun does, minus its launcher
process, to keep the suite fast on a 2-core machine), each with a hard timeout."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKERS = HERE / "_workers.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(scenario: str, nproc: int, timeout: float = 120.0, env: dict | None = None,
        args: tuple = (), expect_fail: bool = False, grace: float = 30.0) -> list:
    """Run ``scenario`` of _workers.py on ``nproc`` ranks; return [(returncode, output)] per
    rank. Kills every rank still alive at ``timeout`` and fails: a hang is a bug."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        e = dict(os.environ)
        e.update({"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                  "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                  "PYTHONUNBUFFERED": "1"})
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable, str(WORKERS), scenario, *args], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      cwd=str(REPO)))
    # Collect output in threads so a chatty rank never blocks on a full pipe.
    outs = [""] * nproc

    def drain(i, p):
        outs[i] = p.stdout.read()

    readers = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    first_failure = None
    hung = []
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if first_failure is None and any(c not in (None, 0) for c in codes) and not expect_fail:
            first_failure = now
        # a failed rank leaves its peers waiting: give them a grace period to fail on their own
        if now > deadline or (first_failure is not None and now - first_failure > grace):
            hung = [i for i, c in enumerate(codes) if c is None]
            for i in hung:
                procs[i].kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    for t in readers:
        t.join(timeout=10)
    results = [(p.returncode, outs[i]) for i, p in enumerate(procs)]
    if hung:
        raise AssertionError(f"{scenario}: ranks {hung} killed (still running at the deadline or "
                             f"{grace}s after a peer failed):\n"
                             + "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, (_, o) in enumerate(results)))
    if not expect_fail:
        bad = [(r, rc, o) for r, (rc, o) in enumerate(results) if rc != 0]
        if bad:
            raise AssertionError(f"{scenario} failed:\n" + "\n".join(
                f"--- rank {r} (exit {rc}) ---\n{o[-4000:]}" for r, rc, o in bad))
    return results
