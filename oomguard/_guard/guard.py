"""The guard: run a training step, and on an out-of-memory error free memory and retry one rung down.

:meth:`OOMGuard._recover` is the recovery loop, and the only one: the decorated call, the Trainer's forward and
backward, and the Trainer's own optimizer step all go through it. Which plan a call starts from (per batch
bucket, stepping back up after clean steps, sized by measured peaks, remembered across restarts) is the
buckets' business (:mod:`oomguard._guard.buckets`); what the events add up to is the tally's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from oomguard._backends.accounting import AccountedDevice
from oomguard._backends.memory import MemoryBackend, MemorySnapshot, current_backend, snapshot
from oomguard._detect import is_oom, names_an_allocator
from oomguard._distributed.agreement import Agreement, distributed_active, unwrap
from oomguard._errors import GuardConfigError, LadderExhausted, OOMGuardError, RecoveryLimitExceeded
from oomguard._events import (
    Event,
    EventSink,
    ExhaustedEvent,
    FailureSummary,
    FallbackEvent,
    JsonlSink,
    OOMEvent,
    ProgressEvent,
    RecoveredEvent,
    StateFileEvent,
    log_event,
    logger,
)
from oomguard._guard.attempts import Attempt, OneCallAtATime, Run, Tail, undoable
from oomguard._guard.buckets import Buckets, Choice, weakly
from oomguard._guard.foresight import Foresight
from oomguard._guard.persist import UNSAVED_ADVICE, PlanStore, model_fingerprint
from oomguard._guard.recovery import (
    Bounds,
    Call,
    Failure,
    GiveUp,
    device_telemetry,
    free_failed_attempt,
    give_up_message,
    relax_event,
    released,
)
from oomguard._guard.results import GuardSummary, StepResult
from oomguard._guard.tally import Tally
from oomguard._ladder.plan import Phase, Plan
from oomguard._ladder.rungs import RungContext
from oomguard._options import GuardOptions, build_runner, model_context, takes_options
from oomguard._planner.fakes import preplan
from oomguard._step.batch import batch_size, items_per_sample
from oomguard._step.runner import AttemptOutput, Reduction

__all__ = ["OOMGuard"]

_EVENTS_KEPT = 10_000  # in memory; the log file keeps everything
T = TypeVar("T")


class OOMGuard:
    """Runs a training step and keeps it alive through out-of-memory errors.

    Use it through :func:`oomguard.oom_guard`; the decorated function's ``.guard`` is this object. It takes the
    same options (see that function).
    """

    @takes_options(GuardOptions)
    def __init__(self, step_fn: Callable[[Any], Any], **options: Any) -> None:
        self.options = GuardOptions(**options)
        self.model, self.optimizer, self.scheduler = self.options.model, self.options.optimizer, self.options.scheduler
        self.ladder = self.options.rungs
        self._step_fn = step_fn
        self._runner = build_runner(step_fn, self.options)
        self.effects, self.transaction = self._runner.effects, self._runner.transaction
        self._context = model_context(self._runner)
        self._device = next(self.model.parameters()).device
        self._buckets = Buckets(
            self.ladder, self.options.relax_after, self.options.predictive, self._runner.grad_bytes,
            on_save=weakly(self._state_file_saved),  # weakly: the guard must die (and undo its effects) when dropped
        )  # fmt: skip
        self._foresight = Foresight(step_fn, self.options, self._buckets, self.effects,
                                    self._context.bf16_supported, self._device)  # fmt: skip
        self._bounds = Bounds(self.options.max_attempts, self.options.max_recovery_seconds)
        self._tally = Tally()
        self._events: collections.deque[Event] = collections.deque(maxlen=_EVENTS_KEPT)
        self._sinks: list[EventSink] = [self._tally, *self.options.sinks]
        self._started = False
        self._busy = OneCallAtATime()
        self._last: Call | None = None  # the last call that succeeded, without its batch
        self._last_plan = Plan()
        self._plan_rung: str | None = None  # the rung engaged last, named in OOM events
        self._replaying: Call | None = None  # the step whose gradients a call recomputes (see protected_step)
        # A guard that is dropped undoes what its plan did to the model, as close() does (not at exit).
        weakref.finalize(self, self.effects.undo, logged=True).atexit = False

    # -- public state -----------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan of the last call (its batch bucket's plan). Assign a :class:`Plan` to start every bucket on it."""
        return self._last_plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        if not isinstance(plan, Plan):
            raise GuardConfigError(f"guard.plan takes an oomguard.Plan, got {type(plan).__name__}")
        self._buckets.reset(plan)
        self._foresight.reset()
        self._last_plan, self._plan_rung = plan, None

    @property
    def plans(self) -> dict[int, Plan]:
        """The plan of every batch bucket seen so far (and those loaded from the state file)."""
        return self._buckets.plans()

    @property
    def steps(self) -> int:
        """Successful calls so far (each one optimizer step)."""
        return self._tally.steps

    @property
    def events(self) -> list[Event]:
        """Events so far (the most recent 10,000; the log file keeps all)."""
        return list(self._events)

    def close(self) -> None:
        """Undo every effect of the current plan (checkpointing off, offloaded tensors back on the device); the
        guard stays usable: the next call re-applies its plan."""
        self.effects.close()

    def summary(self) -> GuardSummary:
        """Which fallbacks were needed and how often."""
        return self._tally.summary(self._last_plan)

    # -- calls ------------------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> StepResult:
        """Train on ``batch``: one optimizer step, however many attempts and micro-batches it takes."""
        return self._call(batch, step=True)

    def accumulate(self, batch: Any, reduction: Reduction | None = None) -> StepResult:
        """Forward and backward of ``batch`` only, recovered like a call: the gradients are left for the caller
        to step with (through :meth:`protected_step`). ``reduction`` overrides the guard's for this batch."""
        return self._call(batch, step=False, reduction=reduction)

    def protected_step(self, run: Callable[[], T], replay: Callable[[], None], *, phase: Phase = Phase.OPTIMIZER) -> T:
        """A part of the last call's step that someone else drives after it (the Trainer's clipping and optimizer
        step), recovered as part of that step; returns what ``run`` returns.

        ``run`` does the part (an optimizer step, with ``phase`` :attr:`Phase.OPTIMIZER`, is made undoable by the
        guard's transaction). On an OOM the guard frees what it held and moves one rung down for ``phase``;
        ``replay`` recomputes the batch's gradients on the new plan (through :meth:`accumulate`: a retry of the same
        step, not a new one), and ``run`` runs again: still exactly one step, counted once, recovered."""
        last, backend = self._last, current_backend(self._device)
        part = undoable(self.transaction, backend, run, self.effects, self) if phase == Phase.OPTIMIZER else run
        with self._busy:
            try:
                if last is None:  # no guarded call yet: no batch to replay on a cheaper plan
                    return part()
                call = Call(None, last.size, backend, Choice(last.choice.bucket, self._last_plan), self._last_plan,
                            last.items_per_sample, last.step)  # fmt: skip
                result = self._recover(call, Tail(call, part, functools.partial(self._replay, call, replay), phase))
                if call.tried:
                    self._recovered(call, self._last_plan)
                return result
            finally:
                self.transaction.interrupts.deliver()

    def _replay(self, call: Call, replay: Callable[[], None], plan: Plan) -> Plan:
        """``replay`` of the batch of ``call``'s step on ``plan``, a retry of that step; the plan it settled on."""
        self._buckets.escalated(call.choice.bucket, plan)
        self._replaying = call
        try:
            replay()
        finally:
            self._replaying = None
        return self._last_plan

    def _call(self, batch: Any, *, step: bool, reduction: Reduction | None = None) -> StepResult:
        with self._busy:
            try:
                return self._guarded(batch, step=step, reduction=reduction)
            finally:  # a shutdown signal held during the optimizer step, acted on once the step is counted
                self.transaction.interrupts.deliver()

    def _guarded(self, batch: Any, *, step: bool, reduction: Reduction | None) -> StepResult:
        size = batch_size(batch)  # raises BatchSplitError for a batch that could never be split
        backend = current_backend(self._device)
        self._start(backend, batch, size)
        per_sample = items_per_sample(batch, size)
        choice = self._buckets.choose(self.options.bucket(batch), size, backend, per_sample)
        agreement = self._runner.agreement
        if agreement is not None:  # every rank starts the call on the same plan
            agreed = agreement.plan(choice.plan, size, self.ladder)
            if agreed != choice.plan:
                choice = Choice(choice.bucket, agreed)
        elif step and self._replaying is None:  # a full step may be a trial of another plan (tuning)
            choice = self._foresight.choose(choice, batch, size, backend)
        step_number = self.steps if self._replaying is None else self._replaying.step
        call = Call(batch, size, backend, choice, choice.plan, per_sample, step_number)
        started = time.perf_counter()
        output = self._recover(call, Run(self._runner, call, step=step, reduction=reduction))
        timed = step and agreement is None  # (tuning times whole steps; not where ranks would time differently)
        with self.transaction.interrupts.held():  # (delivered by _call once the step is counted)
            return self._succeed(call, output, time.perf_counter() - started if timed else None)

    # -- the recovery loop ------------------------------------------------------------------------------
    def _recover(self, call: Call, attempt: Attempt[T]) -> T:
        """Run ``attempt`` on the call's plan until it succeeds; each out-of-memory error frees what the attempt
        held, is recorded, and moves the call to the next plan, or ends it (LadderExhausted, RecoveryLimitExceeded).
        """
        while True:
            started = time.perf_counter()
            try:
                return attempt(call.plan)
            except Exception as exc:
                if isinstance(exc, OOMGuardError) or not is_oom(exc):  # ours may wrap an OOM: never retry them
                    raise
                summary = FailureSummary.from_exception(exc, attempt.phase, attempt.micro_batch, snapshot(call.backend))
                repeated = bool(call.tried) and call.tried[-1][1].same_error(summary)
                if repeated and not names_an_allocator(exc) and attempt.agreement is None:
                    raise  # the same words again on a cheaper plan, and no allocator said them: not memory
                    # (not under torch.distributed: the ranks agreed this was an OOM and all retry together)
                # Keep a summary and the error without its frames: leaving this block drops the traceback and the
                # frames of the failed forward and backward, and with them the autograd graph.
                error = released(exc)
            failure = Failure(call.plan, summary, time.perf_counter() - started, attempt.base, error)
            freed = self._free_and_record(call, failure)
            call.plan = self._next_plan(call, failure, attempt, freed)

    def _free_and_record(self, call: Call, failure: Failure) -> MemorySnapshot:
        """Free what the failed attempt held, and record the OOM (event, tally, peak model); the memory after."""
        cleanup_started = time.perf_counter()
        free_failed_attempt(self._runner, call.backend, self._device, failure.summary.phase, failure.base)
        freed = snapshot(call.backend)
        call.tried.append((failure.plan, failure.summary))
        lost = failure.seconds + time.perf_counter() - cleanup_started  # the attempt and the cleanup after it
        call.seconds_lost += lost
        telemetry = device_telemetry(call.backend, failure.summary.requested_bytes, self.options.fix_fragmentation)
        self._emit(OOMEvent(call.step, failure.plan.to_dict(), failure.summary.memory, len(call.tried),
                            self._plan_rung, failure.summary, freed, lost, telemetry))  # fmt: skip
        items = round(failure.plan.effective_micro_batch_size(call.size) * call.items_per_sample)
        self._buckets.learn_failure(failure.plan, items, failure.base, call.backend)
        return freed

    def _next_plan(self, call: Call, failure: Failure, attempt: Attempt[Any], freed: MemorySnapshot) -> Plan:
        """The plan to try next: one rung down, or back to the bucket's plan after a failed try at a cheaper one.

        Gives up (raises) when the ladder has nothing left or a bound on attempts or time is reached.
        """
        bound = self._bound_reached(call, attempt.agreement)
        if call.choice.trial and failure.plan == call.choice.plan:  # a plan timed while tuning does not fit
            plan = self._foresight.trial_failed(call.choice)
        elif call.choice.relaxing and failure.plan == call.choice.plan:  # the try at a cheaper plan failed
            plan = self._buckets.relax_failed(call.choice)
            self._emit(relax_event(call, "failed", self._buckets.next_try_after(call.choice.bucket)))
        else:
            jump = None if bound else self._foresight.jump(call, failure, attempt.agreement is not None)
            if jump is not None:  # several rungs at once, as the dry-run planner predicted
                engaged, plan = jump
                rung, how = engaged[-1], " (the dry-run planner's prediction)"
            else:
                chosen = self.ladder.next(failure.plan, self._escalation_context(call, failure, attempt))
                if chosen is None:
                    self._give_up(call, "ladder", failure.error)
                (rung, plan), engaged, how = (chosen[0].name, chosen[1]), (), ""
            if not bound:
                self._plan_rung = rung
                change = f"{failure.plan.describe(call.size)} -> {plan.describe(call.size)}{how}"
                self._emit(FallbackEvent(call.step, plan.to_dict(), freed, rung, failure.plan.to_dict(),
                                         failure.summary.memory, change, engaged))  # fmt: skip
        if bound:
            self._give_up(call, bound, failure.error)
        return plan

    def _bound_reached(self, call: Call, agreement: Agreement | None) -> GiveUp | None:
        """The bound on attempts or time this call has reached; under distributed training, one rank's reaching
        it stops every rank (the attempts are the same on all ranks, so another rank's can only be its clock)."""
        reached = self._bounds.reached(call)
        if agreement is None:
            return reached
        return (reached or "time") if agreement.any(reached is not None) else None

    def _escalation_context(self, call: Call, failure: Failure, attempt: Attempt[Any]) -> RungContext:
        # Under distributed training every rank escalates from the same agreed figures, so all reach the same
        # plan: the deepest phase any rank failed in, and no per-rank prediction.
        distributed = attempt.agreement is not None
        predicted = None if distributed else self._buckets.predict(failure.plan, call.backend, call.items_per_sample)
        phase = attempt.agreed_phase or failure.summary.phase
        return self._rung_context(call.backend, call.size, distributed, phase=phase, max_micro_batch=predicted)

    def _rung_context(self, backend: MemoryBackend, size: int, distributed: bool, **figures: Any) -> RungContext:
        """What the rungs may assume on a batch of ``size`` on ``backend``: the model's context, and ``figures``."""
        return dataclasses.replace(self._context, batch_size=size, can_offload=backend.offloads,
                                   distributed=distributed, **figures)  # fmt: skip

    def _give_up(self, call: Call, reason: GiveUp, cause: BaseException) -> NoReturn:
        """Undo every effect on the model, log the giving up, and raise the error that says so (caused by the
        last attempt's error)."""
        unrestored = self.effects.undo()
        memory = snapshot(call.backend)
        self._emit(ExhaustedEvent(call.step, call.plan.to_dict(), memory, reason, len(call.tried),
                                  tuple(plan.to_dict() for plan, _ in call.tried)))  # fmt: skip
        message = give_up_message(call, reason, memory, step=call.step, bounds=self._bounds,
                                  rungs=", ".join(self.ladder.names), unrestored=unrestored)  # fmt: skip
        error = LadderExhausted if reason == "ladder" else RecoveryLimitExceeded
        raise error(message, step=call.step, tried=tuple(call.tried), memory=memory) from cause

    # -- success ----------------------------------------------------------------------------------------
    def _succeed(self, call: Call, output: AttemptOutput, seconds: float | None) -> StepResult:
        plan = call.plan
        items = round(output.micro_batch_size * call.items_per_sample)
        self._buckets.learn_success(plan, items, output.peak - output.base, call.backend)
        result = StepResult(
            loss=output.loss, micro_batch_size=plan.effective_micro_batch_size(call.size),
            rungs=plan.rungs(call.size), ooms=len(call.tried), step=call.step, batch_size=call.size,
            micro_batches=output.micro_batches, plan=plan, grad_norm=output.grad_norm, seconds_lost=call.seconds_lost,
            transfer_bytes=call.backend.transferred_bytes - call.transferred,
        )  # fmt: skip
        self._last_plan = plan
        self._last = dataclasses.replace(call, batch=None)  # its batch is the caller's to free
        choice = call.choice
        self._buckets.succeeded(choice, plan)
        if choice.relaxing and plan == choice.plan:
            self._emit(relax_event(call, "held", self._buckets.next_try_after(choice.bucket)))
        replaying = self._replaying
        if replaying is not None:  # a replay of a step: counted once, by the part of the step that needed it
            replaying.tried += call.tried
            replaying.seconds_lost += call.seconds_lost
            return result
        self._tally.count_step(result.rungs)
        if call.tried:
            self._recovered(call, plan)
            if not choice.trial and plan != choice.plan:
                self._foresight.settled(choice.bucket)
        tuned = None if seconds is None else self._foresight.timed(choice, plan, not call.tried, seconds)
        if tuned is not None:  # the bucket's tuning is complete: keep the fastest plan measured
            self._buckets.tuned(tuned.bucket, tuned.plan)
            self._emit(tuned.event(call.step, call.size, snapshot(call.backend)))
        log_every = self.options.log_every
        if log_every is not None and (result.step < log_every or result.step % log_every == 0 or call.tried):
            memory = dataclasses.replace(snapshot(call.backend), peak=output.peak)
            self._emit(ProgressEvent(result.step, plan.to_dict(), memory, output.loss, choice.bucket,
                                     dict(self._tally.steps_by_rung), result.transfer_bytes))  # fmt: skip
        return result

    def _recovered(self, call: Call, plan: Plan) -> None:
        """The step of ``call`` succeeded after its out-of-memory errors: an event says on which plan."""
        self._emit(RecoveredEvent(call.step, plan.to_dict(), snapshot(call.backend), plan.rungs(call.size),
                                  len(call.tried), call.seconds_lost, plan.describe(call.size)))  # fmt: skip

    # -- around the calls -------------------------------------------------------------------------------
    def _start(self, backend: MemoryBackend, batch: Any, size: int) -> None:
        """First call: join the process group if there is one, open the log, load the state file, preplan."""
        if self._started:
            return
        if isinstance(backend, AccountedDevice):  # (a simulated device: compiled code runs eagerly under it)
            backend.warn_if_compiled(self.model)
        if distributed_active():
            self._runner.agreement = Agreement(self._device, self.ladder)
        rank = 0 if self._runner.agreement is None else self._runner.agreement.rank
        if self.options.log_file is not None:  # one log per rank: rank k > 0 writes NAME.rank<k>.jsonl beside it
            path = Path(self.options.log_file)
            log = JsonlSink(path if rank == 0 else path.with_suffix(f".rank{rank}{path.suffix}"))
            self._sinks = [self._tally, log, *self.options.sinks]
        if self.options.state_file is not None:  # every rank reads the plans; only rank 0 writes them
            fingerprint = model_fingerprint(unwrap(self.model))
            store = PlanStore(self.options.state_file, fingerprint, backend.identity(), writable=rank == 0)
            # (only the plans this ladder could reach for this model, optimizer and device: see Ladder.beyond)
            self._buckets.load(store, self._rung_context(backend, size, self._runner.agreement is not None))
        if self.options.preplan and not self._buckets.plans():  # a remembered plan beats a predicted one
            report = preplan(self._step_fn, batch, self.options, backend, bf16=self._context.bf16_supported,
                             distributed=self._runner.agreement is not None, effects=self.effects)  # fmt: skip
            if report is not None and report.recommended is not None:
                self.plan = report.recommended
        self._started = True  # only now: a first call that failed here starts over, state file included

    def _state_file_saved(self, error: OSError | None) -> None:
        """Saving to the state file fails (``error``), or works again (None): an event says so, once each way."""
        description = UNSAVED_ADVICE if error is not None else "saving works again"
        memory = snapshot(current_backend(self._device))
        self._emit(StateFileEvent(self.steps, self._last_plan.to_dict(), memory, str(self.options.state_file),
                                  None if error is None else str(error), description))  # fmt: skip

    def _emit(self, event: Event) -> None:
        self._events.append(event)
        log_event(event)
        for sink in self._sinks:
            try:
                sink(event)
            except Exception:  # a broken sink must not kill a long training job
                logger.exception("oomguard: event sink %r failed", sink)
