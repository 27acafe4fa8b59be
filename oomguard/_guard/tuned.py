"""What tuning keeps while it trials plans on a bucket's real steps, and the outcome it reports (see
:mod:`oomguard._guard.foresight`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oomguard._backends.memory import MemorySnapshot
from oomguard._events import TunedEvent
from oomguard._ladder.plan import Plan

__all__ = ["Trials", "Tuned"]


@dataclass
class Trials:
    """A bucket's trials: the settled plan and the alternatives the search found, each timed in turn."""

    settled: Plan
    plans: list[Plan]  # the settled plan first (already warm), then the alternatives
    search: Any  # (foresight's _Search: what the search cost)
    index: int = 0
    calls: int = 0  # calls so far on plans[index]
    times: dict[Plan, list[float]] = field(default_factory=dict)

    @property
    def current(self) -> Plan | None:
        return self.plans[self.index] if self.index < len(self.plans) else None

    def next(self) -> None:
        self.index, self.calls = self.index + 1, 0


@dataclass(frozen=True)
class Tuned:
    """The outcome of tuning a bucket: the plan to keep, every plan's median step time (None: it ran out of
    memory), and what its search cost: seconds, fake steps, and the calls it took."""

    bucket: int
    settled: Plan
    plan: Plan
    timings: tuple[tuple[Plan, float | None], ...]
    planning_seconds: float = 0.0
    fake_steps: int = 0
    search_calls: int = 1

    def event(self, step: int, size: int, memory: MemorySnapshot) -> TunedEvent:
        """The ``tuned`` event that says so, after step ``step`` on a batch of ``size``."""
        timings = ", ".join(
            f"{plan.describe(size)}: {'out of memory' if median is None else f'{median:.3g} s'}"
            for plan, median in self.timings
        )
        return TunedEvent(
            step,
            self.plan.to_dict(),
            memory,
            self.settled.to_dict(),
            tuple((plan.to_dict(), median) for plan, median in self.timings),
            f"{timings}; keeping {self.plan.describe(size)} (searched in {self.planning_seconds:.3g} s, "
            f"{self.fake_steps} fake steps, over {self.search_calls} call(s))",
            round(self.planning_seconds, 3),
            self.fake_steps,
            self.search_calls,
        )
