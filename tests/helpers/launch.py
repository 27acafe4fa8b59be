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


# torch 2.13's gloo can abort a rank as it exits, after the job is done: its run-loop thread frees a finished
# collective's tensors and needs the GIL while the interpreter is already shutting down ("terminate called without
# an active exception"; backtrace: ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> TensorImpl::decref_pyobject
# -> take_gil -> PyThread_exit_thread). A plain DDP script without oomguard does it too, about once in 6 runs on a
# loaded 2-core machine. Such a run is launched once more; any other failure fails the test. So is a run that hung
# after the job had said it was done (only the barrier and the process group's teardown run after that line; CI saw
# one): each hung process's stacks are in the output (SIGABRT under PYTHONFAULTHANDLER), for the next to read.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def torchrun_once(command: list[str], timeout: float = 120) -> tuple[int | None, str]:
    """(exit code, or None where it hung and was stopped; everything it printed)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=ENV
    )
    try:
        output = process.communicate(timeout=timeout)[0]
        return process.returncode, output
    except subprocess.TimeoutExpired:
        stop_tree(process)  # the agent and its workers, with their stacks
        try:
            return None, process.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:  # a worker outlived the kill and still holds the pipe
            return None, ""


def torchrun(script: Path, *args: str, done: str, timeout: float = 120) -> tuple[int | None, str]:
    """``torchrun --standalone --nproc_per_node 2 SCRIPT ARGS``: (exit code, or None where it hung; its output).
    A run that printed ``done`` and then failed only in gloo's teardown (see above) is launched once more."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
               str(script), *args]  # fmt: skip
    returncode, output = torchrun_once(command, timeout)
    if returncode != 0 and done in output and (returncode is None or GLOO_EXIT_ABORT in output):
        print(f"torch's gloo teardown failed a finished job; run once more. Its output:\n{output[-6000:]}")
        returncode, output = torchrun_once(command, timeout)
    return returncode, output
