"""What the recovery loop retries (:class:`oomguard._guard.loop.Attempt`): a call's batch through the step
runner, or a part of a step that someone else drives after it (the Trainer's clipping and optimizer step)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from oomguard._backends.memory import MemoryBackend
from oomguard._distributed.agreement import Agreement
from oomguard._distributed.peers import own_or_peer_failure, peer_failure
from oomguard._errors import GuardConfigError
from oomguard._guard.call import Call
from oomguard._ladder.plan import Phase, Plan
from oomguard._step.outcome import AttemptFailure, AttemptOutput
from oomguard._step.runner import Gradients, Reduction, StepRunner, outcome_of

__all__ = ["OneCallAtATime", "ReplayFailed", "Run", "Tail", "agreed", "in_replay", "undoable"]

T = TypeVar("T")


class OneCallAtATime:
    """Held by the thread running a call. A call from another thread meanwhile is refused: two calls would
    interleave their zero_grad, backward and optimizer steps. (The Trainer's optimizer step replays its batch
    through a call on the same thread, so the lock is re-entrant.)"""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise GuardConfigError(
                "this guard is already running a step in another thread: a guard trains one step at a time (its "
                "calls zero the gradients, backpropagate and step the optimizer). Call it from one thread, or "
                "serialize the calls with a lock"
            )

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class Run:
    """A call's batch through the step runner, with the optimizer step (``step``) or leaving it to the caller."""

    def __init__(self, runner: StepRunner, call: Call, *, step: bool, reduction: Reduction | None) -> None:
        self.runner, self.call, self.step, self.reduction = runner, call, step, reduction
        self.agreement: Agreement | None = runner.agreement

    def gradients(self, plan: Plan) -> Gradients | AttemptFailure:
        call = self.call
        return self.runner.gradients(
            call.batch, call.size, plan, call.backend, step=self.step, reduction=self.reduction
        )

    def commit(self, gradients: Gradients) -> AttemptOutput | AttemptFailure:
        return self.runner.commit(gradients)


class ReplayFailed(Exception):
    """How a replay's failed attempt comes back through the caller's code that asked for it (see :class:`Tail`):
    raised by the guard's ``accumulate`` during a replay, caught by the tail that replays. Never reaches a user."""

    def __init__(self, failure: AttemptFailure) -> None:
        super().__init__("a replay of the step's gradients failed")
        self.failure = failure


class Tail(Generic[T]):
    """A part of a step that someone else drives after the guarded forward and backward (the Trainer's clipping
    and optimizer step), as an attempt of the recovery loop.

    On a plan other than the one the gradients were computed on (after an OOM in the part), its gradients half
    first recomputes the same batch's gradients on that plan through ``replay`` (the caller's code, which calls
    the guard's ``accumulate`` again: during a replay that is one attempt of this loop, and its failure comes back
    here as :class:`ReplayFailed`); then the part runs again.

    Under distributed training ``agreement`` is the guard's: ``run`` agrees how the part went on every rank (see
    :func:`agreed` and :meth:`StepRunner.optimizer_step`), so all ranks fail together, in the same phase, and the
    loop escalates alike on every rank; the replay's ``accumulate`` runs agreement A and the gradient all-reduce on
    every rank, as any attempt does.
    """

    def __init__(
        self,
        ran_on: Plan,
        run: Callable[[Plan], T],
        replay: Callable[[Plan], None],
        phase: Phase,
        agreement: Agreement | None = None,
    ) -> None:
        self.run, self.replay, self.phase, self.agreement = run, replay, phase, agreement
        self.ran_on = ran_on  # the plan the gradients were computed on

    def gradients(self, plan: Plan) -> Plan | AttemptFailure:
        if plan != self.ran_on:
            try:
                self.replay(plan)
            except ReplayFailed as failed:
                return failed.failure
            self.ran_on = plan
        return plan

    def commit(self, plan: Plan) -> T | AttemptFailure:
        try:
            return self.run(plan)
        except Exception as exc:  # (the record is not kept in this frame: see StepRunner._failed)
            agreed_phase = self.phase if self.agreement is not None else None  # (every rank failed in it)
            return AttemptFailure(exc, plan, self.phase, 0, None, agreed_phase)


def agreed(run: Callable[[], T], agreement: Agreement | None, backend: MemoryBackend, phase: Phase) -> Callable[[], T]:
    """``run`` (a part of a step someone else drives, such as the Trainer's clipping), then one agreement of how it
    went on every rank (where there is one): a rank whose peer failed raises too (:class:`PeerOutOfMemory`), so
    every rank retries the part together, and none waits in a collective that another left for a replay."""
    if agreement is None:
        return run

    def part() -> T:
        try:
            result = run()
        except Exception as exc:
            own = outcome_of(exc, backend)  # (the others are about to agree after their part)
            failure = own_or_peer_failure(exc, own, agreement.after_step(own), phase)
            if failure is not exc:
                raise failure from None
            raise
        outcome = agreement.after_step("ok")
        if outcome != "ok":
            raise peer_failure(outcome, phase)
        return result

    return part


def in_replay(part: Callable[[Plan], T], plan: Plan, phase: Phase, agreement: Agreement | None) -> T:
    """``part`` run inside a replay on ``plan`` (the Trainer's clipping of the recomputed gradients before the
    optimizer step is run again): one piece of the replay's attempt, whose failure ends that attempt
    (:class:`ReplayFailed`, back to the recovery loop through the caller's replay), never a recovery of its own."""
    try:
        return part(plan)
    except Exception as exc:
        agreed_phase = phase if agreement is not None else None  # (every rank failed in it: see agreed)
        raise ReplayFailed(AttemptFailure(exc, plan, phase, 0, None, agreed_phase)) from None


def undoable(runner: StepRunner, backend: MemoryBackend, run: Callable[[], T]) -> Callable[[Plan], T]:
    """``run`` (an optimizer step someone else drives) as the runner steps (:meth:`StepRunner.optimizer_step`):
    undone if it raises, with the effects of the plan it is given. The caller holds signals around it (the loop)."""

    def step(plan: Plan) -> T:
        result: list[T] = []
        runner.optimizer_step(plan, backend, run=lambda: result.append(run()))
        return result[0]

    return step
