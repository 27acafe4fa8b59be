"""The recovery loop, and the only one: the decorated call, the Trainer's forward and backward, and the Trainer's
own clipping and optimizer step all go through :meth:`Loop.run`.

An attempt comes back as a value (:mod:`oomguard._step.outcome`): what it produced, or where and on which plan it
failed. After a failure the loop frees what the attempt held, records it (in the call's record, which only this
module writes, and as an event), and asks its policies (:mod:`oomguard._guard.policies`) for the next plan, or
gives up. Shutdown signals are held from the attempt's optimizer step until the guard has counted the step, here
and nowhere else, so an interrupt never lands between a step and its bookkeeping; one that arrives meanwhile is
delivered as soon as the step is counted, or undone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, NoReturn, Protocol, TypeVar

import torch

from oomguard._backends.memory import MemoryBackend, MemorySnapshot, snapshot
from oomguard._detect import is_host_oom, is_oom, names_an_allocator
from oomguard._distributed.agreement import Agreement
from oomguard._effects.effects import Effects
from oomguard._effects.interrupts import Interrupts
from oomguard._errors import HostMemoryError, LadderExhausted, OOMGuardError, RecoveryLimitExceeded
from oomguard._events import Event, ExhaustedEvent, FailureSummary, FallbackEvent, OOMEvent, RecoveredEvent
from oomguard._guard.buckets import Buckets, Choice
from oomguard._guard.call import Call, RandomState
from oomguard._guard.policies import Move, Policy
from oomguard._guard.recovery import (
    Bounds,
    Failure,
    GiveUp,
    device_telemetry,
    free_failed_attempt,
    give_up_message,
    released,
)
from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Plan
from oomguard._step.outcome import AttemptFailure
from oomguard._step.runner import StepRunner, nothing

__all__ = ["Attempt", "Loop"]

G = TypeVar("G")
T = TypeVar("T")
R = TypeVar("R")
G_contra = TypeVar("G_contra", contravariant=True)
T_co = TypeVar("T_co", covariant=True)


class Attempt(Protocol[G_contra, T_co]):
    """One try at a plan, in two halves: what may fail freely (the gradients), then what commits (the step).
    Either half returns its failure as an :class:`AttemptFailure`."""

    #: The agreement protocol of a distributed job, where this attempt takes part in one.
    agreement: Agreement | None

    def gradients(self, plan: Plan) -> Any: ...  # G_contra | AttemptFailure (what commit takes)

    def commit(self, gradients: G_contra) -> T_co | AttemptFailure: ...


class Loop:
    """Runs attempts until one works, for one guard."""

    def __init__(
        self,
        runner: StepRunner,
        effects: Effects,
        bounds: Bounds,
        policies: list[Policy],
        emit: Callable[[Event], None],
        buckets: Buckets,
        device: torch.device,
        *,
        fix_fragmentation: bool,
        rungs: str,
    ) -> None:
        self.runner, self.effects, self.bounds, self.policies = runner, effects, bounds, policies
        self.emit, self.buckets, self.device = emit, buckets, device
        self.fix_fragmentation, self.rungs = fix_fragmentation, rungs
        self.interrupts = Interrupts()
        self.rung: str | None = None  # the rung engaged last, named in OOM events
        self.host_budget: int | None = None  # the guard's host budget, named when host memory runs out
        #: What the host budget kept the walk from, where it did (see :meth:`~.policies.Walk.host_refused`).
        self.host_refused: Callable[[Call, Failure, bool], str | None] = lambda call, failure, distributed: None
        #: The rungs' estimate of what a plan keeps on the host, on a batch of a size: what a host failure names
        #: where the backend does not count the host (CUDA).
        self.host_estimate: Callable[[Plan, int], int] = lambda plan, size: 0

    # -- the record of a call ---------------------------------------------------------------------------
    def call(
        self,
        batch: Any,
        size: int,
        backend: MemoryBackend,
        choice: Choice,
        per_sample: float,
        step: int,
        random: RandomState | None = None,
    ) -> Call:
        """The record of a new call on ``choice``'s plan (``random``: the generators to retry from; default: now)."""
        random = RandomState(self.device) if random is None else random
        return Call(batch, size, backend, choice, choice.plan, per_sample, step, random)

    # -- the loop ---------------------------------------------------------------------------------------
    def run(
        self,
        call: Call,
        attempt: Attempt[G, T],
        done: Callable[[Call, T], R],
        *,
        rewind: Callable[[], None] | None = None,
    ) -> R:
        """Run ``attempt`` on the call's plan until it works, and ``done`` with what it produced (the step is
        counted there, signals still held). Each out-of-memory error frees what the attempt held, is recorded,
        and moves the call to the next plan, or ends it (LadderExhausted, RecoveryLimitExceeded); any other error
        is raised as itself. ``rewind``, the caller's hook, runs after each OOM once the next plan is chosen (after
        any dry run) or the call gives up: it puts back what the failed attempt added to the caller's records."""
        while True:
            started = time.perf_counter()
            with self.attempting() as hold:
                outcome: Any = attempt.gradients(call.plan)
                if not isinstance(outcome, AttemptFailure):
                    hold()
                    outcome = attempt.commit(outcome)
                    if not isinstance(outcome, AttemptFailure):
                        return done(call, outcome)
            failure = self._kept(call, outcome, time.perf_counter() - started, attempt.agreement)
            del outcome  # (the frames of the failed forward and backward go with it: see _kept)
            freed = self._free_and_record(call, failure)
            try:
                call.plan = self._next_plan(call, failure, attempt.agreement, freed)
            finally:  # (giving up too: the call commits nothing, the caller's records and the generators included)
                call.random.restore()  # (the retry draws what the failed attempt drew: see RandomState)
                if rewind is not None:
                    rewind()

    @contextmanager
    def committing(self) -> Iterator[None]:
        """Shutdown signals held from a step until it is counted (or undone), then delivered."""
        with self.attempting() as hold:
            hold()
            yield

    @contextmanager
    def attempting(self) -> Iterator[Callable[[], None]]:
        """Around an attempt: what it yields holds shutdown signals from there until the attempt ends (its step
        counted, or undone), when they are delivered. The runner calls it where the step begins before the last
        backward ends (``StepRunner.step_begins``: the master level's host step), the loop where the step does."""
        holding: list[bool] = []
        with ExitStack() as stack:

            def hold() -> None:
                if not holding:
                    holding.append(True)
                    stack.enter_context(self.interrupts.held())

            self.runner.step_begins = hold
            try:
                yield hold
            finally:
                self.runner.step_begins = nothing
                stack.close()  # (the handlers back in place before they act on what they noted)
                self.interrupts.deliver()

    def _kept(self, call: Call, failed: AttemptFailure, seconds: float, agreement: Agreement | None) -> Failure:
        """What the loop keeps of a failed attempt: a summary, and the error without its frames. Raises the error
        as itself where it is not an out-of-memory error to retry."""
        error = failed.error
        if isinstance(error, OOMGuardError) or not is_oom(error):  # ours may wrap an OOM: never retry them
            raise error
        # Host memory (RAM) where the device is not the host: the ladder cannot relieve it (see _next_plan).
        host = call.backend.offloads and is_host_oom(error)
        budget = self.host_budget if host else None  # (what a host failure is measured against)
        memory = snapshot(call.backend)
        summary = FailureSummary.from_exception(
            error, failed.phase, failed.micro_batch, memory, host=host, host_budget=budget
        )
        repeated = bool(call.tried) and call.tried[-1][1].same_error(summary)
        if repeated and not host and not names_an_allocator(error) and agreement is None:
            raise error  # the same words again on a plan with less memory, and no allocator said them: not memory
            # (not under torch.distributed: the ranks agreed this was an OOM and all retry together)
        return Failure(failed.plan, summary, seconds, failed.base, released(error), failed.agreed_phase, host)

    def _free_and_record(self, call: Call, failure: Failure) -> MemorySnapshot:
        """Free what the failed attempt held, and record the OOM (event, peak model); the memory after."""
        cleanup_started = time.perf_counter()
        free_failed_attempt(self.runner, call.backend, self.device, failure.summary.phase, failure.base)
        freed = snapshot(call.backend)
        call.tried.append((failure.plan, failure.summary))
        lost = failure.seconds + time.perf_counter() - cleanup_started  # the attempt and the cleanup after it
        call.seconds_lost += lost
        telemetry = device_telemetry(call.backend, failure.summary.requested_bytes, self.fix_fragmentation)
        plan, summary = failure.plan, failure.summary
        tried = len(call.tried)
        self.emit(
            OOMEvent(call.step, plan.to_dict(), summary.memory, tried, self.rung, summary, freed, lost, telemetry)
        )
        items = round(plan.effective_micro_batch_size(call.size) * call.items_per_sample)
        self.buckets.learn_failure(plan, items, failure.base, call.backend)
        return freed

    def _next_plan(self, call: Call, failure: Failure, agreement: Agreement | None, freed: MemorySnapshot) -> Plan:
        """The plan the first policy that answers gives; gives up (raises) when none does (the ladder has nothing
        left) or a bound on attempts or time is reached. After host memory ran out, only a plan that worked before
        (a failed trial's or step up's) is tried: the next rungs would offload more to the host. Under distributed
        training not even that: the other ranks were told of a host failure and stopped (PeerFailure), so this rank
        gives up too, before an agreement on the bounds that they would never join."""
        if failure.host and agreement is not None:
            self._give_up(call, "host", failure.error)
        bound = self._bound_reached(call, agreement)
        move: Move | None = None
        for policy in self.policies:
            if failure.host and policy.escalates:
                continue
            move = policy(call, failure, agreement is not None, bound is not None)
            if move is not None:
                break
        if agreement is not None:  # (every rank reaches this point, whichever policy answered it)
            move = agreed_move(agreement, self.buckets.ladder, move, call, failure)
        if move is None:
            refused = None if failure.host else self.host_refused(call, failure, agreement is not None)
            self._give_up(call, "host" if failure.host else "ladder", failure.error, refused)
        if bound is not None:
            self._give_up(call, bound, failure.error)
        if move.rung is not None:
            self.rung = move.rung
            change = f"{failure.plan.describe(call.size)} -> {move.plan.describe(call.size)}{move.how}"
            before, memory = failure.plan.to_dict(), failure.summary.memory
            planning = round(move.planning_seconds, 3), move.fake_steps
            self.emit(
                FallbackEvent(
                    call.step, move.plan.to_dict(), freed, move.rung, before, memory, change, move.engaged, *planning
                )
            )
        return move.plan

    def _bound_reached(self, call: Call, agreement: Agreement | None) -> GiveUp | None:
        """The bound on attempts or time this call has reached; under distributed training, one rank's reaching
        it stops every rank (the attempts are the same on all ranks, so another rank's can only be its clock)."""
        reached = self.bounds.reached(call)
        if agreement is None:
            return reached
        return (reached or "time") if agreement.any(reached is not None) else None

    def _give_up(self, call: Call, reason: GiveUp, cause: BaseException, host_refused: str | None = None) -> NoReturn:
        """Undo every effect on the model, log the giving up, and raise the error that says so (caused by the
        last attempt's error); ``host_refused``: what the host budget kept the ladder from."""
        if reason == "host":  # (what the guard keeps on the host for the next attempt goes too)
            self.runner.transaction.release_host_copies()
        unrestored = self.effects.undo()
        memory = snapshot(call.backend)
        plans = tuple(plan.to_dict() for plan, _ in call.tried)
        held, estimated = self._host_held(call) if reason == "host" else (None, False)
        budget = self.host_budget if reason == "host" else None
        self.emit(
            ExhaustedEvent(
                call.step, call.plan.to_dict(), memory, reason, len(call.tried), plans, held, budget, estimated
            )
        )
        message = give_up_message(
            call,
            reason,
            memory,
            step=call.step,
            bounds=self.bounds,
            rungs=self.rungs,
            unrestored=unrestored,
            host_budget=self.host_budget,
            host_refused=host_refused,
            host_held=held,
            host_estimated=estimated,
        )
        error = {"ladder": LadderExhausted, "host": HostMemoryError}.get(reason, RecoveryLimitExceeded)
        raise error(message, step=call.step, tried=tuple(call.tried), memory=memory) from cause

    def _host_held(self, call: Call) -> tuple[int | None, bool]:
        """The host memory the guard held at the last failure of ``call``: counted where the backend counts it,
        else the rungs' estimate of the failing plan (and True: it is an estimate)."""
        plan, last = call.tried[-1]
        if last.memory.host_held is not None:
            return last.memory.host_held, False
        return self.host_estimate(plan, call.size), True

    def recovered(self, call: Call, plan: Plan) -> None:
        """The step of ``call`` succeeded after its out-of-memory errors: an event says on which plan."""
        rungs, description = plan.rungs(call.size), plan.describe(call.size)
        memory = snapshot(call.backend)
        self.emit(
            RecoveredEvent(call.step, plan.to_dict(), memory, rungs, len(call.tried), call.seconds_lost, description)
        )


def agreed_move(agreement: Agreement, ladder: Ladder, move: Move | None, call: Call, failure: Failure) -> Move | None:
    """The move every rank makes: per rung, the deepest level any rank's policy chose (a jump's plan is each rank's
    own, planned on its own share and memory; the others' may differ where the ranks' batch buckets do). None: no
    rank has a plan left."""
    agreed = agreement.plan(failure.plan if move is None else move.plan, call.size, ladder)
    if agreed == failure.plan:
        return None
    if move is not None and agreed == move.plan:
        return move
    engaged = ladder.changed(failure.plan, agreed, call.size)
    seconds, steps = (0.0, 0) if move is None else (move.planning_seconds, move.fake_steps)
    how = " (agreed by every rank: per rung, the deepest level any rank chose)"
    return Move(agreed, engaged[-1], engaged, how, seconds, steps)
