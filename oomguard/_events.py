"""Events: what the guard did, as data.

Each event is a frozen dataclass with ``to_dict()``; sinks are plain callables that take an event. The guard
writes every event as one JSON line to ``log_file`` (if given), calls the user's sinks, and logs one readable
line on the ``oomguard`` logger. On the happy path only ``progress`` events are written (each of the first
``log_every`` steps, then every ``log_every``-th; logged at DEBUG).

The log file is strict JSON (what ``jq`` and log shippers accept): a NaN or infinite number, a diverged loss say,
is written as ``null`` and named, by its dotted path, in the event's ``"non_finite"`` object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from oomguard._backends.memory import MemorySnapshot
from oomguard._backends.units import format_bytes, requested_bytes
from oomguard._jsonl import JsonlSink, strict_json
from oomguard._ladder.plan import Phase

__all__ = [
    "Event",
    "EventSink",
    "ExhaustedEvent",
    "FailureSummary",
    "FallbackEvent",
    "JsonlSink",
    "OOMEvent",
    "PlannedEvent",
    "ProgressEvent",
    "RecoveredEvent",
    "RelaxEvent",
    "RetryEvent",
    "StateFileEvent",
    "TunedEvent",
    "host_figures",
    "strict_json",
]

logger = logging.getLogger("oomguard")


@dataclass(frozen=True)
class FailureSummary:
    """What the guard keeps of an out-of-memory error once the exception and its frames are dropped."""

    error_type: str
    message: str
    phase: Phase  # where the attempt was: apply, split, forward, backward, clip or optimizer
    micro_batch: int  # index of the micro-batch that failed (0 outside forward/backward)
    requested_bytes: int | None
    memory: MemorySnapshot
    #: Host memory (RAM) ran out, not the device's: ``memory.host_allocated`` and ``host_budget`` are the figures
    #: that matter then (the device's say how full it was, not what failed).
    host: bool = False
    host_budget: int | None = None  # the guard's host budget, where ``host`` (None: unlimited or unknown)

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        phase: Phase,
        micro_batch: int,
        memory: MemorySnapshot,
        *,
        host: bool = False,
        host_budget: int | None = None,
    ) -> FailureSummary:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return cls(
            type(exc).__name__, message[:500], phase, micro_batch, requested_bytes(str(exc)), memory, host, host_budget
        )

    def same_error(self, other: FailureSummary) -> bool:
        """Whether ``other`` is the same error: its type and message."""
        return (self.error_type, self.message) == (other.error_type, other.message)

    def describe(self) -> str:
        where = (
            f"{self.phase} of micro-batch {self.micro_batch + 1}"
            if self.phase in (Phase.FORWARD, Phase.BACKWARD)
            else self.phase
        )
        asked = f", tried to allocate {format_bytes(self.requested_bytes)}" if self.requested_bytes else ""
        return f"OOM in {where}{asked}"

    def describe_memory(self) -> str:
        """The memory picture at the failure: the device's; after a host failure, the host's first."""
        if not self.host:
            return self.memory.describe()
        held = host_figures(self.memory.host_held, self.host_budget)
        return f"host memory (RAM) ran out: {held}; device: {self.memory.describe()}"


def host_figures(held: int | None, budget: int | None, estimated: bool = False) -> str:
    """What the guard held on the host (``estimated``: by the rungs) and its budget, in words: ``"the guard held
    3.9 GiB on the host, of its host budget of 4.0 GiB"``."""
    amount = (
        "an unknown amount (this device does not count it)"
        if held is None
        else f"about {format_bytes(held)} (the rungs' estimate: this device does not count it)"
        if estimated
        else format_bytes(held)
    )
    limit = "no host budget known" if budget is None else f"its host budget of {format_bytes(budget)}"
    return f"the guard held {amount} on the host, of {limit}"


@dataclass(frozen=True)
class Event:
    """Fields every event has. ``plan`` is the plan the event is about, as a dict."""

    kind: ClassVar[str] = "event"
    step: int
    plan: dict[str, Any]
    memory: MemorySnapshot
    time: float = field(default_factory=time.time, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        """The event as plain data: what ``log_file`` holds, one JSON object a line."""
        data: dict[str, Any] = {"event": self.kind}
        data.update(asdict(self, dict_factory=_plain))
        return data

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class OOMEvent(Event):
    """An attempt ran out of memory; the guard freed what it held."""

    kind: ClassVar[str] = "oom"
    attempt: int
    rung: str | None  # the last rung engaged in the failing plan, if any
    error: FailureSummary
    memory_after_recovery: MemorySnapshot
    seconds: float = 0.0  # spent on the failed attempt
    #: NVML figures (device total/used/free, other processes) and fragmentation evidence, where available.
    telemetry: dict[str, Any] | None = None

    def describe(self) -> str:
        text = (
            f"step {self.step}: {self.error.describe()} on attempt {self.attempt} "
            f"({self.error.describe_memory()}); freed back to {format_bytes(self.memory_after_recovery.allocated)}"
        )
        fragmented = (self.telemetry or {}).get("fragmentation")
        if fragmented:
            text += (
                f"; the allocator looks fragmented ({format_bytes(fragmented['reserved_not_allocated'])} reserved "
                f"but unused, {fragmented['new_retries']} new cudaMalloc retries): {fragmented['recommendation']}"
            )
        return text


@dataclass(frozen=True)
class FallbackEvent(Event):
    """The guard moved down the ladder: ``plan`` is the new plan, ``previous_plan`` the one that failed.

    ``memory_at_failure`` is the picture when the previous plan failed, ``memory`` the one after recovery.
    ``rung`` is the rung engaged (the deepest one, for a jump); ``engaged`` names every rung a jump to the
    plan the dry-run planner predicted engaged at once, and is empty for a single rung down.
    ``planning_seconds`` and ``fake_steps`` are what the dry run before it cost (a jump's; or one that knew no
    better, before a single rung down): 0 where the guard did not plan, or took an answer it had recorded for
    the same batch shape (:mod:`oomguard._guard.answers`).
    """

    kind: ClassVar[str] = "fallback"
    rung: str
    previous_plan: dict[str, Any]
    memory_at_failure: MemorySnapshot
    description: str
    engaged: tuple[str, ...] = ()
    planning_seconds: float = 0.0
    fake_steps: int = 0

    def describe(self) -> str:
        return f"step {self.step}: falling back to {self.rung}: {self.description}"


@dataclass(frozen=True)
class RecoveredEvent(Event):
    """The batch finished on ``plan`` after ``ooms`` out-of-memory errors."""

    kind: ClassVar[str] = "recovered"
    rungs: tuple[str, ...]
    ooms: int
    seconds_lost: float
    description: str

    def describe(self) -> str:
        return (
            f"step {self.step}: recovered after {self.ooms} OOM(s) on {self.description} "
            f"({self.seconds_lost:.2f} s spent on failed attempts)"
        )


@dataclass(frozen=True)
class RetryEvent(Event):
    """The first out-of-memory error of a call on a plan that had run ``clean_steps`` clean steps for its batch
    bucket: the guard tries ``plan`` once more before moving down the ladder (an allocator that can fail while the
    memory it needs is pending, as CUDA's caching allocator can: pytorch#189504). ``wasted``: such tries so far that
    ran out of memory again."""

    kind: ClassVar[str] = "retry"
    clean_steps: int
    wasted: int

    def describe(self) -> str:
        return (
            f"step {self.step}: out of memory on a plan that ran {self.clean_steps} clean step(s): trying it once "
            f"more before moving down the ladder (an allocator can fail while the memory it needs is pending)"
        )


@dataclass(frozen=True)
class RelaxEvent(Event):
    """After clean steps the guard tried the cheaper ``plan`` once; ``outcome`` is ``"held"`` or ``"failed"``.

    On ``"failed"`` the call went back to ``previous_plan`` and the next try waits ``next_try_after`` steps. On
    ``"host"`` the try was not made: ``plan`` keeps more on the host than the guard's host budget (``description``
    says how much of what), so the call ran on ``previous_plan``; the next try waits ``next_try_after`` steps.
    """

    kind: ClassVar[str] = "relax"
    rung: str  # the rung given back
    previous_plan: dict[str, Any]
    outcome: str
    next_try_after: int
    description: str

    def describe(self) -> str:
        verdict = {
            "held": "it fits",
            "host": f"not tried, the host has no room for it; next try in {self.next_try_after} steps",
        }.get(self.outcome, f"out of memory, back; next try in {self.next_try_after} steps")
        return f"step {self.step}: stepping back up ({self.rung}): {self.description}: {verdict}"


@dataclass(frozen=True)
class TunedEvent(Event):
    """Once a bucket settled after an OOM, the guard timed the fitting plans the planner ranked fastest on real
    steps and keeps ``plan``, the fastest it measured. ``timings`` has each plan tried and its median step time
    in seconds (None: it ran out of memory, the step went back to ``previous_plan``). The search that ranked
    them took ``planning_seconds`` and ``fake_steps`` steps on fake tensors, spread over ``search_calls``
    training calls (each call's share is bounded; see :mod:`oomguard._guard.foresight`)."""

    kind: ClassVar[str] = "tuned"
    previous_plan: dict[str, Any]
    timings: tuple[tuple[dict[str, Any], float | None], ...]
    description: str
    planning_seconds: float = 0.0
    fake_steps: int = 0
    search_calls: int = 1

    def describe(self) -> str:
        return f"step {self.step}: timed {len(self.timings)} plans that fit: {self.description}"


@dataclass(frozen=True)
class PlannedEvent(Event):
    """``preplan=True``, at the first call: ``plan`` is the plan the job starts on. ``recommended``: the dry-run
    planner recommended it (False: no plan on the ladder fits, the step cannot be planned, or planning was skipped
    for the state file, whose plan for this batch's bucket ``plan`` then is, the default where it has none).
    ``skipped``: no dry run, the state file remembered plans for this model and device (``"state_file"``), or the
    guard had recorded the answer for a batch of this shape (``"recorded"``); None where it planned.
    ``planning_seconds`` and ``fake_steps``: what planning cost (0 where it was skipped)."""

    kind: ClassVar[str] = "planned"
    recommended: bool
    skipped: str | None
    description: str
    planning_seconds: float = 0.0
    fake_steps: int = 0

    def describe(self) -> str:
        return f"step {self.step}: preplan: {self.description}"


@dataclass(frozen=True)
class ProgressEvent(Event):
    """Every ``log_every`` steps: the step's loss, plan and peak, and the steps spent on each rung so far."""

    kind: ClassVar[str] = "progress"
    loss: float
    bucket: int
    steps_by_rung: dict[str, int]
    transfer_bytes: int = 0  # host<->device bytes the step copied

    def describe(self) -> str:
        return (
            f"step {self.step}: loss {self.loss:.4f}, peak {format_bytes(self.memory.peak)} of "
            f"{format_bytes(self.memory.capacity)}"
        )


@dataclass(frozen=True)
class ExhaustedEvent(Event):
    """The guard gave up on the batch (``reason`` is ``"ladder"``, ``"attempts"``, ``"time"``, or ``"host"``: host
    memory ran out, which the ladder does not relieve)."""

    kind: ClassVar[str] = "exhausted"
    reason: str
    ooms: int
    tried: tuple[dict[str, Any], ...]
    #: Where ``reason`` is ``"host"``: the host memory the guard held at the last failure (counted, or where the
    #: backend does not count it the rungs' estimate: ``host_estimated``), and its host budget.
    host_held: int | None = None
    host_budget: int | None = None
    host_estimated: bool = False

    def describe(self) -> str:
        text = f"step {self.step}: giving up on this batch ({self.reason}) after {self.ooms} OOM(s)"
        if self.reason == "host":
            text += (
                f": host memory (RAM) ran out: {host_figures(self.host_held, self.host_budget, self.host_estimated)}"
            )
        return text


@dataclass(frozen=True)
class StateFileEvent(Event):
    """Saving plans to the state file ``path`` failed (``error`` says why), or works again (``error`` is None).

    A save follows a committed step, so a failure never fails the call: training goes on with the plans in
    memory and the save is retried. Sent once when saving starts failing and once when it works again, not per
    call. Logged at WARNING while failing, at INFO on recovery.
    """

    kind: ClassVar[str] = "state_file"
    path: str
    error: str | None
    description: str  # what it means for the job, and what to do

    def describe(self) -> str:
        if self.error is not None:
            text = f"step {self.step}: cannot save plans to the state file {self.path} ({self.error})"
        else:
            text = f"step {self.step}: the plans are saved to the state file {self.path} again"
        return f"{text}: {self.description}" if self.description else text


EventSink = Callable[[Event], None]


def _plain(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """A dict of plain values: a phase as its string."""
    return {key: value.value if isinstance(value, Phase) else value for key, value in items}


_LEVELS = {
    "oom": logging.WARNING,
    "fallback": logging.WARNING,
    "exhausted": logging.ERROR,
    "progress": logging.DEBUG,
    "state_file": logging.WARNING,
}


def log_event(event: Event) -> None:
    """One readable line on the ``oomguard`` logger (progress lines at DEBUG; a state file saved again at INFO)."""
    level = _LEVELS.get(event.kind, logging.INFO)
    if isinstance(event, StateFileEvent) and event.error is None:
        level = logging.INFO
    logger.log(level, "%s", event.describe())
