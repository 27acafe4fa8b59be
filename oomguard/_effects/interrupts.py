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
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["Interrupts"]

_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)


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
