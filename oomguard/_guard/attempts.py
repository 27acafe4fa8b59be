"""What the recovery loop retries: an attempt runs one plan, and says where it was when it ran out of memory."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from oomguard._backends.memory import MemoryBackend
from oomguard._distributed.agreement import Agreement
from oomguard._effects.effects import Effects
from oomguard._effects.transaction import OptimizerTransaction
from oomguard._errors import GuardConfigError
from oomguard._guard.recovery import Call
from oomguard._ladder.plan import Phase, Plan
from oomguard._step.runner import AttemptOutput, Reduction, StepRunner

__all__ = ["Attempt", "OneCallAtATime", "Run", "Tail", "undoable"]

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


class Attempt(Generic[T]):
    """One try at a plan. After a failure the loop reads where it was (``phase``, ``micro_batch``), the memory in
    use when it began (``base``, None where unknown) and, under distributed training, what the ranks agreed."""

    def __call__(self, plan: Plan) -> T:
        raise NotImplementedError

    @property
    def phase(self) -> Phase:
        return Phase.OPTIMIZER

    @property
    def micro_batch(self) -> int:
        return 0

    @property
    def base(self) -> int | None:
        return None

    @property
    def agreement(self) -> Agreement | None:
        """The agreement protocol of a distributed job, where this attempt takes part in one."""
        return None

    @property
    def agreed_phase(self) -> Phase | None:
        """The deepest phase any rank failed in, where the ranks agreed on one."""
        return None


class Run(Attempt[AttemptOutput]):
    """A call's batch through the step runner, with or without the optimizer step."""

    def __init__(self, runner: StepRunner, call: Call, *, step: bool, reduction: Reduction | None) -> None:
        self.runner, self.call, self.step, self.reduction = runner, call, step, reduction

    def __call__(self, plan: Plan) -> AttemptOutput:
        call = self.call
        return self.runner.run(call.batch, call.size, plan, call.backend, step=self.step, reduction=self.reduction)

    @property
    def phase(self) -> Phase:
        return self.runner.phase

    @property
    def micro_batch(self) -> int:
        return self.runner.micro_batch

    @property
    def base(self) -> int | None:
        return self.runner.base

    @property
    def agreement(self) -> Agreement | None:
        return self.runner.agreement

    @property
    def agreed_phase(self) -> Phase | None:
        verdict = self.runner.verdict
        return verdict.phase if verdict is not None and verdict.outcome != "ok" else None


class Tail(Attempt[T]):
    """A part of a step that someone else drives after the guarded forward and backward (the Trainer's clipping
    and optimizer step).

    On a cheaper plan (after an OOM in the part) ``replan`` first recomputes the same batch's gradients on it and
    returns the plan that took (a replay may go deeper still); then the part runs again.
    """

    def __init__(self, call: Call, run: Callable[[], T], replan: Callable[[Plan], Plan], phase: Phase) -> None:
        self.call, self.run, self.replan, self._phase = call, run, replan, phase
        self.ran_on = call.plan  # the plan the gradients were computed on

    def __call__(self, plan: Plan) -> T:
        if plan != self.ran_on:
            self.ran_on = self.call.plan = self.replan(plan)
        return self.run()

    @property
    def phase(self) -> Phase:
        return self._phase


def undoable(
    transaction: OptimizerTransaction, backend: MemoryBackend, run: Callable[[], T], effects: Effects, on: HasPlan
) -> Callable[[], T]:
    """``run`` (an optimizer step) through the transaction, undone if it raises, with the effects of the plan
    ``on.plan`` has when it runs (optimizer offload steps on the host)."""

    def step() -> T:
        result: list[T] = []
        # Signals held until the effects are done too (optimizer offload copies the stepped parameters back after
        # the transaction commits): the caller delivers them once the step is whole.
        with transaction.interrupts.held(), effects.optimizer_step(on.plan, backend):
            transaction.step(backend, run=lambda: result.append(run()))
        return result[0]

    return step


class HasPlan(Protocol):
    @property
    def plan(self) -> Plan: ...
