"""The record of one guarded call across its attempts. The recovery loop (:mod:`oomguard._guard.loop`) makes it
and is the only writer; everything else reads it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard._backends.memory import MemoryBackend
from oomguard._events import FailureSummary
from oomguard._guard.buckets import Choice
from oomguard._ladder.plan import Plan

__all__ = ["Call", "RandomState"]


class RandomState:
    """The random number generators a step draws from (dropout's masks, a sampled augmentation) as a call began:
    the CPU's and the device's. Put back before each retry, so the attempt that works draws what the first drew, as
    its plan run from the start would (a failed attempt's forward, or the planner's, drew some already)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            torch.cuda.set_rng_state(self.accelerator, self.device)


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
    random: RandomState  # the generators as the call began (a part driven after a call: as that call began)
    tried: list[tuple[Plan, FailureSummary]] = field(default_factory=list)
    seconds_lost: float = 0.0
    started: float = field(default_factory=time.monotonic)  # when the call began (the time bound counts from it)
    #: The backend's host<->device byte count when the call began (what the call copied is the difference).
    transferred: int = field(init=False)

    def __post_init__(self) -> None:
        self.transferred = self.backend.transferred_bytes
