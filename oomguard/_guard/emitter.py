"""Where a guard's events go: the log, the guard's recent events, and every sink (its tally, the log file, the
user's). Shared by the guard and its recovery loop without either holding the other."""

from __future__ import annotations

import collections

from oomguard._events import Event, EventSink, log_event, logger

__all__ = ["Emitter"]

_EVENTS_KEPT = 10_000  # in memory; the log file keeps everything


class Emitter:
    """Sends each event to the log and to every sink, and keeps the most recent 10,000."""

    def __init__(self, sinks: list[EventSink]) -> None:
        self.sinks = sinks
        self.events: collections.deque[Event] = collections.deque(maxlen=_EVENTS_KEPT)

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        log_event(event)
        for sink in self.sinks:
            try:
                sink(event)
            except Exception:  # a broken sink must not kill a long training job
                logger.exception("oomguard: event sink %r failed", sink)
