"""Where a guard's events go: the log, the guard's recent events, and every sink (its tally, the log file, the
user's). Shared by the guard and its recovery loop without either holding the other.

A step whose progress event ``log_every`` does not log is held, and sent where no later progress event came: to
every sink when the guard is closed; to the log files alone (:class:`Held`) when it is dropped or the interpreter
exits, as a user's sink may hold the guard, which a finalizer must not keep alive. So the log's last step is the
job's last step: a 45-step job logged at every tenth step ended its log at step 40, and ``oomguard report``
counted 41 steps.
"""

from __future__ import annotations

import collections

from oomguard._events import Event, EventSink, JsonlSink, ProgressEvent, log_event, logger

__all__ = ["Emitter", "Held"]

_EVENTS_KEPT = 10_000  # in memory; the log file keeps everything


class Held:
    """The last step's progress event where it was not logged, and the log files to write it to when the guard is
    dropped (see the module): nothing here refers to the guard."""

    def __init__(self) -> None:
        self.event: ProgressEvent | None = None
        self.logs: list[JsonlSink] = []

    def write(self) -> None:
        """Write the event held, if any, to the log files (a failure is logged: this runs at a drop or at exit)."""
        event, self.event = self.event, None
        if event is None:
            return
        for log in self.logs:
            try:
                log(event)
            except Exception:
                logger.exception("oomguard: the last step's progress could not be written to %s", log.path)


class Emitter:
    """Sends each event to the log and to every sink, and keeps the most recent 10,000."""

    def __init__(self, sinks: list[EventSink]) -> None:
        self.held = Held()
        self.sinks = sinks
        self.events: collections.deque[Event] = collections.deque(maxlen=_EVENTS_KEPT)

    @property
    def sinks(self) -> list[EventSink]:
        return self._sinks

    @sinks.setter
    def sinks(self, sinks: list[EventSink]) -> None:
        self._sinks = sinks
        self.held.logs = [sink for sink in sinks if isinstance(sink, JsonlSink)]

    def __call__(self, event: Event) -> None:
        if isinstance(event, ProgressEvent):
            self.held.event = None  # (a later step's progress says as much)
        self.events.append(event)
        log_event(event)
        for sink in self.sinks:
            try:
                sink(event)
            except Exception:  # a broken sink must not kill a long training job
                logger.exception("oomguard: event sink %r failed", sink)

    def hold(self, event: ProgressEvent) -> None:
        """Keep ``event``, a step's progress that is not logged, to send at :meth:`flush` if no later one comes."""
        self.held.event = event

    def flush(self) -> None:
        """Send the progress event held, if any (the last step's), to every sink: at the guard's close."""
        held, self.held.event = self.held.event, None
        if held is not None:
            self(held)
