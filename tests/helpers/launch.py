"""Two-rank gloo jobs on CPU: each rank a process of its own, run under a hard timeout, nothing left running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

WORLD = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch(worker: Path, out: Path, mode: str, timeout: float) -> tuple[list[int | None], bool]:
    """Run both ranks of the script ``worker`` (``python WORKER RANK WORLD PORT OUT MODE``, each logging to
    ``OUT/rank<RANK>.log``); (their exit codes, whether they had to be killed). Nothing is left running."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(WORLD), str(port), str(out), mode],
            stdout=(out / f"rank{rank}.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a hung rank and its children die together
            env=env,
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(rank.poll() is None for rank in ranks):
        time.sleep(0.2)
    hung = any(rank.poll() is None for rank in ranks)
    for rank in ranks:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
        rank.wait(timeout=30)
    return [rank.returncode for rank in ranks], hung
