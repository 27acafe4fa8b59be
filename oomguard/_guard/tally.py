"""The tally: what a job's events add up to, for a guard's ``summary()`` and for ``oomguard report`` alike.

A guard feeds its tally every event it emits and every step it completes; the report feeds a tally the events of
a log (JSON lines), where a step number going backwards means a restarted job appending to the same log. The
time an out-of-memory error cost is counted against what it led to: the rung that engaged next, a try at a
less degraded plan that backed off (``"(stepping back up)"``), the same plan tried once more (``"(the same plan
again)"``), or giving up on the batch (``"(gave up)"``).

A log can be damaged (a crash mid-line, a hand edit, another program writing to it): :func:`event_problem` says
which events a tally cannot count, so a reader can skip them and say so, while the guard's own events go
straight to :meth:`Tally.add` unchecked and are counted exactly as before.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomguard._events import Event
from oomguard._guard.results import GuardSummary
from oomguard._ladder.plan import BUILTIN_RUNGS, Plan

__all__ = ["Tally", "event_problem"]


#: The memory figures ``oomguard report --plot`` draws from every progress event.
_DRAWN = ("peak", "allocated")
#: The host figures the report reads (the host memory the guard held after an event, and the most since the peaks
#: were reset: over the step, for a progress event).
_HOST = ("host_allocated", "host_peak")


def event_problem(event: Mapping[str, Any]) -> str | None:
    """Why a tally, or a plot of the log, cannot use ``event``: a short phrase for a report's line of skipped
    events (``"fallback without a rung"``), or ``None`` for an event shaped as the guard writes them.

    It checks exactly the fields that :meth:`Tally.add` and ``oomguard report --plot`` read, so that a damaged
    event is skipped whole rather than counted half or crashing the report.
    """
    kind = event.get("event")
    if not isinstance(kind, str):
        return "no event name"
    step = event.get("step", 0)
    if not _count(step):
        return "step not a whole number"
    memory = event.get("memory")
    if memory is not None and not isinstance(memory, Mapping):
        return "memory not an object"
    figures = dict(memory or {})  # the figures read (the drawn ones, and the capacity): byte counts or null
    if not all(figures.get(name) is None or _count(figures[name]) for name in (*_DRAWN, "capacity", *_HOST)):
        return "memory figures not byte counts"
    if "seconds" in event and not _seconds(event["seconds"]):
        return "seconds not a number"
    if kind in ("fallback", "relax") and not _name(event.get("rung")):
        return f"{kind} without a rung"
    engaged = event.get("engaged", [])
    if kind == "fallback" and not (isinstance(engaged, list) and all(_name(name) for name in engaged)):
        return "engaged not a list of rung names"
    if kind == "progress":
        if not all(_count(figures.get(name)) for name in _DRAWN):
            return "progress without memory figures"
        steps = event.get("steps_by_rung", {})
        if not isinstance(steps, Mapping) or not all(_name(k) and _count(v) for k, v in steps.items()):
            return "steps_by_rung not a mapping of ints"
    return None


def _engaged(plan: object) -> tuple[str, ...]:
    """The rungs in effect in an event's plan (``("none",)`` for a plain one); none where it is not a plan (a log
    from another version, a hand edit: the host figure then counts toward the peak only). A micro-batch size
    counts as split: the event does not say the batch's size."""
    if not isinstance(plan, Mapping):
        return ()
    try:
        return Plan.from_dict(plan).rungs(_ANY_BATCH) or ("none",)
    except (TypeError, ValueError):
        return ()


_ANY_BATCH = 2**62  # (larger than any micro-batch: a plan with one is split)


def _count(value: object) -> bool:
    """A whole number of steps or bytes, as JSON holds it (a bool is not one, though Python says it is an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value: object) -> bool:
    """A duration: JSON lets a writer put NaN or Infinity there, which would turn the table's sums into ``nan``."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _name(value: object) -> bool:
    """A rung's name: a non-empty string (the table sorts names by their first character)."""
    return isinstance(value, str) and value != ""


@dataclass
class Tally:
    """Counts per rung and per kind of event. Call it with an event (it is an event sink) or :meth:`add` one."""

    #: Calls that committed an optimizer step (counted by the guard itself, see :meth:`count_step`).
    steps: int = 0
    #: The highest step any event names, plus one, counted across restarts: how far a log goes.
    logged: int = 0
    runs: int = 1
    ooms: int = 0
    recovered: int = 0
    exhausted: int = 0
    relax_held: int = 0
    relax_failed: int = 0
    retries: int = 0  # OOMs on a plan that ran clean, tried once more on it (see policies.SameAgain)
    #: Fallbacks to each rung.
    engaged: Counter[str] = field(default_factory=Counter)
    #: Seconds lost to out-of-memory errors, by what they led to (a rung, or one of the two cases in brackets).
    seconds_lost: dict[str, float] = field(default_factory=dict)
    capacity: int | None = None
    #: The most host memory the guard held that any event names (``memory.host_allocated`` or ``host_peak``, where
    #: the backend counts it); None when no event names it (CUDA).
    host_peak: int | None = None
    #: The same, per rung in effect in the event's plan (``"none"``: a plain plan).
    host_by_rung: dict[str, int] = field(default_factory=dict)
    _pending: list[float] = field(default_factory=list)  # seconds of OOMs whose consequence is yet to come
    _run_steps: Counter[str] = field(default_factory=Counter)  # steps per rung in this run
    _earlier_steps: Counter[str] = field(default_factory=Counter)  # ... in the runs before it
    _offset: int = 0  # steps of the runs before this one
    _last_step: int = -1

    @property
    def steps_by_rung(self) -> Counter[str]:
        """Steps run with each rung in effect (``"none"``: plain steps), over every run."""
        return self._earlier_steps + self._run_steps

    @property
    def total_seconds_lost(self) -> float:
        return sum(self.seconds_lost.values()) + sum(self._pending)

    def count_step(self, rungs: tuple[str, ...]) -> None:
        """A call committed a step with ``rungs`` in effect."""
        self.steps += 1
        self._run_steps.update(rungs or ("none",))

    def __call__(self, event: Event) -> None:
        self.add(event.to_dict())

    def add(self, event: Mapping[str, Any]) -> int:
        """Count one event, given as its dict (as :meth:`oomguard.Event.to_dict` makes it, or a log line); returns
        its step counted across restarts.

        The event must be well formed: check a log's events with :func:`event_problem` first.
        """
        step = int(event.get("step", 0))
        if step < self._last_step:  # a restarted job appending to the same log
            self._earlier_steps += self._run_steps
            self._run_steps, self._offset, self.runs = Counter(), self._offset + self._last_step + 1, self.runs + 1
        self._last_step = step
        self.logged = max(self.logged, self._offset + step + 1)
        self.capacity = (event.get("memory") or {}).get("capacity", self.capacity)
        self._count_host(event)
        kind = event.get("event")
        if kind == "oom":
            self.ooms += 1
            self._pending.append(float(event.get("seconds", 0.0)))
        elif kind == "fallback":
            for name in event.get("engaged") or (event["rung"],):  # (a jump engages several rungs at once)
                self.engaged[name] += 1
            self._lost(event["rung"])
        elif kind == "relax":
            held = event.get("outcome") == "held"
            self.relax_held += held
            self.relax_failed += not held
            self._lost("(stepping back up)")
        elif kind == "exhausted":
            self.exhausted += 1
            self._lost("(gave up)")
        elif kind == "retry":
            self.retries += 1
            self._lost("(the same plan again)")
        elif kind == "recovered":
            self.recovered += 1
        elif kind == "progress":  # the run's own count so far (a guard's equals what it counted itself)
            self._run_steps = Counter(event.get("steps_by_rung", {}))
        return self._offset + step

    def _count_host(self, event: Mapping[str, Any]) -> None:
        """The host memory ``event`` names, counted toward the peak and toward each rung its plan has in effect."""
        memory = event.get("memory") or {}
        figures = [memory.get(name) for name in _HOST]
        if all(figure is None for figure in figures):
            return
        held = max(figure or 0 for figure in figures)
        self.host_peak = max(self.host_peak or 0, held)
        for name in _engaged(event.get("plan")):
            self.host_by_rung[name] = max(self.host_by_rung.get(name, 0), held)

    def _lost(self, cause: str) -> None:
        self.seconds_lost[cause] = self.seconds_lost.get(cause, 0.0) + sum(self._pending)
        self._pending.clear()

    def rung_names(self) -> list[str]:
        """Every rung named so far: the built-in ones in their order, the others, ``"none"`` (plain steps), then
        the causes in brackets (stepping back up, giving up)."""
        named = list(dict.fromkeys([*self.engaged, *self.steps_by_rung, *self.seconds_lost]))
        custom = [name for name in named if name not in BUILTIN_RUNGS and name != "none" and name[0] != "("]
        causes = [name for name in named if name[0] == "("]
        builtin = [name for name in BUILTIN_RUNGS if name in named]
        return [*builtin, *custom, *(["none"] if "none" in named else []), *causes]

    def summary(self, plan: Plan) -> GuardSummary:
        """A guard's summary, on ``plan``."""
        return GuardSummary(
            steps=self.steps,
            ooms=self.ooms,
            fallbacks=dict(self.engaged),
            recovered_steps=self.recovered,
            exhausted=self.exhausted,
            seconds_lost=self.total_seconds_lost,
            plan=plan,
            relaxations=(self.relax_held, self.relax_failed),
            retries=self.retries,
            steps_by_rung=dict(self.steps_by_rung),
        )
