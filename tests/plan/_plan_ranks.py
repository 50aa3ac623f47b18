"""Runs a script of tests/plan as the ranks of one job on this machine, as torchrun would
(RANK, WORLD_SIZE, LOCAL_*, MASTER_ADDR/PORT), and returns the JSON each rank printed after
"TRACE "."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def ranks(n: int, script: str, *args: str, env: dict | None = None) -> list:
    """``env``: more variables for every rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent.parent), **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(HERE / script), *args], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
        outs.append(json.loads(next(line[6:] for line in out.splitlines() if line.startswith("TRACE "))))
    return outs
