"""Stepping back up, planned: where a bucket's due step up goes, by the dry-run planner's measurements of the room
there is now.

After ``relax_after`` clean steps on a degraded plan, :class:`~oomguard._guard.buckets.Buckets` makes the bucket's
next call try the ladder's step back up (:meth:`~oomguard._ladder.ladder.Ladder.relax`: micro-batches twice as
large, or on the whole batch the deepest rung given back). Alone, that climbs one rung per ``relax_after`` steps and
knows neither whether the plan fits nor how fast it runs. Where the guard can plan (``predictive=True``, as for the
jump), :class:`StepUp` asks the planner instead, as the jump does on the way down:

* its answer for this batch in the room there is now (:meth:`~oomguard._guard.foresight.Foresight.planned`: an
  answer recorded for a batch of this shape that holds for this room, or a walk down the ladder from the plain
  plan on fake tensors), beside the ladder's step;
* then one dry run of the bucket's plan and those two: each one's peak, and its time by the default device model
  (:class:`~oomguard._planner.speed.DeviceSpeed`, the one the jump ranks its plans by).

The call tries the plan predicted fastest of those predicted to fit and to run faster than the bucket's plan (or to
change the maths less: mixed precision given back, whatever its speed; never more). For a room the plain step
fits, the walk's answer is the plain plan: memory freed is reclaimed in one step up, not one rung per
``relax_after`` steps. Where no plan is ahead, nothing is tried: the bucket keeps its plan and waits twice as long,
as after a try that ran out of memory. So every step up is predicted ahead of the plan it leaves, and a sequence of
them never comes back to a plan it left (they wandered: from the whole batch with checkpointing and activations
offloaded to micro-batches of 1 with checkpointing, back to the whole batch, and so on, a rung each two periods).
A try that runs out of memory all the same falls back as any does
(:class:`~oomguard._guard.policies.FailedStepUp`).

Where the planner cannot tell (a step it cannot run on fake tensors, an FSDP2 model, a CPU without the simulator),
the ladder's step is tried, as without it; under torch.distributed too, where each rank's dry run may answer
differently and every rank must try the same plan (the ladder's step is the same on every rank). The dry runs cost
what the jump's do, at most once per ``relax_after`` clean steps, and less often each time no plan was ahead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from oomguard._backends.memory import MemoryBackend
from oomguard._guard.buckets import Buckets, Choice
from oomguard._guard.foresight import Foresight
from oomguard._ladder.plan import Plan
from oomguard._planner.fakes import preplan
from oomguard._planner.report import Candidate

__all__ = ["StepUp"]

logger = logging.getLogger("oomguard")


@dataclass(frozen=True)
class StepUp:
    """The plan a due step up tries (see the module)."""

    foresight: Foresight
    buckets: Buckets

    def __call__(self, choice: Choice, batch: Any, size: int, backend: MemoryBackend) -> Choice:
        """``choice``, the bucket's (:meth:`Buckets.choose`); or, where it is a step up the planner can plan, a try
        at the plan the planner puts furthest ahead of the bucket's, or no try (the bucket waits twice as long)."""
        foresight, bucket_plan = self.foresight, choice.fallback
        distributed = foresight.agreement is not None
        if not choice.relaxing or bucket_plan is None or not foresight.options.predictive or distributed:
            return choice
        current = _whole(bucket_plan, size)
        planned = foresight.planned(batch, backend, "step up")
        steps = [_whole(plan, size) for plan in (planned.plan, choice.plan) if plan is not None]
        steps = [plan for plan in dict.fromkeys(steps) if plan != current]
        measured = self._measured([current, *steps], batch, backend) if steps else None
        here = None if measured is None else measured.get(current)
        if measured is None or here is None:  # the planner cannot tell (a failed dry run is logged): the ladder's step
            return choice
        ahead = [c for plan in steps if (c := measured.get(plan)) and c.fits and self._ahead(c, here, size)]
        if not ahead:
            self.buckets.wait_longer(choice.bucket)
            logger.info(
                "oomguard: not stepping back up from %s: no plan predicted to fit is ahead of it (the planner's "
                "answer for the memory free now: %s); next try in %d steps",
                current.describe(size),
                "nothing fits" if planned.plan is None else planned.plan.describe(size),
                self.buckets.next_try_after(choice.bucket),
            )
            return Choice(choice.bucket, bucket_plan)
        best = min(
            ahead, key=lambda c: (self._inexact(c.plan, size), c.predicted_seconds, self._depth(c.plan, size))
        ).plan
        changed = foresight.ladder.changed(current, best, size)  # (the deepest rung given back names the try)
        return Choice(choice.bucket, best, bucket_plan, changed[-1] if changed else choice.given_back)

    def _measured(self, plans: list[Plan], batch: Any, backend: MemoryBackend) -> dict[Plan, Candidate] | None:
        """Each of ``plans`` measured by one dry run (None where the planner cannot tell)."""
        foresight = self.foresight
        report = preplan(
            foresight.step_fn, batch, foresight.options, backend, bf16=foresight.bf16, purpose="step up",
            plans=plans, effects=foresight.effects, host_budget=foresight.host_budget,
        )  # fmt: skip
        return None if report is None else {candidate.plan: candidate for candidate in report.candidates}

    def _ahead(self, candidate: Candidate, here: Candidate, size: int) -> bool:
        """Whether ``candidate`` is ahead of ``here``: fewer levels of the rungs that change the maths (mixed
        precision, quantization); or as many, and less predicted time; or as much (a rung the time model sees no
        cost in: a custom one), and no rung deeper, one less deep."""
        inexact, there = self._inexact(candidate.plan, size), self._inexact(here.plan, size)
        if inexact != there:
            return inexact < there
        if candidate.predicted_seconds != here.predicted_seconds:
            return candidate.predicted_seconds < here.predicted_seconds
        ladder = self.foresight.ladder
        levels = list(zip(ladder.levels(candidate.plan, size), ladder.levels(here.plan, size), strict=True))
        return all(mine <= theirs for mine, theirs in levels) and any(mine < theirs for mine, theirs in levels)

    def _inexact(self, plan: Plan, size: int) -> int:
        """The levels of ``plan``'s rungs that change the maths."""
        return sum(rung.level(plan, size) for rung in self.foresight.ladder.known if not rung.exact)

    def _depth(self, plan: Plan, size: int) -> int:
        """The levels of ``plan``'s rungs but micro-batching."""
        return sum(self.foresight.ladder.levels(plan, size)[1:])


def _whole(plan: Plan, size: int) -> Plan:
    """``plan`` as the planner writes it: micro-batches as large as the batch are the whole batch."""
    return plan.replace(micro_batch_size=None) if plan.micro_batches(size) == 1 else plan
