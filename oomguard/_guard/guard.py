"""The guard: run a training step, and on an out-of-memory error free memory and retry one rung down.

The recovery loop is :mod:`oomguard._guard.loop`'s, and the only one: the decorated call, the Trainer's forward
and backward, and the Trainer's own clipping and optimizer step all go through it. Which plan a call starts from
(per batch bucket, stepping back up after clean steps, sized by measured peaks, remembered across restarts) is
the buckets' business (:mod:`oomguard._guard.buckets`); which plan comes after an OOM, the policies'
(:mod:`oomguard._guard.policies`); what the events add up to, the tally's.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from oomguard._backends.accounting import AccountedDevice
from oomguard._backends.host import host_budget
from oomguard._backends.memory import MemoryBackend, current_backend, snapshot
from oomguard._bitsandbytes import tell_once
from oomguard._distributed.agreement import unwrap
from oomguard._distributed.choice import agreement_for
from oomguard._errors import GuardConfigError
from oomguard._events import Event, JsonlSink, ProgressEvent, StateFileEvent
from oomguard._guard.attempts import OneCallAtATime, ReplayFailed, Run, Tail, agreed, in_replay, undoable
from oomguard._guard.buckets import Buckets, Choice, weakly
from oomguard._guard.call import Call, RandomState
from oomguard._guard.emitter import Emitter
from oomguard._guard.foresight import Foresight
from oomguard._guard.loop import Loop
from oomguard._guard.persist import UNSAVED_ADVICE, PlanStore, model_fingerprint
from oomguard._guard.policies import Escalation, FailedStepUp, FailedTrial, Jump, Policy, SameAgain, Walk
from oomguard._guard.recovery import Bounds, held_back_event, relax_event
from oomguard._guard.results import GuardSummary, StepResult
from oomguard._guard.stepup import StepUp
from oomguard._guard.tally import Tally
from oomguard._ladder.plan import Phase, Plan
from oomguard._options import GuardOptions, build_runner, check_accelerator, model_context, takes_options
from oomguard._step.batch import batch_size, items_per_sample
from oomguard._step.outcome import AttemptFailure, AttemptOutput
from oomguard._step.runner import Reduction

__all__ = ["OOMGuard"]

T = TypeVar("T")


class _Last(NamedTuple):
    """What a part of a step driven after the last call needs of it: its bucket, batch size and step."""

    bucket: int
    size: int
    items_per_sample: float
    step: int
    random: RandomState  # the generators as it began: a replay of its batch draws what it drew


class _Replay(NamedTuple):
    """A replay in progress (see :meth:`OOMGuard.protected_step`): the step's call, and the plan to recompute on."""

    call: Call
    plan: Plan


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
        tell_once(self.effects.target.model, self.ladder.names, self._context.frozen_linears)  # (bitsandbytes' 4-bit)
        self._device = next(self.model.parameters()).device
        self._buckets = Buckets(
            self.ladder,
            self.options.relax_after,
            self.options.predictive,
            self._runner.grad_bytes,
            on_save=weakly(self._state_file_saved),  # weakly: the guard must die (and undo its effects) when dropped
        )
        self._foresight = Foresight(
            step_fn, self.options, self._buckets, self.effects, self._context.bf16_supported, self._device
        )
        self._step_up = StepUp(self._foresight, self._buckets)
        bounds = Bounds(self.options.max_attempts, self.options.max_recovery_seconds)
        self._tally = Tally()
        self._emit = Emitter([self._tally, *self.options.sinks])  # (shared with the loop: neither holds the other)
        self._escalation = Escalation(self._buckets, self._context, self.effects.target.activation_host)
        walk = Walk(self.ladder, self._escalation)
        policies: list[Policy] = [
            SameAgain(self._buckets, self._emit),
            FailedTrial(self._foresight),
            FailedStepUp(self._buckets, self._emit),
            Jump(self._foresight, walk),
            walk,
        ]
        self._loop = Loop(
            self._runner,
            self.effects,
            bounds,
            policies,
            self._emit,
            self._buckets,
            self._device,
            fix_fragmentation=self.options.fix_fragmentation,
            rungs=", ".join(self.ladder.names),
        )
        self._loop.host_refused, self._loop.host_estimate = walk.host_refused, self._escalation.host_bytes
        self._started = False
        self._host_budget: int | None = None  # resolved at the first call (see host_budget)
        self._busy = OneCallAtATime()
        self._last: _Last | None = None  # the last call that succeeded
        self._last_plan = Plan()
        self._replay: _Replay | None = None  # the step whose gradients accumulate() recomputes (protected_step)
        # A guard that is dropped undoes what its plan did to the model, as close() does (not at exit).
        weakref.finalize(self, self.effects.undo_when_dropped).atexit = False
        weakref.finalize(self, self._emit.held.write)  # (the last step's progress, where log_every left it out)

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
        self._last_plan, self._loop.rung = plan, None

    @property
    def plans(self) -> dict[int, Plan]:
        """The plan of every batch bucket seen so far (and those loaded from the state file)."""
        return self._buckets.plans()

    @property
    def host_budget(self) -> int | None:
        """The host memory, in bytes, this guard may fill with what it offloads: ``host_memory=``, a simulated
        host's limit, or what the OS said was available at the first call less a margin (before the first call:
        what it says now); None where it is unlimited (a simulated host without ``host_capacity``) or unknown."""
        if self._started:
            return self._host_budget
        return host_budget(self.options, current_backend(self._device))

    @property
    def steps(self) -> int:
        """Successful calls so far (each one optimizer step)."""
        return self._tally.steps

    @property
    def events(self) -> list[Event]:
        """Events so far (the most recent 10,000; the log file keeps all)."""
        return list(self._emit.events)

    def close(self) -> None:
        """Undo every effect of the current plan (checkpointing off, offloaded tensors back on the device); the
        guard stays usable: the next call re-applies its plan."""
        self._emit.flush()  # the last step's progress, where log_every left it out
        self.effects.close()
        if self._runner.agreement is not None:
            self._runner.agreement.close()  # (FSDP2: its own comms back)

    def summary(self) -> GuardSummary:
        """Which fallbacks were needed and how often."""
        return self._tally.summary(self._last_plan)

    # -- calls ------------------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> StepResult:
        """Train on ``batch``: one optimizer step, however many attempts and micro-batches it takes."""
        return self._call(batch, step=True)

    def accumulate(
        self, batch: Any, reduction: Reduction | None = None, *, rewind: Callable[[], None] | None = None
    ) -> StepResult:
        """Forward and backward of ``batch`` only, recovered like a call: the gradients are left for the caller
        to step with (through :meth:`protected_step`). ``reduction`` overrides the guard's for this batch.
        ``rewind`` is called after each failed attempt, before the batch is tried again: it puts back what the
        attempt added to the caller's own records (the Trainer's metrics).

        Called during :meth:`protected_step`'s ``replay``, it recomputes that step's gradients on the plan being
        tried: one attempt of that step's recovery, not a call of its own."""
        return self._call(batch, step=False, reduction=reduction, rewind=rewind)

    def protected_step(self, run: Callable[[], T], replay: Callable[[], None], *, phase: Phase = Phase.OPTIMIZER) -> T:
        """A part of the last call's step that someone else drives after it (the Trainer's clipping and optimizer
        step), recovered as part of that step; returns what ``run`` returns.

        ``run`` does the part (an optimizer step, with ``phase`` :attr:`Phase.OPTIMIZER`, is made undoable by the
        guard's transaction). On an OOM the guard frees what it held and moves one rung down for ``phase``;
        ``replay`` recomputes the batch's gradients on the new plan (through :meth:`accumulate`: a retry of the same
        step, not a new one), and ``run`` runs again: still exactly one step, counted once, recovered."""
        last, backend, agreement = self._last, current_backend(self._device), self._runner.agreement
        # (an optimizer step is made undoable and agreed; any other part runs on whatever plan, agreed)
        shared = agreed(run, agreement, backend, phase)
        part = undoable(self._runner, backend, run) if phase == Phase.OPTIMIZER else lambda plan: shared()
        with self._busy:
            if self._replay is not None:  # (the clipping of a replay's gradients: a piece of the replay's attempt)
                return in_replay(part, self._replay.plan, phase, agreement)
            if last is None:  # no guarded call yet: no batch to replay on another plan
                with self._loop.committing():
                    return part(self._last_plan)
            choice = Choice(last.bucket, self._last_plan)
            call = self._loop.call(None, last.size, backend, choice, last.items_per_sample, last.step, last.random)
            tail = Tail(self._last_plan, part, functools.partial(self._replayed, call, replay), phase, agreement)
            return self._loop.run(call, tail, self._tail_done)

    def _replayed(self, call: Call, replay: Callable[[], None], plan: Plan) -> None:
        """``replay`` of the batch of ``call``'s step on ``plan``, the bucket's plan from now on; its
        :meth:`accumulate` is the recomputation (:meth:`_recompute`)."""
        self._buckets.escalated(call.choice.bucket, plan)
        self._replay = _Replay(call, plan)
        try:
            replay()
        finally:
            self._replay = None

    def _tail_done(self, call: Call, result: T) -> T:
        if call.tried:
            self._loop.recovered(call, self._last_plan)
        return result

    def _call(
        self, batch: Any, *, step: bool, reduction: Reduction | None = None, rewind: Callable[[], None] | None = None
    ) -> StepResult:
        with self._busy:
            if self._replay is not None and not step:
                return self._recompute(self._replay, batch, reduction)
            return self._guarded(batch, step=step, reduction=reduction, rewind=rewind)

    def _guarded(
        self, batch: Any, *, step: bool, reduction: Reduction | None, rewind: Callable[[], None] | None
    ) -> StepResult:
        size = batch_size(batch)  # raises BatchSplitError for a batch that could never be split
        check_accelerator(self.options.accelerator)  # (its accumulation may have been switched on since)
        backend = current_backend(self._device)
        self._start(backend, batch, size)
        per_sample = items_per_sample(batch, size)
        agreement = self._runner.agreement
        context = self._escalation.context(backend, size, agreement is not None)  # (with the host budget)
        choice = self._buckets.choose(self.options.bucket(batch), size, backend, per_sample, context)
        if choice.held_back is not None:  # a step back up the host has no room for: not tried, and said
            wait = self._buckets.next_try_after(choice.bucket)
            self._emit(held_back_event(self.steps, choice, size, backend, self._host_budget, wait))
        choice = self._step_up(choice, batch, size, backend)  # (a step up due: where the planner puts it)
        if step:  # a full step may be a trial of another plan (tuning: the same trials on every rank)
            choice = self._foresight.choose(choice, batch, size, backend)
        if agreement is not None:  # every rank starts the call on the same plan
            agreed = agreement.plan(choice.plan, size, self.ladder)
            if agreed != choice.plan:
                choice = Choice(choice.bucket, agreed)
        call = self._loop.call(batch, size, backend, choice, per_sample, self.steps)
        started = time.perf_counter()

        def done(call: Call, output: AttemptOutput) -> StepResult:
            seconds = time.perf_counter() - started
            if agreement is not None and step:  # (tuning keeps what the slowest rank measured: every rank alike)
                seconds = agreement.slowest(seconds)
            return self._succeed(call, output, seconds if step else None)

        return self._loop.run(call, Run(self._runner, call, step=step, reduction=reduction), done, rewind=rewind)

    def _recompute(self, replay: _Replay, batch: Any, reduction: Reduction | None) -> StepResult:
        """The gradients of the replayed step's batch on the replay's plan: one attempt, whose failure goes back
        to the loop of :meth:`protected_step` (as :class:`ReplayFailed`, through the caller's replay)."""
        step_call, plan = replay
        size = batch_size(batch)
        choice = Choice(step_call.choice.bucket, plan)
        call = self._loop.call(batch, size, step_call.backend, choice, items_per_sample(batch, size), step_call.step)
        outcome = self._runner.attempt(batch, size, plan, call.backend, step=False, reduction=reduction)
        if isinstance(outcome, AttemptFailure):
            raise ReplayFailed(outcome)
        self._learn(call, outcome)
        self._last_plan = plan
        return self._result(call, outcome)

    # -- success ----------------------------------------------------------------------------------------
    def _learn(self, call: Call, output: AttemptOutput) -> None:
        """The peak model learns what the attempt of ``call`` that worked cost, and so does the activation-offload
        rung's host estimate (what its saved tensors took per sample)."""
        items = round(output.micro_batch_size * call.items_per_sample)
        self._buckets.learn_success(call.plan, items, output.peak - output.base, call.backend)
        if call.plan.activation_offload:
            self.effects.target.activation_host.measured(output.micro_batch_size)

    def _result(self, call: Call, output: AttemptOutput) -> StepResult:
        plan = call.plan
        return StepResult(
            loss=output.loss,
            micro_batch_size=plan.effective_micro_batch_size(call.size),
            rungs=plan.rungs(call.size),
            ooms=len(call.tried),
            step=call.step,
            batch_size=call.size,
            micro_batches=output.micro_batches,
            plan=plan,
            grad_norm=output.grad_norm,
            seconds_lost=call.seconds_lost,
            transfer_bytes=call.backend.transferred_bytes - call.transferred,
        )

    def _succeed(self, call: Call, output: AttemptOutput, seconds: float | None) -> StepResult:
        """Count the call's step (the loop holds shutdown signals meanwhile): the plan it took, its events."""
        plan, choice = call.plan, call.choice
        self._learn(call, output)
        result = self._result(call, output)
        self._last_plan = plan
        self._last = _Last(choice.bucket, call.size, call.items_per_sample, call.step, call.random)
        self._buckets.succeeded(choice, plan)
        if choice.relaxing and plan == choice.plan:
            self._emit(relax_event(call, "held", self._buckets.next_try_after(choice.bucket)))
        self._tally.count_step(result.rungs)
        if call.tried:
            self._loop.recovered(call, plan)
            if not choice.trial and plan != choice.plan:
                self._foresight.settled(choice.bucket)
        tuned = None if seconds is None else self._foresight.timed(choice, plan, not call.tried, seconds)
        if tuned is not None:  # the bucket's tuning is complete: keep the fastest plan measured
            self._buckets.tuned(tuned.bucket, tuned.plan)
            self._emit(tuned.event(call.step, call.size, snapshot(call.backend)))
        log_every = self.options.log_every
        if log_every is not None:  # (one not logged is held: logged at close, drop or exit if no step follows)
            logged = result.step < log_every or result.step % log_every == 0 or call.tried
            memory = dataclasses.replace(snapshot(call.backend), peak=output.peak)
            (self._emit if logged else self._emit.hold)(
                ProgressEvent(
                    result.step,
                    plan.to_dict(),
                    memory,
                    output.loss,
                    choice.bucket,
                    dict(self._tally.steps_by_rung),
                    result.transfer_bytes,
                )
            )
        return result

    # -- around the calls -------------------------------------------------------------------------------
    def _start(self, backend: MemoryBackend, batch: Any, size: int) -> None:
        """First call: join the process group if there is one, open the log, load the state file, preplan."""
        if self._started:
            return
        if isinstance(backend, AccountedDevice):  # (a simulated device: compiled code runs eagerly under it)
            backend.warn_if_compiled(self.model)
        self._host_budget = host_budget(self.options, backend)  # (the OS's figure once, not a moving target)
        self._loop.host_budget = self._foresight.host_budget = self._host_budget
        # The walk leaves plans the host has no room for; the journal is skipped where its copies would not fit.
        self._escalation.model = dataclasses.replace(self._escalation.model, host_budget=self._host_budget)
        self._runner.transaction.host_budget = self._host_budget
        # Activation offload keeps the budget as it copies, beside what the rest of a plan keeps (see activation_host).
        ledger = self.effects.target.activation_host
        ledger.budget, ledger.others = self._host_budget, self._escalation.host_besides_activations
        agreement = agreement_for(unwrap(self.model), self._device, self.ladder)  # (None: a single process)
        if agreement is not None:
            self._runner.agreement = self._foresight.agreement = agreement
        rank = 0 if self._runner.agreement is None else self._runner.agreement.rank
        if self.options.log_file is not None:  # one log per rank: rank k > 0 writes NAME.rank<k>.jsonl beside it
            path = Path(self.options.log_file)
            log = JsonlSink(path if rank == 0 else path.with_suffix(f".rank{rank}{path.suffix}"))
            self._emit.sinks = [self._tally, log, *self.options.sinks]
        fingerprint, store = model_fingerprint(unwrap(self.model)), None
        if self.options.state_file is not None:  # every rank reads the plans; only rank 0 writes them
            store = PlanStore(self.options.state_file, fingerprint, backend.identity(), writable=rank == 0)
            # (only the plans this ladder could reach for this model, optimizer and device: see Ladder.beyond)
            self._buckets.load(store, self._escalation.context(backend, size, self._runner.agreement is not None))
        self._foresight.start(f"{fingerprint}|{backend.identity()}|", store)  # (the answers the planner recorded)
        if self.options.preplan:  # (no dry run where the state file remembers plans: they beat a predicted one)
            planned, event = self._foresight.preplan(batch, backend, self.steps, self._buckets.plans())
            if planned is not None:
                self.plan = planned
            self._emit(event)
        self._started = True  # only now: a first call that failed here starts over, state file included

    def _state_file_saved(self, error: OSError | None) -> None:
        """Saving to the state file fails (``error``), or works again (None): an event says so, once each way."""
        description = UNSAVED_ADVICE if error is not None else "saving works again"
        memory = snapshot(current_backend(self._device))
        self._emit(
            StateFileEvent(
                self.steps,
                self._last_plan.to_dict(),
                memory,
                str(self.options.state_file),
                None if error is None else str(error),
                description,
            )
        )
