"""Running one batch on one plan: forward and backward per micro-batch, then clip, step and schedule.

This is the only place that runs the user's step function and touches gradients. An attempt comes back as a
value: :class:`~oomguard._step.outcome.AttemptOutput` when it worked, :class:`~oomguard._step.outcome.AttemptFailure`
(the error, and the phase, micro-batch and plan it failed on) when it did not, with what it held already dropped.
Its two halves are separate calls (:meth:`StepRunner.gradients`, :meth:`StepRunner.commit`), so that the guard can
hold shutdown signals from the optimizer step until the step is counted (``oomguard._guard.loop``).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch._guards import detect_fake_mode

from oomguard._backends.memory import MemoryBackend
from oomguard._distributed.agreement import Agreement, quiet_ddp
from oomguard._distributed.peers import Outcome, failure_outcome, own_or_peer_failure, peer_failure
from oomguard._effects.early import SpoiledEarlyStep
from oomguard._effects.effects import Effects
from oomguard._effects.transaction import OptimizerTransaction, Scheduler
from oomguard._errors import LossError, NonFiniteLoss, OOMGuardError
from oomguard._ladder.plan import Phase, Plan
from oomguard._step.batch import count_items, split_batch, warn_if_batch_statistics
from oomguard._step.loss import loss_of, loss_value, non_finite, value_of
from oomguard._step.outcome import AttemptFailure, AttemptOutput, Progress
from oomguard._step.outside import OutsideLeaves, Saved

logger = logging.getLogger("oomguard")

__all__ = ["AttemptFailure", "AttemptOutput", "Gradients", "StepRunner", "loss_of", "nothing", "outcome_of"]

Reduction = Literal["mean", "sum"]


@dataclass(frozen=True)
class _Job:
    """One attempt's batch and how to run it."""

    batch: Any
    size: int
    plan: Plan
    backend: MemoryBackend
    scaler: torch.amp.GradScaler | None  # fp16 only
    reduction: Reduction
    commits: bool  # the attempt ends with the optimizer step (not left to the caller)


@dataclass(frozen=True)
class Gradients:
    """An attempt's gradients, accumulated over its micro-batches: what :meth:`StepRunner.commit` steps with."""

    job: _Job
    micro_batches: int
    loss: float


class StepRunner:
    """Runs one training step for a batch on a plan. ``progress`` says where the attempt in flight is (for what
    accounts memory during it: the planner's probe); a failed attempt's record carries it."""

    def __init__(
        self,
        step_fn: Callable[[Any], Any],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Scheduler | None,
        transaction: OptimizerTransaction,
        effects: Effects,
        max_grad_norm: float | None,
        item_counter: Callable[[Any], float],
        reduction: Reduction,
        agreement: Agreement | None = None,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
        accelerator: Any = None,
    ) -> None:
        self.step_fn = step_fn
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.transaction = transaction
        self.effects = effects
        self.max_grad_norm = max_grad_norm
        self.item_counter = item_counter
        self.reduction = reduction
        self.agreement = agreement
        self.ddp = ddp
        self.accelerator = accelerator  # Hugging Face Accelerate: its backward (loss scaling) and clipping
        self._outside = OutsideLeaves(lambda: self._params)
        self._outside_grads: Saved = []  # the gradients of leaves outside the optimizer before this attempt
        #: Bytes of the gradients of every trainable parameter: the part of a step's peak that micro-batching keeps.
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.progress = Progress()  # (a fresh one per attempt)
        #: Called where the attempt's optimizer step begins before its last backward ends (the master level's host
        #: step, :mod:`oomguard._effects.early`): the loop holds shutdown signals from there, as from the step.
        self.step_begins: Callable[[], None] = nothing
        #: Whether a backward accumulated a gradient after its bucket had stepped early (:mod:`oomguard._effects.early`)
        self.early_spoiled = False

    @property
    def _params(self) -> list[torch.Tensor]:
        """Every parameter the optimizer steps, read from its groups at each use: a group added since the guard was
        made (progressive unfreezing) is clipped, checked and averaged over the ranks with the others."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self) -> None:
        """Drop every gradient (set to None, so their memory is freed)."""
        self.model.zero_grad(set_to_none=True)

    def _parts(self, job: _Job) -> tuple[list[Any], list[float]]:
        """The micro-batches and the weight of each one's loss in the batch's loss."""
        size, micro = job.size, job.plan.effective_micro_batch_size(job.size)
        if micro >= size:  # (a mapping of its own: a step that pops its labels leaves them for the next attempt)
            return [copy.copy(job.batch) if isinstance(job.batch, MutableMapping) else job.batch], [1.0]
        warn_if_batch_statistics(self.model, micro)
        parts = split_batch(job.batch, micro)
        if job.reduction == "sum":
            return parts, [1.0] * len(parts)
        counts = count_items(parts, self.item_counter)
        total = sum(counts)
        if total == 0:  # nothing counted anywhere: weigh by samples, as the unsplit mean would
            counts = [float(len_) for len_ in _part_sizes(size, micro)]
            total = float(size)
        return parts, [count / total for count in counts]

    def run(
        self,
        batch: Any,
        size: int,
        plan: Plan,
        backend: MemoryBackend,
        *,
        step: bool = True,
        reduction: Reduction | None = None,
    ) -> AttemptOutput:
        """:meth:`attempt`, raising the error of a failed one (the dry-run planner's way to run a step: nothing
        holds signals around a step of fake tensors)."""
        outcome = self.attempt(batch, size, plan, backend, step=step, reduction=reduction)
        if isinstance(outcome, AttemptFailure):
            raise outcome.error
        return outcome

    def attempt(
        self, batch: Any, size: int, plan: Plan, backend: MemoryBackend, *, step: bool, reduction: Reduction | None
    ) -> AttemptOutput | AttemptFailure:
        """:meth:`gradients` then :meth:`commit`, in one call (where nothing needs to come between the two)."""
        gradients = self.gradients(batch, size, plan, backend, step=step, reduction=reduction)
        return gradients if isinstance(gradients, AttemptFailure) else self.commit(gradients)

    def gradients(
        self,
        batch: Any,
        size: int,
        plan: Plan,
        backend: MemoryBackend,
        *,
        step: bool = True,
        reduction: Reduction | None = None,
    ) -> Gradients | AttemptFailure:
        """Apply the plan, then forward and backward every micro-batch: the batch's gradients, or the record of
        the failure (its gradients dropped, the plan's per-attempt state reset).

        ``step=False``: the caller steps with the gradients itself (the Trainer), :meth:`commit` only reports
        them. ``reduction`` overrides the runner's for this batch. Under distributed training every rank reaches
        the same agreements whatever failed where (see :mod:`oomguard._distributed.agreement`): a rank whose peer
        failed fails too.
        """
        self.progress = Progress()
        self._outside_grads = []
        self.zero_grad()
        backend.reset_peak_memory_stats()  # so the peak read at the end is this attempt's
        self.progress.base = backend.memory_allocated()
        scaler = self.effects.scaler(plan)  # fp16 only; a fresh one per attempt, from the last committed state
        job = _Job(batch, size, plan, backend, scaler, reduction or self.reduction, commits=step)
        try:
            try:
                micro_batches, loss = self._accumulate(job)
            except SpoiledEarlyStep as spoiled:  # (see there: once, then never again for this guard)
                logger.info("oomguard: no step begins during backward from now on (%s); the step runs again", spoiled)
                del spoiled
                self._drop()
                self.early_spoiled = True
                micro_batches, loss = self._accumulate(job)
            return Gradients(job, micro_batches, loss)
        except Exception as exc:
            return self._failed(exc, plan)
        except BaseException:  # an interrupt: what the attempt made is dropped all the same, and it goes on up
            self._drop()
            raise

    def commit(self, gradients: Gradients) -> AttemptOutput | AttemptFailure:
        """Clip, then exactly one optimizer and scheduler step (where the attempt commits): what the attempt
        produced, or the record of its failure (the step undone, the gradients dropped)."""
        job = gradients.job
        try:
            grad_norm = self._clip_and_step(job.plan, job.backend, job.scaler) if job.commits else None
        except Exception as exc:
            return self._failed(exc, job.plan)
        except BaseException:
            self._drop()
            raise
        self._outside_grads = []  # (what they held is the attempt's: not kept past it)
        micro, base = job.plan.effective_micro_batch_size(job.size), self.progress.base
        peak = job.backend.max_memory_allocated()
        return AttemptOutput(gradients.loss, grad_norm, gradients.micro_batches, micro, base, peak)

    def _drop(self) -> None:
        """What a failed attempt made goes: the plan's per-attempt state, the gradients (those of leaves outside
        the optimizer back as they were)."""
        self.effects.reset()
        if self.agreement is not None:
            self.agreement.reset()  # (FSDP2: its iteration state, resharded, no unsharded gradient left)
        self.zero_grad()
        OutsideLeaves.put_back(self._outside_grads)
        self._outside_grads = []

    def _failed(self, error: Exception, plan: Plan) -> AttemptFailure:
        """Drop what the failed attempt made, and say where it failed. (The caller's frame, in the error's
        traceback, must not keep the record: that would be a cycle holding the attempt's tensors.)"""
        self._drop()
        where = self.progress
        verdict = where.verdict
        agreed = verdict.phase if verdict is not None and verdict.outcome != "ok" else None
        return AttemptFailure(error, plan, where.phase, where.micro_batch, where.base, agreed)

    def _clip_and_step(self, plan: Plan, backend: MemoryBackend, scaler: torch.amp.GradScaler | None) -> float | None:
        """Clip, then the optimizer and scheduler steps as one transaction; the gradients are dropped after."""
        grad_norm = self._clip(scaler, backend)
        self.progress.phase = Phase.OPTIMIZER
        self.optimizer_step(plan, backend, scaler)
        self.progress.phase = Phase.DONE
        self.zero_grad()
        return grad_norm

    def optimizer_step(
        self,
        plan: Plan,
        backend: MemoryBackend,
        scaler: torch.amp.GradScaler | None = None,
        *,
        run: Callable[[], None] | None = None,
    ) -> None:
        """The optimizer step of ``plan``, the one way the package steps: through the transaction (undone if it
        raises), inside the plan's effects (optimizer offload steps on the host), with the runner's scheduler and
        ``scaler``, agreed with the other ranks. ``run`` replaces the step itself (the Trainer's own, through
        Accelerate's wrapper). The guard holds shutdown signals around it until the step is counted."""
        with self.effects.optimizer_step(plan, backend):
            # Agreement B, on a step every rank journals where any rank needs to (agreed after its backward).
            agree = self.agreement.after_step if self.agreement is not None else None
            verdict = self.progress.verdict
            allow_fast = verdict is None or not verdict.journal
            if run is not None:  # (the caller's scheduler steps after it, outside the transaction)
                self.transaction.step(backend, agree=agree, allow_fast=allow_fast, run=run)
            else:
                self.transaction.step(backend, self.scheduler, scaler, agree=agree, allow_fast=allow_fast)
                self.effects.commit_scaler(scaler)
            if self.agreement is not None and self.ddp is not None:
                self.agreement.broadcast_buffers(self.ddp)

    def _accumulate(self, job: _Job) -> tuple[int, float]:
        """Apply the plan, then forward and backward every micro-batch; agree with the other ranks. Returns the
        micro-batches run and the batch's loss."""
        failure: Exception | None = None
        micro_batches, total = 0, math.nan
        try:
            with quiet_ddp(self.ddp):
                micro_batches, total = self._forward_backward(job)
            self.effects.after_backward()
        except Exception as exc:
            if self.agreement is None:
                raise
            failure = exc  # re-raised below, once the other ranks know
        if self.agreement is not None:
            outcome: Outcome = "ok" if failure is None else outcome_of(failure, job.backend)
            journal = failure is not None or not self.transaction.can_skip_journal(job.backend)
            verdict = self.progress.verdict = self.agreement.after_backward(outcome, self.progress.phase, journal)
            if verdict.outcome != "ok":
                error = (
                    peer_failure(verdict.outcome, verdict.phase)
                    if failure is None
                    else own_or_peer_failure(failure, outcome, verdict.outcome, verdict.phase)
                )
                # This frame is in the error's traceback: holding the error here too would make a reference
                # cycle that keeps the failed forward's tensors alive until the garbage collector runs.
                failure = None
                try:
                    raise error
                finally:
                    del error
            if self.ddp is not None:
                self.agreement.average_gradients(self._params)
        return micro_batches, total

    def _forward_backward(self, job: _Job) -> tuple[int, float]:
        plan, backend, scaler = job.plan, job.backend, job.scaler
        if self.effects.apply(plan, backend):
            self.transaction.invalidate()  # the step's memory profile changed with the plan
            # Offload moved memory to the host (or restoring brought it back): the attempt's base and peak are
            # measured from here, so the peak model learns what the plan costs, not what applying it freed.
            backend.reset_peak_memory_stats()
            self.progress.base = backend.memory_allocated()
        self.progress.phase = Phase.SPLIT
        parts, weights = self._parts(job)
        total: torch.Tensor | None = None
        last = max((i for i, w in enumerate(weights) if w != 0.0), default=-1)  # (FSDP2 syncs in its backward)
        for index, (part, weight) in enumerate(zip(parts, weights, strict=True)):
            if weight == 0.0:  # no counted item: it contributes exactly nothing (and its mean is NaN)
                continue
            self.progress.phase, self.progress.micro_batch = Phase.FORWARD, index
            # (Before the forward, with nothing of it resident: the step may begin in this backward.)
            early = index == last and self._steps_alone(job) and self.effects.step_early(self.transaction.host_budget)
            if self.agreement is not None:
                self.agreement.micro_batch(last=index == last)
            with self.effects.forward(plan, backend):
                loss = loss_of(self.step_fn(part))
            if total is None:  # the attempt's first backward is next
                self._refuse_a_backward_of_its_own()
                self._outside_grads = self._outside.keep(loss, job.batch)
            self.progress.phase = Phase.BACKWARD
            if early and self.effects.early_backward(loss):  # (what the forward wrote and made, checked first)
                self.step_begins()  # (the loop holds shutdown signals from here: see the attribute)
            weighted = loss if weight == 1.0 else loss * weight
            self._backward(scaler.scale(weighted) if scaler is not None else weighted)
            self.effects.after_micro_batch()  # (still the backward phase: what it moves is per micro-batch)
            contribution = loss.detach().float() * weight
            total = contribution if total is None else total + contribution
            del loss, weighted  # drop the graph's last references before the next micro-batch's forward
        return len(parts), loss_value(total, refuse_non_finite=job.commits and scaler is None)

    def _steps_alone(self, job: _Job) -> bool:
        """Whether this attempt's optimizer step follows its backward with nothing that looks at every gradient
        first (clipping, a scaler, other ranks, a caller's own step): it may begin during the last backward."""
        alone = self.max_grad_norm is None and job.scaler is None and self.agreement is None and not self.early_spoiled
        return alone and job.commits and self.accelerator is None and self.transaction.journal != "never"

    def _refuse_a_backward_of_its_own(self) -> None:
        """The gradients were dropped when the attempt began: any there now, the step function made itself."""
        stepped = sum(1 for p in self._params if p.grad is not None)
        if stepped:
            raise LossError(
                f"the step function ran backward itself: after its forward, {stepped} parameter(s) already hold "
                f"gradients. The guard owns backward (per micro-batch, weighted, once): return the loss without "
                f"calling loss.backward() or accelerator.backward(), or the gradients would be counted twice"
            )

    def _backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)  # scales the loss where Accelerate runs fp16
        else:
            loss.backward()  # type: ignore[no-untyped-call]

    def _clip(self, scaler: torch.amp.GradScaler | None, backend: MemoryBackend) -> float | None:
        """Clip the whole batch's gradient norm; a failure here is agreed like a failed optimizer step."""
        if self.max_grad_norm is None:
            return None
        self.progress.phase = Phase.CLIP
        try:
            if scaler is not None:
                scaler.unscale_(self.optimizer)
            clipped = None if self.agreement is None else self.agreement.clip(self._params, self.max_grad_norm)
            if clipped is not None:  # (FSDP2: the norm of sharded gradients, agreed)
                norm = clipped
            elif self.accelerator is not None:  # unscales first where Accelerate scales the loss
                norm = value_of(self.accelerator.clip_grad_norm_(self._params, self.max_grad_norm))
            else:
                norm = value_of(torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm))
            if scaler is None and not math.isfinite(norm) and detect_fake_mode() is None:
                raise NonFiniteLoss(non_finite("gradient norm", norm))  # (clipping scaled every gradient by it)
            return norm
        except Exception as exc:
            if self.agreement is None:
                raise
            own = outcome_of(exc, backend)  # (the other ranks are about to agree after their step)
            failure = own_or_peer_failure(exc, own, self.agreement.after_step(own), Phase.CLIP)
            if failure is not exc:
                raise failure from None
            raise


def outcome_of(exc: BaseException, backend: MemoryBackend) -> Outcome:
    """What this rank tells the others of its failure: an OOM every rank retries (``"oom"``), host memory that ran
    out (``"host"``: the ranks stop together), or anything else, ours included (``"fatal"``)."""
    if isinstance(exc, OOMGuardError):
        return "fatal"
    return failure_outcome(exc, backend.offloads)


def nothing() -> None:
    """What the runner calls where nothing listens."""


def _part_sizes(size: int, micro: int) -> list[int]:
    return [min(micro, size - start) for start in range(0, size, micro)]
