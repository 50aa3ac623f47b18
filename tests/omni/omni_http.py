"""Omni's OpenAI-style server for the HTTP tests."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def omni_server(model_dir, log_dir, env=None):
    """``vllm-omni serve <dir> --omni`` on a free port of 127.0.0.1 (``env``: more
    environment variables): its URL once /health answers; the server's log is in
    ``log_dir``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import requests
    log = Path(log_dir) / "server.log"
    omni_cli = Path(sys.executable).with_name("vllm-omni")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [str(omni_cli), "serve", str(model_dir), "--omni", "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
