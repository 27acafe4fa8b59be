"""What the dry-run planner and a stopwatch tell the guard: where to jump after a first OOM, and which fitting
plan runs fastest.

* **The jump.** On the first OOM of a batch bucket that never fitted, the planner runs the failing batch on fake
  tensors and the guard jumps to the plan it recommends, instead of walking the ladder one rung per OOM.
* **Recorded answers.** The jump and preplan take an answer the guard recorded for a batch of the same shape
  (in this process, or in the state file by an earlier run) where it holds for the room there is now, instead of
  a new dry run (:mod:`oomguard._guard.answers`); their events count the fake steps each ran (0 then).
* **Tuning.** The ladder stops at the first plan that fits, not the fastest: on one device micro-batches of 1 in
  bf16 may be the slowest plan that fits, on another the fastest. Once a bucket has run ``tune_after`` clean
  steps on the plan it fell back to, the planner searches every configuration of the rungs
  (:mod:`oomguard._planner.search`) with this device's speed measured (:func:`~oomguard._planner.speed.measure_speed`);
  the guard then runs the next steps on the :data:`TRIALS` fitting plans it predicts fastest, one warm-up step
  and :data:`TIMED` timed steps each, and keeps the fastest it measured, the settled plan included. The search
  takes at most :data:`SEARCH_STEPS` of the bucket's steady steps' time in one call (and at least
  :data:`MIN_SEARCH_SECONDS`), stopping between two fake steps of a measurement where need be; a search that
  needs longer goes on in later calls, whose steps run on the
  settled plan meanwhile (as many of them between two that search as keep its time within :data:`SEARCH_SHARE`
  of theirs), and finds what it would have found in one (see
  :class:`~oomguard._planner.search.SearchBudget`). Every trial
  is a whole training step on the user's batch: no sample is lost or doubled, and the maths is each rung's
  own. A trial that runs out of memory is dropped and its step retried on the settled plan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard._backends.memory import MemoryBackend, snapshot
from oomguard._backends.units import format_bytes
from oomguard._distributed.agreement import Agreement
from oomguard._effects.effects import Effects
from oomguard._events import PlannedEvent, logger
from oomguard._guard.answers import Answers, batch_signature
from oomguard._guard.buckets import Buckets, Choice
from oomguard._guard.call import Call
from oomguard._guard.persist import PlanStore
from oomguard._guard.recovery import Failure
from oomguard._guard.tuned import Trials, Tuned
from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Phase, Plan
from oomguard._options import GuardOptions
from oomguard._planner.compose import Traces
from oomguard._planner.fakes import memory_was_short, planning_capacity, preplan
from oomguard._planner.report import Candidate, PlanReport
from oomguard._planner.speed import DeviceSpeed, measure_speed
from oomguard._step.batch import batch_size

__all__ = [
    "MIN_SEARCH_SECONDS",
    "SEARCH_SHARE",
    "SEARCH_STEPS",
    "TIMED",
    "TRIALS",
    "Foresight",
    "Jumped",
    "Planned",
    "Tuned",
]

#: Alternatives to the settled plan timed on real steps, and timed steps on each (after one warm-up step).
TRIALS, TIMED = 3, 2
#: Tuning's search spends at most this many of the bucket's steady steps (their median time) in one call, and
#: never less than :data:`MIN_SEARCH_SECONDS`: a call that searches takes about two steps' time (or its first fake
#: step's, which always runs: a composed measurement's steps are run over as many calls as it takes), not a frozen
#: minute.
SEARCH_STEPS, MIN_SEARCH_SECONDS = 1, 0.25
#: A search that takes more than one call searches in a later call only while the time it has spent is at most
#: this share of the time the bucket's steps have taken since it began: where a fake step takes several of the
#: model's steps (a small model under a simulated device: 0.6-0.7 s against 0.16 s), the calls between train on the
#: settled plan alone, and the search costs at most about a third of the job's time while it lasts.
SEARCH_SHARE = 0.5


@dataclass
class _Search:
    """Tuning's search around the plan a bucket settled on, over as many calls as its time budget makes it take."""

    settled: Plan
    size: int
    speed: DeviceSpeed
    known: dict[Plan, Candidate] = field(default_factory=dict)
    #: The shallow steps of composed measurements (SearchBudget), of batches of one shape (``signature``): a plan is
    #: composed from steps of one batch, and a bucket's batches may differ in shape.
    traces: Traces = field(default_factory=dict)
    signature: str = ""
    seconds: float = 0.0
    fake_steps: int = 0
    calls: int = 0
    since: int = 0  # the bucket's steady steps timed before it began

    def due(self, steady: list[float]) -> bool:
        """Whether this call may search: the first always does; a later one where the search has spent at most
        :data:`SEARCH_SHARE` of the time of the bucket's steps (``steady``) since it began."""
        return not self.calls or self.seconds <= SEARCH_SHARE * sum(steady[self.since :])


@dataclass(frozen=True)
class Planned:
    """The planner's answer for a batch (``plan``: None where it recommends none or cannot tell), whether it was a
    recorded one (:mod:`oomguard._guard.answers`), and what finding it cost."""

    plan: Plan | None
    recorded: bool
    seconds: float
    fake_steps: int
    report: PlanReport | None = None  # (None: a recorded answer, or a step the planner cannot plan)


@dataclass(frozen=True)
class Jumped:
    """A jump's answer: the plan to jump to and the rungs it engages (None and empty: the planner knows no
    better than the walk), what its dry run cost, and whether it was a recorded answer (no dry run)."""

    plan: Plan | None
    engaged: tuple[str, ...]
    seconds: float
    fake_steps: int
    recorded: bool = False  # an answer recorded for a batch of the same shape: no dry run


class Foresight:
    """The guard's jump and tuning (see the module); it changes no plan itself, it tells the guard which."""

    def __init__(
        self,
        step_fn: Callable[[Any], Any],
        options: GuardOptions,
        buckets: Buckets,
        effects: Effects,
        bf16: bool,
        device: torch.device,
    ) -> None:
        self.step_fn, self.options, self.buckets, self.effects = step_fn, options, buckets, effects
        self.bf16, self.device = bf16, device
        self.ladder: Ladder = options.rungs
        self._due: dict[int, int] = {}  # bucket -> clean steps since it settled after an OOM
        self._steady: dict[int, list[float]] = {}  # bucket -> those steps' seconds
        self._searches: dict[int, _Search] = {}  # bucket -> its search, where it takes more than one call
        self._tuning: dict[int, Trials] = {}
        #: The guard's host budget (set at its first call): the planner's plans past it do not fit.
        self.host_budget: int | None = None
        self.answers = Answers(options, bf16)
        #: The ranks' agreement of a distributed job (set at the guard's first call): each rank plans its own
        #: share of the batch and the ranks agree on a jump's plan; rank 0 alone searches tuning's trials.
        self.agreement: Agreement | None = None

    def reset(self) -> None:
        """Forget every bucket (a plan assigned by hand)."""
        self._due.clear()
        self._steady.clear()
        self._searches.clear()
        self._tuning.clear()

    def start(self, prefix: str, store: PlanStore | None) -> None:
        """At the guard's first call: the model and device the answers are for (``prefix``, as the state file's
        keys begin), and the state file's ``store``, whose recorded answers are taken and kept."""
        self.answers.start(prefix, store)

    def _dry_run(self, batch: Any, backend: MemoryBackend, **planning: Any) -> PlanReport | None:
        """:func:`~oomguard._planner.fakes.preplan` of the guard's step on ``batch``, with the guard's effects,
        bf16 support and host budget."""
        return preplan(
            self.step_fn, batch, self.options, backend, bf16=self.bf16, effects=self.effects,
            host_budget=self.host_budget, **planning,
        )  # fmt: skip

    def planned(
        self, batch: Any, backend: MemoryBackend, purpose: str, failed: tuple[Plan, Phase] | None = None
    ) -> Planned:
        """The planner's answer for ``batch``: a recorded one that holds for the room there is now, or a dry
        run's (recorded for the next batch of this shape; ``failed``: the plan the batch ran out of memory on, and
        the phase, which the walk starts past)."""
        recorded = self.answers.get(batch, planning_capacity(self.options, backend), self.host_budget)
        if recorded is not None:
            return Planned(recorded.plan, True, 0.0, 0)
        started = time.perf_counter()
        report = self._dry_run(batch, backend, purpose=purpose, failed=failed)
        seconds = time.perf_counter() - started
        if report is None:  # (logged: a step the planner cannot run, fakes that escaped, no device to plan for)
            return Planned(None, False, seconds, 0)
        self.answers.put(batch, report)
        return Planned(report.recommended, False, seconds, report.fake_steps, report)

    def preplan(
        self, batch: Any, backend: MemoryBackend, step: int, remembered: dict[int, Plan]
    ) -> tuple[Plan | None, PlannedEvent]:
        """``preplan=True`` at the first call: the plan to start every bucket on (None: leave the buckets as they
        are), and the ``planned`` event that says so. No dry run where the state file ``remembered`` plans (a
        remembered plan beats a predicted one)."""
        size, memory = batch_size(batch), snapshot(backend)
        if remembered:
            own = remembered.get(self.options.bucket(batch))
            start = "" if own is None else f"; this batch's bucket starts on {own.describe(size)}"
            description = f"no dry run: the state file remembers plans for {len(remembered)} bucket(s){start}"
            event = PlannedEvent(step, (own or Plan()).to_dict(), memory, False, "state_file", description)
            return None, event
        planned = self.planned(batch, backend, "preplan")
        plan, report = planned.plan, planned.report
        if plan is None:
            seen = "a recorded answer" if planned.recorded else "see the log"
            description = f"no plan recommended ({seen}); starting on the default plan"
        else:
            description = f"starting on {plan.describe(size)}"
        if report is not None and plan is not None:
            needs = format_bytes(report.predicted_peak_bytes + report.device_overhead_bytes)
            description += f" (predicted peak {needs} of {format_bytes(report.capacity_bytes)} available)"
        cost = (
            "a recorded answer for a batch of this shape"
            if planned.recorded
            else f"planned in {planned.seconds:.3g} s, {planned.fake_steps} fake steps"
        )
        skipped = "recorded" if planned.recorded else None
        event = PlannedEvent(
            step, (plan or Plan()).to_dict(), memory, plan is not None, skipped, f"{description}; {cost}",
            round(planned.seconds, 3), planned.fake_steps,
        )  # fmt: skip
        return plan, event

    # -- the jump ---------------------------------------------------------------------------------------
    def jump(self, call: Call, failure: Failure, distributed: bool) -> Jumped | None:
        """On the first OOM of a bucket that never fitted: the plan the dry-run planner predicts fits this batch,
        and the rungs it engages (None: no dry run; walk the ladder, as after any other OOM)."""
        if not (
            self.options.predictive
            and len(call.tried) == 1
            and call.batch is not None
            and call.choice.fallback is None
            and not self.buckets.fitted(call.choice.bucket)
            # (every rank decides alike: another rank's message says nothing of this rank's memory)
            and (distributed or memory_was_short(failure.summary.message, self.device))
        ):
            return None
        failed = (failure.plan, failure.agreed_phase or failure.summary.phase)  # (as the guard's walk goes on)
        planned = self.planned(call.batch, call.backend, "jump", failed)
        plan = planned.plan
        engaged = () if plan is None else self.ladder.changed(failure.plan, plan, call.size)
        if not engaged:  # (it knows no better)
            plan = None
        return Jumped(plan, engaged, planned.seconds, planned.fake_steps, planned.recorded)

    # -- tuning -----------------------------------------------------------------------------------------
    def choose(self, choice: Choice, batch: Any, size: int, backend: MemoryBackend) -> Choice:
        """The plan a full step of ``choice``'s bucket runs on: a trial's while the bucket is being tuned."""
        bucket = choice.bucket
        tuning = self._tuning.get(bucket)
        due = tuning is None and self._due.get(bucket, -1) >= (self.options.tune_after or 0) and not choice.relaxing
        if self.agreement is not None and self.options.tune_after is not None:
            due = not self.agreement.any(not due)  # every rank at once or none (the ranks' buckets may differ)
        if due:
            found = self._trials(bucket, batch, choice.plan, size, backend)
            if found is not None:  # (None: the search goes on in a later call; this one runs the settled plan)
                search, alternatives = found
                del self._due[bucket]
                self._searches.pop(bucket, None)
                if alternatives:
                    tuning = self._tuning[bucket] = Trials(choice.plan, [choice.plan, *alternatives], search)
        if tuning is None or tuning.current is None or tuning.current == tuning.settled:
            return choice
        return Choice(bucket, tuning.current, fallback=tuning.settled, trial=True)

    def settled(self, bucket: int) -> None:
        """A step of ``bucket`` succeeded after an OOM on a plan of its own: tune once it has run clean steps."""
        if self.options.tune_after is not None:
            self._due[bucket], self._steady[bucket] = 0, []
            self._tuning.pop(bucket, None)
            self._searches.pop(bucket, None)

    def trial_failed(self, choice: Choice) -> Plan:
        """A trial ran out of memory: it is dropped; the plan to retry its step on."""
        tuning = self._tuning[choice.bucket]
        tuning.times[choice.plan] = []
        tuning.next()
        return tuning.settled

    def timed(self, choice: Choice, plan: Plan, clean: bool, seconds: float) -> Tuned | None:
        """A full step of ``choice``'s bucket took ``seconds`` on ``plan`` (``clean``: with no OOM); the outcome
        once the bucket's tuning is complete."""
        bucket = choice.bucket
        if bucket in self._due and clean and plan == choice.plan:
            self._due[bucket] += 1
            self._steady.setdefault(bucket, []).append(seconds)
        tuning = self._tuning.get(bucket)
        if tuning is None:
            return None
        if tuning.current == plan and clean:
            tuning.calls += 1
            if tuning.index == 0 or tuning.calls > 1:  # a trial's first step warms it up (its effects applied)
                tuning.times.setdefault(plan, []).append(seconds)
            if len(tuning.times.get(plan, ())) >= TIMED:
                tuning.next()
        if tuning.current is not None:
            return None
        del self._tuning[bucket]
        timings = tuple((p, statistics.median(t) if t else None) for p, t in tuning.times.items())
        measured = [(seconds, p) for p, seconds in timings if seconds is not None]
        best = min(measured, key=lambda item: item[0])[1] if measured else tuning.settled
        search = tuning.search
        return Tuned(bucket, tuning.settled, best, timings, search.seconds, search.fake_steps, search.calls)

    def _trials(
        self, bucket: int, batch: Any, settled: Plan, size: int, backend: MemoryBackend
    ) -> tuple[_Search, list[Plan]] | None:
        """:meth:`_alternatives`; in a distributed job, rank 0's, on every rank (where the search takes more than
        one call, every rank waits for rank 0's to end)."""
        agreement = self.agreement
        if agreement is None:
            return self._alternatives(bucket, batch, settled, size, backend)
        found = self._alternatives(bucket, batch, settled, size, backend) if agreement.rank == 0 else None
        shared = agreement.plans_of_rank0(None if found is None else found[1], settled, size, self.ladder)
        if shared is None:
            return None
        return (_Search(settled, size, DeviceSpeed()) if found is None else found[0]), shared

    def _alternatives(
        self, bucket: int, batch: Any, settled: Plan, size: int, backend: MemoryBackend
    ) -> tuple[_Search, list[Plan]] | None:
        """The fitting plans the planner predicts fastest on this device, other than ``settled``, and the search
        that found them; None where the search has not finished in this call's time (see the module)."""
        search = self._searches.get(bucket)
        if search is None or search.settled != settled or search.size != size:
            try:
                speed = measure_speed(self.device, backend)
            except Exception as error:  # (an OOM on a full CUDA device, say): the plan stays, untimed
                logger.warning("tuning: cannot measure this device's speed (%s: %s)", type(error).__name__, error)
                return _Search(settled, size, DeviceSpeed()), []
            search = self._searches[bucket] = _Search(settled, size, speed, since=len(self._steady.get(bucket, ())))
        steady = self._steady.get(bucket) or [0.0]
        if not search.due(steady):
            return None  # (it has had its share of the time: this call trains on the settled plan alone)
        if search.signature != (signature := batch_signature(batch)):
            search.signature, search.traces = signature, {}
        report = self._dry_run(
            batch,
            backend,
            purpose="tuning",
            search_around=settled,
            speed=search.speed,
            search_seconds=max(MIN_SEARCH_SECONDS, SEARCH_STEPS * statistics.median(steady)),
            known=search.known,
            traces=search.traces,
        )
        if report is None:
            return search, []
        search.seconds, search.fake_steps, search.calls = (
            search.seconds + report.seconds, search.fake_steps + report.fake_steps, search.calls + 1
        )  # fmt: skip
        if not report.complete:
            logger.info(
                "tuning: the search goes on in a later call (%d plans measured in %.3g s so far)",
                len(search.known),
                search.seconds,
            )
            return None
        fitting = sorted((c for c in report.candidates if c.fits), key=lambda c: c.predicted_seconds)
        chosen = [settled]  # the fastest plan of each configuration (of the settled one: a larger micro-batch)
        for candidate in fitting:
            plan = candidate.plan
            taken = [p for p in chosen if p.replace(micro_batch_size=None) == plan.replace(micro_batch_size=None)]
            larger = plan.effective_micro_batch_size(size) > settled.effective_micro_batch_size(size)
            if not taken or (taken == [settled] and larger):
                chosen.append(plan.replace(micro_batch_size=None) if plan.micro_batches(size) == 1 else plan)
        return search, chosen[1 : TRIALS + 1]
