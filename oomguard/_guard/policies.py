"""Which plan a call tries after an out-of-memory error: an ordered list of small policies, the first that
answers wins.

0. :class:`SameAgain`: the first OOM of a call on a plan that ran clean, where the allocator can fail spuriously:
   the same plan once more.
1. :class:`FailedTrial`: a plan timed while tuning does not fit: back to the settled plan (it is dropped).
2. :class:`FailedStepUp`: a try at stepping back up (a plan one rung less degraded) failed: back to the bucket's
   plan, and wait twice as long before the next try.
3. :class:`Jump`: the first OOM of a batch that never fitted: the plan the dry-run planner predicts fits, several
   rungs at once.
4. :class:`Walk`: one rung down the ladder, the rung that relieves the phase that failed.

None answering means the ladder has nothing left. After host memory (RAM) ran out only the first three are asked:
they go back to a plan that worked, where the last two would offload more to the host (:attr:`Policy.escalates`).
Bounds on attempts and time are the loop's business: a policy is told whether one was reached (then the jump does
not plan, since its answer would not be tried).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from oomguard._backends.memory import CudaMemory, MemoryBackend, snapshot
from oomguard._backends.units import format_bytes
from oomguard._effects.activation_host import ActivationLedger
from oomguard._events import Event, RetryEvent
from oomguard._guard.buckets import Buckets
from oomguard._guard.call import Call
from oomguard._guard.foresight import Foresight
from oomguard._guard.recovery import Failure, relax_event
from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Plan
from oomguard._ladder.rungs import RungContext

__all__ = ["Escalation", "FailedStepUp", "FailedTrial", "Jump", "Move", "Policy", "SameAgain", "Walk"]


@dataclass(frozen=True)
class Move:
    """The plan to try next, and how it was come to."""

    plan: Plan
    rung: str | None = None  # the rung it engages, named in a fallback event (None: a plan the bucket had)
    engaged: tuple[str, ...] = ()  # every rung a jump engaged
    how: str = ""  # said after the change in the fallback event
    #: What the dry run that came to it cost (a jump's): said in the fallback event.
    planning_seconds: float = 0.0
    fake_steps: int = 0


class Policy(Protocol):
    @property
    def escalates(self) -> bool:
        """Whether the policy's plans need less device memory than the failed one (more rungs, more offloading):
        not asked after host memory ran out."""
        ...

    def __call__(self, call: Call, failure: Failure, distributed: bool, bounded: bool) -> Move | None:
        """The next plan for ``call`` after ``failure``, or None where this policy has nothing to say.
        ``distributed``: the attempt's ranks agreed on it; ``bounded``: a bound on attempts or time is reached."""
        ...


@dataclass
class SameAgain:
    """CUDA's caching allocator can raise an OOM while a block that fits is pending on a stream event (a free made
    on another stream, as the offload rungs' copies make); the same allocation asked again finds it (pytorch#189504).
    So where the backend's allocator can (CUDA; a SimulatedGPU made with ``spurious_ooms=True``), the first OOM of a
    call on its bucket's plan, which ran clean before, tries that plan once more before a rung moves. Bounded: once
    per call, not under torch.distributed (every rank agreeing on the same plan reads as the ladder being done), and
    no more once :attr:`limit` such tries ran out of memory again (those OOMs were real)."""

    buckets: Buckets
    emit: Callable[[Event], None]
    limit: int = 3
    wasted: int = 0  # tries that ran out of memory again
    escalates: ClassVar[bool] = False

    def __call__(self, call: Call, failure: Failure, distributed: bool, bounded: bool) -> Move | None:
        tried = [plan for plan, _ in call.tried]
        if tried == [failure.plan, failure.plan]:  # (the try this policy asked for failed: a real OOM)
            self.wasted += 1
        choice = call.choice
        if distributed or bounded or failure.host or len(tried) != 1 or self.wasted >= self.limit:
            return None
        if choice.trial or choice.relaxing or failure.plan != choice.plan or not spurious_ooms(call.backend):
            return None
        clean = self.buckets.clean_steps(choice.bucket, failure.plan)
        if clean < 1:
            return None
        self.emit(RetryEvent(call.step, failure.plan.to_dict(), snapshot(call.backend), clean, self.wasted))
        return Move(failure.plan)


def spurious_ooms(backend: MemoryBackend) -> bool:
    """Whether ``backend``'s allocator can fail while the memory it needs is pending (see :class:`SameAgain`)."""
    return isinstance(backend, CudaMemory) or bool(getattr(backend, "spurious_ooms", False))


@dataclass(frozen=True)
class FailedTrial:
    foresight: Foresight
    escalates: ClassVar[bool] = False

    def __call__(self, call: Call, failure: Failure, distributed: bool, bounded: bool) -> Move | None:
        if not (call.choice.trial and failure.plan == call.choice.plan):
            return None
        return Move(self.foresight.trial_failed(call.choice))


@dataclass(frozen=True)
class FailedStepUp:
    buckets: Buckets
    emit: Callable[[Event], None]
    escalates: ClassVar[bool] = False

    def __call__(self, call: Call, failure: Failure, distributed: bool, bounded: bool) -> Move | None:
        choice = call.choice
        if not (choice.relaxing and failure.plan == choice.plan):
            return None
        plan = self.buckets.relax_failed(choice)
        self.emit(relax_event(call, "failed", self.buckets.next_try_after(choice.bucket)))
        return Move(plan)


@dataclass(frozen=True)
class Jump:
    foresight: Foresight
    walk: Walk  # where the jump knows no better
    escalates: ClassVar[bool] = True

    def __call__(self, call: Call, failure: Failure, distributed: bool, bounded: bool) -> Move | None:
        jump = None if bounded else self.foresight.jump(call, failure, distributed)
        if jump is None:
            return None
        seconds, steps = jump.seconds, jump.fake_steps
        move: Move | None
        if jump.plan is None:  # it knows no better: the walk's move, which the fallback event says the dry run cost
            move = self.walk(call, failure, distributed, bounded)
            move = None if move is None else dataclasses.replace(move, planning_seconds=seconds, fake_steps=steps)
        else:
            recorded = ", recorded for a batch of this shape" if jump.recorded else ""
            how = f" (the dry-run planner's prediction{recorded})"
            move = Move(jump.plan, jump.engaged[-1], jump.engaged, how, seconds, steps)
        return move


@dataclass
class Escalation:
    """What the rungs may assume: the model's context (``model``: the guard gives it its host budget at the first
    call), what the run has measured so far (``activations``: activation offload's host bytes per sample, the
    fact ``activation_host_per_sample``), and the figures of a batch or a failure."""

    buckets: Buckets
    model: RungContext
    activations: ActivationLedger | None = None

    def context(self, backend: MemoryBackend, size: int, distributed: bool, **figures: Any) -> RungContext:
        """What the rungs may assume on a batch of ``size`` on ``backend``: the model's context, what was measured,
        and ``figures``."""
        return dataclasses.replace(
            self.model,
            batch_size=size,
            can_offload=backend.offloads,
            distributed=distributed,
            facts=self._facts(),
            **figures,
        )

    def _facts(self) -> dict[str, Any]:
        """The model's facts, and what the run measured (read now: each step on activation offload measures it
        afresh)."""
        measured = {} if self.activations is None else {"activation_host_per_sample": self.activations.per_sample}
        return {**self.model.facts, **measured}

    def host_bytes(self, plan: Plan, size: int) -> int:
        """What ``plan`` keeps on the host on a batch of ``size``, by the rungs' estimate (what a host failure
        names where the backend does not count the host)."""
        context = dataclasses.replace(self.model, batch_size=size, facts=self._facts())
        return self.buckets.ladder.host_bytes(plan, context)

    def host_besides_activations(self, plan: Plan) -> int:
        """What ``plan`` keeps on the host besides activation offload's saved tensors, by the rungs' estimate (what
        that effect's check adds its copies to where the backend does not count the host)."""
        return self.buckets.ladder.host_bytes(plan.replace(activation_offload=False), self.model)

    def __call__(self, call: Call, failure: Failure, distributed: bool) -> RungContext:
        """What the rungs may assume when ``call`` escalates from ``failure``. Under distributed training every rank
        escalates from the same agreed figures, so all reach the same plan: the deepest phase any rank failed in,
        and no per-rank prediction."""
        predicted = None if distributed else self.buckets.predict(failure.plan, call.backend, call.items_per_sample)
        phase = failure.agreed_phase or failure.summary.phase
        return self.context(call.backend, call.size, distributed, phase=phase, max_micro_batch=predicted)


@dataclass(frozen=True)
class Walk:
    ladder: Ladder
    escalation: Escalation
    escalates: ClassVar[bool] = True

    def __call__(self, call: Call, failure: Failure, distributed: bool, bounded: bool) -> Move | None:
        chosen = self.ladder.next(failure.plan, self.escalation(call, failure, distributed))
        return None if chosen is None else Move(chosen[1], chosen[0].name)

    def host_refused(self, call: Call, failure: Failure, distributed: bool) -> str | None:
        """Where the walk found nothing because the host has no room for what the rungs left would put there:
        which plans, what each needs, the budget, and what would fit (None where the host refused nothing)."""
        context = self.escalation(call, failure, distributed)
        refused = self.ladder.host_refusals(failure.plan, context)
        if not refused or context.host_budget is None:
            return None
        needs = "; ".join(
            f"{rung.name} ({plan.describe(call.size)}) needs about {format_bytes(nbytes)}"
            for rung, plan, nbytes in refused
        )
        listed = set(self.ladder.names)
        other = (
            ""
            if "quantized_optimizer" in listed or not context.optimizer_quantizable
            else ("put quantized_optimizer on the ladder (8-bit optimizer state, kept on the device), ")
        )
        least = min(nbytes for _, _, nbytes in refused)
        return (
            f"{needs} of host memory, past the guard's host budget of {format_bytes(context.host_budget)}, so "
            f"nothing was moved to the host. What would fit: {other}a host_memory= of at least "
            f"{format_bytes(least)} where the machine has that much, or a smaller batch or model"
        )
