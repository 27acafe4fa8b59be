"""The guard: run a training step, and on an out-of-memory error free memory and retry one rung down.

The loop itself is tenacity's: an attempt either returns a :class:`StepResult` or a small failure record (the
exception and its frames are already dropped, so nothing of the failed attempt stays alive); tenacity's
``after`` hook frees memory and picks the next plan; its stop condition is the exhausted ladder or a bound on
attempts and time.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tenacity
import torch

from oomguard._batch import batch_size, default_item_counter
from oomguard._blocks import find_blocks
from oomguard._checkpointing import user_checkpointing
from oomguard._detect import is_oom
from oomguard._effects import Effects
from oomguard._errors import GuardConfigError, LadderExhausted, OOMGuardError, RecoveryLimitExceeded
from oomguard._events import (
    Event,
    EventSink,
    ExhaustedEvent,
    FailureSummary,
    FallbackEvent,
    JsonlSink,
    OOMEvent,
    RecoveredEvent,
    log_event,
    logger,
)
from oomguard._memory import MemoryBackend, MemorySnapshot, current_backend, format_bytes, snapshot
from oomguard._plan import Plan
from oomguard._rungs import Rung, RungContext, bf16_supported, resolve_ladder
from oomguard._step import Reduction, StepRunner
from oomguard._transaction import JournalMode, OptimizerTransaction, Scheduler

__all__ = ["GuardSummary", "OOMGuard", "StepResult"]

_EVENTS_KEPT = 10_000  # in memory; the log file keeps everything


@dataclass(frozen=True)
class StepResult:
    """What one guarded call did.

    ``loss`` is the whole batch's loss (weighted exactly across micro-batches); ``rungs`` names the rungs in
    effect for this step (``"micro_batch"`` only when the batch was split); ``ooms`` counts the out-of-memory
    errors caught during this call.
    """

    loss: float
    micro_batch_size: int
    rungs: tuple[str, ...]
    ooms: int
    step: int
    batch_size: int
    micro_batches: int
    plan: Plan
    grad_norm: float | None = None
    seconds_lost: float = 0.0


@dataclass(frozen=True)
class GuardSummary:
    """Which fallbacks a guard needed, and how often. ``str()`` gives a readable paragraph."""

    steps: int
    ooms: int
    fallbacks: dict[str, int]
    recovered_steps: int
    exhausted: int
    seconds_lost: float
    plan: Plan

    def __str__(self) -> str:
        if not self.ooms:
            return f"{self.steps} steps, no out-of-memory error: no fallback was needed."
        needed = ", ".join(f"{name} x{count}" for name, count in self.fallbacks.items()) or "none"
        lines = [
            f"{self.steps} steps, {self.ooms} out-of-memory error(s) caught, {self.recovered_steps} step(s) "
            f"recovered, {self.exhausted} given up; {self.seconds_lost:.1f} s spent on failed attempts.",
            f"Fallbacks needed: {needed}.",
            f"Current plan: {self.plan.describe()}.",
        ]
        return "\n".join(lines)


@dataclass(eq=False)
class _Failed:
    """A failed attempt, as tenacity sees it: the plan and a summary, never the exception."""

    plan: Plan
    summary: FailureSummary
    seconds: float


@dataclass(eq=False)
class _Call:
    """The state of one guarded call across its attempts."""

    batch: Any
    size: int
    backend: MemoryBackend
    tried: list[tuple[Plan, FailureSummary]] = field(default_factory=list)
    seconds_lost: float = 0.0
    exhausted: bool = False


def _flush_autograd_queue(device: torch.device) -> None:
    """Free the gradients a failed backward left queued in autograd's engine.

    When backward raises, the tasks it had queued but not run stay in the engine's per-device ready queue, each
    holding its input gradients, until the next backward on that device drains them. A tiny backward does it
    now, so memory is back to what it was before the attempt.
    """
    try:
        torch.zeros((), device=device, requires_grad=True).mul(1.0).backward()  # type: ignore[no-untyped-call]
    except Exception as exc:  # an OOM here only delays the release to the retry's own backward
        if not is_oom(exc):
            raise


def _no_sleep(_: float) -> None:
    return None


class OOMGuard:
    """Runs a training step and keeps it alive through out-of-memory errors.

    Use it through :func:`oomguard.oom_guard`; the decorated function's ``.guard`` is this object. See that
    function for the arguments.
    """

    def __init__(
        self,
        step_fn: Callable[[Any], Any],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Scheduler | None = None,
        log_file: str | Path | None = None,
        ladder: Iterable[str | Rung] | None = None,
        max_grad_norm: float | None = None,
        count_items: Callable[[Any], float] | None = None,
        reduction: Reduction = "mean",
        max_attempts: int = 256,
        max_recovery_seconds: float | None = 3600.0,
        sinks: Sequence[EventSink] = (),
        step_journal: JournalMode = "auto",
    ) -> None:
        _validate(model, optimizer, scheduler, max_grad_norm, reduction, max_attempts, max_recovery_seconds)
        if step_journal not in ("auto", "always", "never"):
            raise GuardConfigError(f"step_journal must be 'auto', 'always' or 'never', got {step_journal!r}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.ladder = resolve_ladder(ladder)
        self.transaction = OptimizerTransaction(optimizer, step_journal)
        self._device = next(model.parameters()).device
        blocks = find_blocks(model)
        self._rung_context = RungContext(
            batch_size=0,
            num_blocks=len(blocks),
            bf16_supported=bf16_supported(self._device),
            checkpointed=user_checkpointing(model),
        )
        self.effects = Effects(model, optimizer, blocks)
        self._runner = StepRunner(
            step_fn,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            transaction=self.transaction,
            effects=self.effects,
            max_grad_norm=max_grad_norm,
            item_counter=count_items or default_item_counter(model),
            reduction=reduction,
        )
        self._sinks: list[EventSink] = [JsonlSink(log_file)] if log_file is not None else []
        self._sinks.extend(sinks)
        self._plan = Plan()
        self._plan_rung: str | None = None
        self._steps = 0
        self._events: collections.deque[Event] = collections.deque(maxlen=_EVENTS_KEPT)
        self._fallbacks: collections.Counter[str] = collections.Counter()
        self._ooms = 0
        self._recovered = 0
        self._exhausted = 0
        self._seconds_lost = 0.0
        stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(max_attempts) | _stop_if_exhausted
        if max_recovery_seconds is not None:
            stop = stop | tenacity.stop_after_delay(max_recovery_seconds)
        self._max_attempts = max_attempts
        self._max_seconds = max_recovery_seconds
        self._retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda outcome: isinstance(outcome, _Failed)),
            stop=stop,
            after=self._recover,
            retry_error_callback=self._give_up,
            wait=tenacity.wait_none(),
            sleep=_no_sleep,
        )

    # -- public state -----------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan the next call starts from. Assign a :class:`Plan` to start from a known one."""
        return self._plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        if not isinstance(plan, Plan):
            raise GuardConfigError(f"guard.plan takes an oomguard.Plan, got {type(plan).__name__}")
        self._plan, self._plan_rung = plan, None

    @property
    def steps(self) -> int:
        """Successful calls so far (each one optimizer step)."""
        return self._steps

    @property
    def events(self) -> list[Event]:
        """Events so far (the most recent 10,000; the log file keeps all)."""
        return list(self._events)

    def close(self) -> None:
        """Undo every effect of the current plan (checkpointing off, offloaded tensors back on the device).

        The guard stays usable: the next call re-applies its plan.
        """
        self.effects.close()

    def summary(self) -> GuardSummary:
        """Which fallbacks were needed and how often."""
        return GuardSummary(
            steps=self._steps,
            ooms=self._ooms,
            fallbacks=dict(self._fallbacks),
            recovered_steps=self._recovered,
            exhausted=self._exhausted,
            seconds_lost=self._seconds_lost,
            plan=self._plan,
        )

    # -- the loop ---------------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> StepResult:
        """Train on ``batch``: one optimizer step, however many attempts and micro-batches it takes."""
        size = batch_size(batch)  # raises BatchSplitError for a batch that could never be split
        call = _Call(batch=batch, size=size, backend=current_backend(self._device))
        result = self._retrying(self._attempt, call)
        if not isinstance(result, StepResult):  # tenacity returns a failure only through _give_up, which raises
            raise AssertionError(f"unexpected attempt outcome {result!r}")
        return result

    def _attempt(self, call: _Call) -> StepResult | _Failed:
        plan = self._plan
        started = time.perf_counter()
        try:
            output = self._runner.run(call.batch, call.size, plan, call.backend)
        except Exception as exc:
            if isinstance(exc, OOMGuardError) or not is_oom(exc):  # ours may wrap an OOM: never retry them
                raise
            # Keep a summary only; leaving this block drops the exception, its traceback and the frames of
            # the failed forward/backward (and with them the autograd graph).
            summary = FailureSummary.from_exception(
                exc, self._runner.phase, self._runner.micro_batch, snapshot(call.backend)
            )
        else:
            return self._succeed(call, plan, output.loss, output.grad_norm, output.micro_batches)
        return _Failed(plan, summary, time.perf_counter() - started)

    def _succeed(self, call: _Call, plan: Plan, loss: float, grad_norm: float | None, micro_batches: int) -> StepResult:
        step = self._steps
        self._steps += 1
        ooms = len(call.tried)
        result = StepResult(
            loss=loss,
            micro_batch_size=plan.effective_micro_batch_size(call.size),
            rungs=plan.rungs(call.size),
            ooms=ooms,
            step=step,
            batch_size=call.size,
            micro_batches=micro_batches,
            plan=plan,
            grad_norm=grad_norm,
            seconds_lost=call.seconds_lost,
        )
        if ooms:
            self._recovered += 1
            self._emit(
                RecoveredEvent(
                    step=step,
                    plan=plan.to_dict(),
                    memory=snapshot(call.backend),
                    rungs=result.rungs,
                    ooms=ooms,
                    seconds_lost=call.seconds_lost,
                    description=plan.describe(call.size),
                )
            )
        return result

    def _recover(self, retry_state: tenacity.RetryCallState) -> None:
        """After a failed attempt: free what it held, log it, and move one rung down."""
        call: _Call = retry_state.args[0]
        failed = retry_state.outcome.result() if retry_state.outcome is not None else None
        if not isinstance(failed, _Failed):
            raise AssertionError("tenacity retried an attempt that did not fail")
        self._runner.zero_grad()
        if failed.summary.phase == "backward":
            _flush_autograd_queue(self._device)
        gc.collect()  # frames of the failed attempt may sit in reference cycles
        call.backend.empty_cache()
        freed = snapshot(call.backend)
        call.tried.append((failed.plan, failed.summary))
        call.seconds_lost += failed.seconds
        self._ooms += 1
        self._seconds_lost += failed.seconds
        self._emit(
            OOMEvent(
                step=self._steps,
                plan=failed.plan.to_dict(),
                memory=failed.summary.memory,
                attempt=retry_state.attempt_number,
                rung=self._plan_rung,
                error=failed.summary,
                memory_after_recovery=freed,
            )
        )
        context = dataclasses.replace(
            self._rung_context, batch_size=call.size, phase=failed.summary.phase, can_offload=call.backend.offloads
        )
        cheaper = self.ladder.next(failed.plan, context)
        if cheaper is None:
            call.exhausted = True
            return
        rung, plan = cheaper
        self._plan, self._plan_rung = plan, rung.name
        self._fallbacks[rung.name] += 1
        self._emit(
            FallbackEvent(
                step=self._steps,
                plan=plan.to_dict(),
                memory=freed,
                rung=rung.name,
                previous_plan=failed.plan.to_dict(),
                memory_at_failure=failed.summary.memory,
                description=f"{failed.plan.describe(call.size)} -> {plan.describe(call.size)}",
            )
        )

    def _give_up(self, retry_state: tenacity.RetryCallState) -> StepResult:
        call: _Call = retry_state.args[0]
        memory = snapshot(call.backend)
        error: type[LadderExhausted | RecoveryLimitExceeded]
        if call.exhausted:
            reason, error = "ladder", LadderExhausted
        elif self._max_seconds is not None and (retry_state.seconds_since_start or 0.0) >= self._max_seconds:
            reason, error = "time", RecoveryLimitExceeded
        else:
            reason, error = "attempts", RecoveryLimitExceeded
        self._exhausted += 1
        self._emit(
            ExhaustedEvent(
                step=self._steps,
                plan=self._plan.to_dict(),
                memory=memory,
                reason=reason,
                ooms=len(call.tried),
                tried=tuple(plan.to_dict() for plan, _ in call.tried),
            )
        )
        raise error(
            self._give_up_message(call, reason, memory), step=self._steps, tried=tuple(call.tried), memory=memory
        )

    def _give_up_message(self, call: _Call, reason: str, memory: MemorySnapshot) -> str:
        last = call.tried[-1][1]
        headline = {
            "ladder": "every plan on the ladder ran out of memory",
            "attempts": f"the bound of {self._max_attempts} attempts was reached",
            "time": f"the bound of {self._max_seconds} s of recovery was reached",
        }[reason]
        tried = "\n".join(
            f"  {i}. {plan.describe(call.size)}: {summary.describe()}"
            for i, (plan, summary) in enumerate(call.tried, 1)
        )
        fix = {
            "ladder": (
                f"lower the batch size or sequence length, add rungs to ladder= (in use: "
                f"{', '.join(self.ladder.names) or 'none'}), or use a smaller model or a larger GPU"
            ),
            "attempts": "raise max_attempts=, or lower the batch size so fewer fallbacks are needed",
            "time": "raise max_recovery_seconds=, or lower the batch size so fewer fallbacks are needed",
        }[reason]
        return (
            f"oomguard gave up on step {self._steps} (a batch of {call.size} sample(s)): {headline}; the model, "
            f"optimizer and scheduler are unchanged.\nTried:\n{tried}\n"
            f"Memory: capacity {format_bytes(last.memory.capacity)}, in use {format_bytes(last.memory.allocated)} "
            f"at the last failure, tried to allocate {format_bytes(last.requested_bytes)}; "
            f"{format_bytes(memory.allocated)} in use after freeing.\nWhat you can do: {fix}."
        )

    def _emit(self, event: Event) -> None:
        self._events.append(event)
        log_event(event)
        for sink in self._sinks:
            try:
                sink(event)
            except Exception:  # a broken sink must not kill a long training job
                logger.exception("oomguard: event sink %r failed", sink)


class _StopIfExhausted(tenacity.stop.stop_base):
    """Stop once the ladder has nothing cheaper to offer for this call."""

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        call: _Call = retry_state.args[0]
        return call.exhausted


_stop_if_exhausted = _StopIfExhausted()


def _validate(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    max_grad_norm: float | None,
    reduction: str,
    max_attempts: int,
    max_recovery_seconds: float | None,
) -> None:
    if not isinstance(model, torch.nn.Module):
        raise GuardConfigError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise GuardConfigError(f"optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    model_params = {id(p) for p in model.parameters()}
    if not model_params:
        raise GuardConfigError(
            f"the model ({type(model).__name__}) has no parameters, so there is nothing to train or guard"
        )
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params)
    if foreign:
        raise GuardConfigError(
            f"the optimizer holds {foreign} parameter(s) that are not the model's: build it over "
            f"model.parameters() (the guard drops and recomputes the model's gradients on every retry)"
        )
    if scheduler is not None:
        if not callable(getattr(scheduler, "step", None)):
            raise GuardConfigError(f"scheduler= needs a .step() method, got {type(scheduler).__name__}")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise GuardConfigError("scheduler= was built over a different optimizer than optimizer=")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise GuardConfigError(f"max_grad_norm must be positive (or None to disable clipping), got {max_grad_norm!r}")
    if reduction not in ("mean", "sum"):
        raise GuardConfigError(f"reduction must be 'mean' or 'sum' (how the step's loss reduces), got {reduction!r}")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise GuardConfigError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
    if max_recovery_seconds is not None and not max_recovery_seconds > 0:
        raise GuardConfigError(f"max_recovery_seconds must be positive or None, got {max_recovery_seconds!r}")
