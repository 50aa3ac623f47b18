"""Start N ranks of a worker as plain subprocesses (what torchrun does, minus its launcher
process, to keep the suite fast on a 2-core machine), each with a hard timeout."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
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
        args: tuple = (), expect_fail: bool = False) -> list:
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
    deadline = time.monotonic() + timeout
    results, hung = [], []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            hung.append(rank)
        results.append((p.returncode, out))
    if hung:
        raise AssertionError(f"{scenario}: ranks {hung} still running after {timeout}s:\n"
                             + "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, (_, o) in enumerate(results)))
    if not expect_fail:
        bad = [(r, rc, o) for r, (rc, o) in enumerate(results) if rc != 0]
        if bad:
            raise AssertionError(f"{scenario} failed:\n" + "\n".join(
                f"--- rank {r} (exit {rc}) ---\n{o[-4000:]}" for r, rc, o in bad))
    return results
