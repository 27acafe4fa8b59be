"""Two-rank gloo jobs on CPU: each rank a process of its own, run under a hard timeout, nothing left running.

A rank that outlives its timeout is first sent SIGABRT, on which Python's faulthandler (``PYTHONFAULTHANDLER``,
set for every process started here) writes every thread's stack to the rank's output: a hang in CI says where it
hung. Then it is killed with its whole process tree.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

WORLD = 2

#: Every test that starts a job of several ranks: under ``pytest -n 2 --dist loadgroup`` (make test) they run on one
#: worker, one job at a time, so two jobs of two ranks each never share this machine's two cores.
RANKS = pytest.mark.xdist_group("ranks")

#: The environment of every process started here: one thread each (two ranks share two cores), output unbuffered,
#: and a stack dump on SIGABRT.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def rendezvous() -> str:
    """An ``init_method`` for a new job: a file no other job shares, where a TCP port picked in advance could be
    taken by another job's socket before rank 0 binds it."""
    handle, path = tempfile.mkstemp(prefix="oomguard-rendezvous-")
    os.close(handle)
    os.unlink(path)  # the store creates it; a stale file from an earlier job would confuse it
    return f"file://{path}"


def stop_tree(process: subprocess.Popen, grace: float = 5.0) -> None:  # type: ignore[type-arg]
    """Dump the stacks of ``process`` and all its descendants (SIGABRT), give them ``grace`` seconds to write them,
    then kill what is left. Descendants are found first: a launcher's workers may sit in sessions of their own, out
    of reach of a kill of its process group, and are orphaned once it dies."""
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)  # (reaped by its Popen, which keeps its exit code)
    _, alive = psutil.wait_procs(tree[1:], timeout=grace)
    for member in [*alive, *tree[:1]] if process.poll() is None else alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    process.wait(timeout=30)


def launch(worker: Path, out: Path, mode: str, timeout: float) -> tuple[list[int | None], bool]:
    """Run both ranks of the script ``worker`` (``python WORKER RANK WORLD INIT_METHOD OUT MODE``, each logging to
    ``OUT/rank<RANK>.log``); (their exit codes, whether they had to be killed). Nothing is left running."""
    init_method = rendezvous()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(WORLD), init_method, str(out), mode],
            stdout=(out / f"rank{rank}.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a hung rank and its children die together
            env=ENV,
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(rank.poll() is None for rank in ranks):
        time.sleep(0.2)
    hung = any(rank.poll() is None for rank in ranks)
    for rank in ranks:
        if rank.poll() is None:
            stop_tree(rank)
        rank.wait(timeout=30)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(init_method.removeprefix("file://"))
    return [rank.returncode for rank in ranks], hung
