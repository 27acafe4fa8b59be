"""Buckets: which plan each kind of batch runs on, and how that changes over a long job.

* **Buckets.** Batches are grouped by size (:func:`~oomguard._step.batch.batch_bucket`), and each bucket keeps
  its own plan, so one rare oversized batch escalates only its own bucket while normal batches keep running
  whole. A bucket seen for the first time starts from the plan of the nearest smaller bucket (it needs at least
  as much), resized by the peak model when it has data.
* **Stepping back up.** After ``relax_after`` consecutive clean steps on a degraded plan, the next call tries
  the plan one rung up (:meth:`~oomguard._ladder.ladder.Ladder.relax`) once, or, where the guard can plan, the plan
  the planner puts ahead of it (:mod:`oomguard._guard.stepup`). If it fits, it is kept; if it runs out of memory,
  the same call falls back to the plan that worked and the wait before the next try doubles, so the guard never
  thrashes. Memory freed by another process is reclaimed this way.
* **Predictive sizing** (:class:`~oomguard._ladder.predict.PeakModel`): micro-batch sizes come from measured peaks
  where there are any, instead of halving or doubling blindly.
* **Persistence** (:class:`~oomguard._guard.persist.PlanStore`): every change is written to the state file. A
  save comes after the optimizer step was committed, so it must never raise: a failed save is reported once
  (through ``on_save``, or one warning), the plans stay in memory, and every later call whose bucket is unsaved
  (or that changes a plan) tries again; a save that works after failures is reported too.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from oomguard._backends.memory import MemoryBackend
from oomguard._guard.persist import UNSAVED_ADVICE, PlanStore
from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Plan
from oomguard._ladder.predict import PeakModel
from oomguard._ladder.rungs import RungContext

__all__ = ["Buckets", "Choice", "weakly"]

# After a failed save, the next is tried no sooner than this many seconds later, doubling up to the maximum.
_FIRST_BACKOFF, _MAX_BACKOFF = 1.0, 60.0

logger = logging.getLogger("oomguard")


@dataclass
class _Bucket:
    plan: Plan
    wait: int  # clean steps to wait before the next try at stepping back up
    clean: int = 0  # consecutive clean steps on ``plan``
    saved: bool = False  # whether the state file has this bucket's plan
    fitted: bool = False  # whether a call of this bucket succeeded in this run


@dataclass(frozen=True)
class Choice:
    """The plan for one call, and whether it is a one-off try at stepping back up (a less degraded plan)."""

    bucket: int
    plan: Plan
    fallback: Plan | None = None  # the bucket's plan, to return to if the try at ``plan`` fails
    given_back: str | None = None  # the rung that try gives back
    trial: bool = False  # ``plan`` is timed against the bucket's (tuning), not a try at stepping back up
    #: A try at stepping back up that was due but not made, the host having no room for it: the rung it would
    #: have given back, the plan, and that plan's host bytes (the rungs' estimate).
    held_back: tuple[str, Plan, int] | None = None

    @property
    def relaxing(self) -> bool:
        return self.fallback is not None and not self.trial


class Buckets:
    """Plans per bucket, with stepping back up, predictive sizing and persistence.

    ``on_save`` hears of the state file's health: it is called with the error when a save fails after the last
    one succeeded (or the first save fails), and with ``None`` when a save succeeds after failures. Without it,
    a failure is one warning on the ``oomguard`` logger (the guard passes one that turns them into events,
    whose log line is then the warning).
    """

    def __init__(
        self,
        ladder: Ladder,
        relax_after: int | None,
        predictive: bool,
        grad_bytes: int,
        *,
        on_save: Callable[[OSError | None], None] | None = None,
    ) -> None:
        self.ladder = ladder
        self.relax_after = relax_after
        self.predictor = PeakModel() if predictive else None
        self.grad_bytes = grad_bytes  # what the peak model takes as fixed when it has one point only
        self.default = Plan()
        self.store: PlanStore | None = None
        self.on_save = on_save
        self._save_failing = False  # whether the last save failed (and was reported)
        self._retry_at, self._backoff = 0.0, _FIRST_BACKOFF
        self._buckets: dict[int, _Bucket] = {}

    # -- state ----------------------------------------------------------------------------------------
    def reset(self, plan: Plan) -> None:
        """Make ``plan`` the plan of every bucket (``guard.plan = ...``)."""
        self.default = plan
        self._buckets.clear()

    def fitted(self, bucket: int) -> bool:
        """Whether a call of ``bucket`` succeeded in this run (so its failures are measured, not unknown)."""
        state = self._buckets.get(bucket)
        return state is not None and state.fitted

    def clean_steps(self, bucket: int, plan: Plan) -> int:
        """Consecutive clean steps ``bucket`` has run on ``plan`` (0: another plan is its own)."""
        state = self._buckets.get(bucket)
        return state.clean if state is not None and state.plan == plan else 0

    def plans(self) -> dict[int, Plan]:
        """The current plan of every bucket seen."""
        return {bucket: state.plan for bucket, state in self._buckets.items()}

    def load(self, store: PlanStore, context: RungContext | None = None) -> None:
        """Start from the plans saved in ``store`` (once, when the device is known) that this ladder could have
        come to in ``context`` (what this model, optimizer and device allow: see ``Ladder.beyond``; None: all)."""
        self.store = store
        refuse = None if context is None else functools.partial(self.ladder.beyond, context=context)
        for bucket, plan in store.load(refuse).items():
            self._buckets.setdefault(bucket, _Bucket(plan, self._initial_wait(), saved=True))

    def _initial_wait(self) -> int:
        return self.relax_after if self.relax_after is not None else 0

    def _save(self) -> None:
        """Write every bucket's plan to the state file; never raises (the step before it is committed)."""
        if self.store is None or time.monotonic() < self._retry_at:
            return  # (after a failure, the next tries back off: a full disk or a held lock costs no call much)
        try:
            self.store.save(self.plans())
        except Exception as error:  # OSError in practice; whatever it is, a committed step stays committed
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(2 * self._backoff, _MAX_BACKOFF)
            if not self._save_failing:
                self._save_failing = True
                failure = error if isinstance(error, OSError) else OSError(f"{type(error).__name__}: {error}")
                self._report(failure)
            return  # the buckets stay unsaved: a later call in any of them tries again
        for state in self._buckets.values():
            state.saved = True
        self._backoff = _FIRST_BACKOFF
        if self._save_failing:
            self._save_failing = False
            self._report(None)

    def _report(self, error: OSError | None) -> None:
        """Tell ``on_save`` (or, without one, the ``oomguard`` logger) that saving fails, or works again."""
        if self.on_save is None:
            path = self.store.path if self.store is not None else None
            if error is not None:
                logger.warning("oomguard: cannot save plans to the state file %s (%s): %s", path, error, UNSAVED_ADVICE)
            else:
                logger.info("oomguard: the plans are saved to the state file %s again", path)
            return
        try:
            self.on_save(error)
        except Exception:  # a broken callback must not undo the meaning of a committed step either
            logger.exception("oomguard: the state-file callback %r failed", self.on_save)

    # -- choosing -------------------------------------------------------------------------------------
    def choose(
        self, bucket: int, size: int, backend: MemoryBackend, per_sample: float, context: RungContext | None = None
    ) -> Choice:
        """The plan for a call on a batch of ``size`` samples (``per_sample`` items each) in ``bucket``.

        A step back up that ``context`` (the guard's, with its host budget) says keeps more on the host than the
        budget is not tried (:meth:`Ladder.past_host`, the walk's own test): relaxing can add host memory (larger
        micro-batches under activation offload save more on the host). The bucket keeps its plan and waits twice
        as long, as after a try that failed; the choice says what was held back (``held_back``)."""

        def sizing(plan: Plan) -> int | None:  # the largest micro-batch predicted for plan's configuration
            return self.predict(plan, backend, per_sample)

        state = self._buckets.get(bucket)
        if state is None:
            state = self._buckets[bucket] = _Bucket(self._starting_plan(bucket, size, sizing), self._initial_wait())
        if self.relax_after is None or state.clean < state.wait:
            return Choice(bucket, state.plan)
        relaxed = self.ladder.relax(state.plan, size)
        if relaxed is None:
            return Choice(bucket, state.plan)
        rung, lighter = relaxed
        lighter = self._sized(lighter, size, sizing, grow=True)
        if context is not None and self.ladder.past_host(lighter, context):
            self.wait_longer(bucket)  # (not every call: a later estimate may differ)
            return Choice(bucket, state.plan, held_back=(rung.name, lighter, self.ladder.host_bytes(lighter, context)))
        return Choice(bucket, lighter, fallback=state.plan, given_back=rung.name)

    def _starting_plan(self, bucket: int, size: int, sizing: Callable[[Plan], int | None]) -> Plan:
        smaller = [b for b in self._buckets if b < bucket]
        larger = [b for b in self._buckets if b > bucket]
        if smaller:  # a larger batch needs at least what the nearest smaller one needed
            plan = self._buckets[max(smaller)].plan
        elif larger:  # a smaller batch fits wherever a larger one did; relaxing will find the less degraded plan
            return self._buckets[min(larger)].plan
        else:
            return self.default
        return self._sized(plan, size, sizing, grow=False)

    def _sized(self, plan: Plan, size: int, sizing: Callable[[Plan], int | None], grow: bool) -> Plan:
        """``plan`` with the micro-batch size the peak model predicts (not above ``plan``'s unless ``grow``)."""
        predicted = sizing(plan)
        if predicted is None or (self.ladder.sizing is None and not grow):
            return plan  # (a ladder without micro_batch never splits a batch to make it fit)
        current = plan.effective_micro_batch_size(size)
        target = max(self.ladder.min_micro_batch(size), min(size, predicted))
        if not grow:
            target = min(target, current)
        elif target <= current:
            return plan  # the model sees no room: try the plain step up and let the outcome teach it
        return plan.replace(micro_batch_size=None if target >= size else target)

    # -- predictive sizing ----------------------------------------------------------------------------
    def predict(self, plan: Plan, backend: MemoryBackend, per_sample: float) -> int | None:
        """The largest micro-batch the peak model predicts for ``plan`` on ``backend`` now, if it can tell."""
        capacity = backend.total_memory()
        if self.predictor is None or capacity is None or not backend.tracks_allocations:
            return None
        in_use = backend.memory_allocated()
        return self.predictor.max_micro_batch(plan, capacity, in_use, per_sample, self.grad_bytes)

    def learn_success(self, plan: Plan, items: int, excess: int, backend: MemoryBackend) -> None:
        """A step on ``plan`` with micro-batches of ``items`` peaked ``excess`` bytes above where it began."""
        if self.predictor is not None and backend.tracks_allocations:
            self.predictor.record_success(plan, items, excess)

    def learn_failure(self, plan: Plan, items: int, base: int | None, backend: MemoryBackend) -> None:
        """An attempt on ``plan`` that began with ``base`` bytes in use ran out of memory."""
        capacity = backend.total_memory()
        if self.predictor is not None and capacity is not None and base is not None:
            self.predictor.record_failure(plan, items, capacity, base, self.grad_bytes)

    # -- outcomes -------------------------------------------------------------------------------------
    def succeeded(self, choice: Choice, plan: Plan) -> None:
        """A call finished on ``plan``: the bucket's plan from now on (saved when it changed)."""
        state = self._buckets[choice.bucket]
        state.fitted = True
        if choice.trial:  # a step timed on another plan: the bucket's stays until tuning chooses
            return
        changed = plan != state.plan
        if not changed:
            if not choice.relaxing:  # a call whose try at stepping back up failed is not a clean step
                state.clean += 1
        else:
            state.plan, state.clean = plan, 0
            if not choice.relaxing or plan != choice.plan:  # a fresh degradation: wait the base time again
                state.wait = self._initial_wait()
        if changed or not state.saved:  # a new bucket's first plan is worth remembering too
            self._save()

    def escalated(self, bucket: int, plan: Plan) -> None:
        """``plan`` replaces the bucket's plan outside a call (an OOM in an optimizer step someone else drives)."""
        state = self._buckets[bucket]
        state.plan, state.clean, state.wait = plan, 0, self._initial_wait()
        self._save()

    def tuned(self, bucket: int, plan: Plan) -> None:
        """Tuning found ``plan`` the fastest that fits: the bucket's plan from now on."""
        state = self._buckets[bucket]
        if plan != state.plan:
            state.plan, state.clean = plan, 0
            self._save()

    def relax_failed(self, choice: Choice) -> Plan:
        """A try at stepping back up ran out of memory: back to the bucket's plan, and wait twice as long."""
        state = self._buckets[choice.bucket]
        state.clean = 0
        state.wait = max(1, 2 * state.wait)
        if choice.fallback is None:
            raise ValueError("relax_failed() takes the choice of a try at stepping back up")
        return choice.fallback

    def wait_longer(self, bucket: int) -> None:
        """A step back up that was due is not tried (the host has no room for it, or the planner predicts no plan
        ahead of the bucket's: :mod:`oomguard._guard.stepup`): wait twice as long, as after a try that failed."""
        state = self._buckets[bucket]
        state.clean, state.wait = 0, max(1, 2 * state.wait)

    def next_try_after(self, bucket: int) -> int:
        """Clean steps the bucket still waits before trying to step back up."""
        state = self._buckets[bucket]
        return max(0, state.wait - state.clean)


def weakly(method: Callable[[OSError | None], None]) -> Callable[[OSError | None], None]:
    """``method`` without the reference to its object (a bound method of an object it is stored in would make a
    reference cycle, which only the cyclic garbage collector frees)."""
    weak = weakref.WeakMethod(method)

    def call(error: OSError | None) -> None:
        bound = weak()
        if bound is not None:
            bound(error)

    return call
