"""A second process for the planner's shallow steps: each composed plan needs two or three of them, and they do not
depend on each other, so on a machine with two cores one process runs some while the other runs the rest.

The helper is a fork of the planning process, made before its first shallow step: it has the same models, benches
and fake tensors, and builds and warms its own shallow benches as the parent does. It is told which step to run (a
plan, a depth and the prefetch setting), runs it through the same :meth:`~oomguard._planner.compose.Composed` code,
and sends back the :class:`~oomguard._planner.compose.Trace` and the fake steps it ran (or the error it met). Only
``oomguard plan`` (:func:`oomguard.plan`) uses one: the guard plans inside a training process, which may hold a CUDA
context, threads and open files a fork must not copy.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Helper", "usable"]

logger = logging.getLogger("oomguard")

#: What the helper is asked to run: (plan, blocks, prefetch_from), and what it answers: ("trace" or "error",
#: the trace or the exception, fake steps it ran).
Request = tuple[Any, int, int]


def usable() -> bool:
    """Whether a helper can run here: a fork start method and a second core."""
    return "fork" in multiprocessing.get_all_start_methods() and (os.cpu_count() or 1) > 1


class Helper:
    """The forked process; ``run(plan, blocks, prefetch_from)`` is what it runs for each request (in the child),
    ``steps()`` the fake steps it has run so far there."""

    def __init__(self, run: Callable[[Any, int, int], Any], steps: Callable[[], int]) -> None:
        context = multiprocessing.get_context("fork")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, run, steps), daemon=True)
        self._process.start()
        child.close()
        self.steps = 0  # fake steps the helper ran
        self.pending = 0

    def send(self, request: Request) -> None:
        """Ask for one shallow step (answered, in order, by :meth:`receive`)."""
        self._connection.send(request)
        self.pending += 1

    def receive(self) -> Any:
        """The answer to the oldest request: its trace; or the error it met, raised here."""
        kind, value, steps = self._connection.recv()
        self.pending -= 1
        self.steps += steps
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        """Let the process end (it drops what it measured)."""
        with contextlib.suppress(OSError, EOFError):
            while self.pending:  # (an error in the parent left answers unread, errors among them: dropped)
                self._connection.recv()
                self.pending -= 1
        with contextlib.suppress(OSError, ValueError):
            self._connection.send(None)
        self._connection.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _serve(connection: Connection, run: Callable[[Any, int, int], Any], steps: Callable[[], int]) -> None:
    """The helper's loop: each request run and answered, until None (or the parent is gone)."""
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        before = steps()
        try:
            kind, value = "trace", run(*request)
        except Exception as error:
            kind, value = "error", _picklable(error)
        connection.send((kind, value, steps() - before))


def _picklable(error: Exception) -> Exception:
    """``error`` where it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
