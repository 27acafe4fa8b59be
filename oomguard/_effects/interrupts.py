"""Holding shutdown signals while the optimizer step runs, so that an interrupt never splits a step.

Ctrl-C (SIGINT) and a cluster's SIGTERM reach Python as a handler that raises (``KeyboardInterrupt``, or the
``SystemExit`` of a job's own handler) at whatever bytecode the main thread is running: inside ``optimizer.step()``
that leaves some parameters stepped and some not, and inside the journal's undo, some restored and some not.
While :meth:`Interrupts.held` is active, such a signal is only noted; :meth:`Interrupts.deliver` then calls the
handler that was in place, so the interrupt surfaces as itself, once the step has been committed or undone.

Only the main thread receives signals, and only its handlers can be replaced: elsewhere nothing is held.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

__all__ = ["Interrupts", "run_whole"]

_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)
#: Signals a fault raises synchronously (blocking them would only turn the fault into a silent kill).
_FAULTS = {
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS")
    if hasattr(signal, name)
}
_TRIES = 3  # times an interrupted part of a whole run is run again before the run moves on


def run_whole(parts: Iterable[Callable[[], object]]) -> None:
    """Run every part to its end, as one, even through an interrupt (an undo that stops half-way leaves a model
    half-restored, which is worse than either end).

    Meanwhile every signal that can be is blocked (main thread, POSIX): one that arrives is delivered, by its own
    handler, once the last part is done. An interrupt raised all the same (``KeyboardInterrupt`` raised by code, an
    exception set asynchronously from another thread) is kept while its part runs again (the parts must be
    idempotent: put a copy back, restore an entry) and the rest run; it is raised after the last. An ``Exception``
    stops the run at once, as it would any code.
    """
    pending: BaseException | None = None
    with _signals_blocked():
        for part in parts:
            for _ in range(_TRIES):
                try:
                    part()
                    break
                except Exception:
                    raise
                except BaseException as interrupt:  # (KeyboardInterrupt, SystemExit, a job's own BaseException)
                    pending = pending or interrupt
    if pending is not None:
        raise pending


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _FAULTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Interrupts:
    """Shutdown signals noted while held, delivered later by the handlers that were in place."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, Any]] = []  # (signal, the handler in place when it arrived)
        self._depth = 0  # nested holds (a step inside the span the guard holds) install the noters once

    @property
    def pending(self) -> bool:
        """Whether a signal arrived while held and has not been delivered yet."""
        return bool(self._pending)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Note SIGINT and SIGTERM instead of acting on them, until the block ends (main thread only)."""
        if threading.current_thread() is not threading.main_thread() or self._depth:
            self._depth += 1  # (off the main thread nothing is installed: only the main thread gets signals)
            try:
                yield
            finally:
                self._depth -= 1
            return
        previous: dict[int, Any] = {}
        self._depth = 1
        try:
            for number in _SIGNALS:
                handler = signal.getsignal(number)
                if handler is None or handler == signal.SIG_IGN:  # outside Python, or ignored: left alone
                    continue
                previous[number] = handler
                signal.signal(number, self._noter(handler))
            yield
        finally:
            self._depth = 0
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _noter(self, handler: Any) -> Callable[[int, FrameType | None], None]:
        def note(number: int, frame: FrameType | None) -> None:
            self._pending.append((number, handler))

        return note

    def deliver(self) -> None:
        """Act on the signals noted while held, as their handlers would have: raise, or end the process.

        SIGTERM first (a job's handler may save a checkpoint before it exits). A signal whose handler raises
        leaves the ones after it pending, for the next delivery.
        """
        self._pending.sort(key=lambda item: item[0] != getattr(signal, "SIGTERM", None))
        while self._pending:
            number, handler = self._pending.pop(0)
            if handler == signal.SIG_DFL:
                signal.raise_signal(number)  # the default action (SIGTERM: the process ends; SIGINT: Python's)
            else:
                handler(number, None)
