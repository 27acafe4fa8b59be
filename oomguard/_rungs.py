"""Rungs of the fallback ladder: each takes a plan and returns a cheaper one, or None when it has no more to give.

Rungs are pure: they only compute plans. What a plan does to torch state lives in the step runner.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from oomguard._errors import GuardConfigError
from oomguard._plan import Plan

__all__ = ["DEFAULT_LADDER", "Ladder", "MicroBatch", "Rung", "RungContext", "resolve_ladder"]


@dataclass(frozen=True)
class RungContext:
    """What a rung may look at when it picks the next plan."""

    batch_size: int


@runtime_checkable
class Rung(Protocol):
    """One step down the ladder. ``name`` appears in events and in ``StepResult.rungs``."""

    @property
    def name(self) -> str: ...

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        """A plan that needs less memory than ``plan``, or None if this rung has nothing more to give."""
        ...


@dataclass(frozen=True)
class MicroBatch:
    """Halve the micro-batch size: 2, 4, 8 ... micro-batches with exact gradient accumulation.

    Stops at ``min_size`` samples per micro-batch (1 by default). An uneven last micro-batch is fine.
    """

    min_size: int = 1
    name: str = "micro_batch"

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        current = plan.effective_micro_batch_size(context.batch_size)
        if current <= self.min_size:
            return None
        return plan.replace(micro_batch_size=max(self.min_size, -(-current // 2)))


_BUILTIN: dict[str, type[MicroBatch]] = {"micro_batch": MicroBatch}
DEFAULT_LADDER: tuple[str, ...] = ("micro_batch",)


class Ladder:
    """An ordered sequence of rungs; :meth:`next` finds the first rung that can still give something."""

    def __init__(self, rungs: Sequence[Rung]) -> None:
        self.rungs = tuple(rungs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(rung.name for rung in self.rungs)

    def next(self, plan: Plan, context: RungContext) -> tuple[Rung, Plan] | None:
        """The rung to engage after ``plan`` failed, and the plan it gives; None when the ladder is exhausted."""
        for rung in self.rungs:
            cheaper = rung.escalate(plan, context)
            if cheaper is not None and cheaper != plan:
                return rung, cheaper
        return None


def resolve_ladder(spec: Iterable[str | Rung] | None) -> Ladder:
    """Build a ladder from rung names and rung objects; ``None`` gives the default order.

    >>> resolve_ladder(["micro_batch"]).names
    ('micro_batch',)
    """
    if spec is None:
        spec = DEFAULT_LADDER
    if isinstance(spec, str):
        raise GuardConfigError(f"ladder= takes a list of rung names, not a string: write ladder=[{spec!r}]")
    rungs: list[Rung] = []
    for item in spec:
        if isinstance(item, str):
            factory = _BUILTIN.get(item)
            if factory is None:
                raise GuardConfigError(
                    f"unknown rung {item!r} in ladder=; the rungs are: {', '.join(sorted(_BUILTIN))} "
                    f"(or pass an object with a name and an escalate(plan, context) method)"
                )
            rungs.append(factory())
        elif isinstance(item, Rung):
            rungs.append(item)
        else:
            raise GuardConfigError(
                f"ladder= entries must be rung names or rung objects, got {type(item).__name__}: {item!r}"
            )
    names = [rung.name for rung in rungs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise GuardConfigError(f"ladder= names the rung(s) {duplicates} more than once; list each rung once")
    return Ladder(rungs)
