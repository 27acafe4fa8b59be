"""Reading the guard's events."""

from __future__ import annotations

from typing import Any


def first_event(events: list[Any], kind: str) -> Any:
    """The first event of ``kind`` (progress events interleave with the others)."""
    return next(event for event in events if event.kind == kind)
