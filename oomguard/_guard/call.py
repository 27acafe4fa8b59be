"""The record of one guarded call across its attempts. The recovery loop (:mod:`oomguard._guard.loop`) makes it
and is the only writer; everything else reads it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from oomguard._backends.memory import MemoryBackend
from oomguard._events import FailureSummary
from oomguard._guard.buckets import Choice
from oomguard._ladder.plan import Plan

__all__ = ["Call"]


@dataclass(eq=False)
class Call:
    """The state of one guarded call across its attempts."""

    batch: Any  # None for a part of a step someone else drives (its batch is theirs)
    size: int
    backend: MemoryBackend
    choice: Choice
    plan: Plan  # the plan the next attempt runs on
    items_per_sample: float
    step: int  # the step the call counts as (a replay of a step keeps that step's number)
    tried: list[tuple[Plan, FailureSummary]] = field(default_factory=list)
    seconds_lost: float = 0.0
    started: float = field(default_factory=time.monotonic)  # when the call began (the time bound counts from it)
    #: The backend's host<->device byte count when the call began (what the call copied is the difference).
    transferred: int = field(init=False)

    def __post_init__(self) -> None:
        self.transferred = self.backend.transferred_bytes
