"""The guard: run a training step, and on an out-of-memory error free memory and retry one rung down.

The loop itself is tenacity's: an attempt either returns a :class:`StepResult` or a small failure record (the
exception and its frames are already dropped, so nothing of the failed attempt stays alive); tenacity's
``after`` hook frees memory and picks the next plan; its stop condition is the exhausted ladder or a bound on
attempts and time. Which plan a call starts from — per batch bucket, stepping back up after clean steps,
sized by measured peaks, remembered across restarts — is the plan book's business.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import tenacity
import torch

from oomguard._backends.memory import MemoryBackend, current_backend, snapshot
from oomguard._backends.telemetry import apply_expandable_segments
from oomguard._detect import is_oom
from oomguard._distributed.agreement import Agreement, ddp_of, distributed_active, unwrap
from oomguard._effects.blocks import find_blocks
from oomguard._effects.checkpointing import user_checkpointing
from oomguard._effects.effects import Effects
from oomguard._effects.transaction import JournalMode, OptimizerTransaction, Scheduler
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
    RelaxEvent,
    log_event,
    logger,
)
from oomguard._guard.buckets import PlanBook, batch_bucket, grad_bytes, items_per_sample
from oomguard._guard.persist import PlanStore, model_fingerprint
from oomguard._guard.recovery import Call, Failed, free_failed_attempt, give_up_message, stop_if_exhausted
from oomguard._guard.results import GuardSummary, StepResult
from oomguard._ladder.plan import RUNG_ORDER, Plan
from oomguard._ladder.predict import PeakModel
from oomguard._ladder.rungs import Rung, RungContext, bf16_supported, resolve_ladder
from oomguard._options import check_optional_positive_int, validate
from oomguard._step.batch import batch_size, default_item_counter
from oomguard._step.runner import Reduction, StepRunner

__all__ = ["OOMGuard"]

_EVENTS_KEPT = 10_000  # in memory; the log file keeps everything


def _no_sleep(_: float) -> None:
    return None


_FIELDS = {"amp": "precision", "checkpointing": "checkpointing", "activation_offload": "activation_offload"}


def _given_back(previous: Plan, cheaper: Plan) -> str:
    """The rung a relaxation gives back (``micro_batch`` when only the micro-batches grew)."""
    for name in reversed(RUNG_ORDER[1:]):
        attribute = _FIELDS.get(name, "offload_layers")
        if getattr(previous, attribute) != getattr(cheaper, attribute):
            return str(name)
    return "micro_batch"


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
        state_file: str | Path | None = None,
        relax_after: int | None = 200,
        predictive: bool = True,
        bucket: Callable[[Any], int] = batch_bucket,
        log_every: int | None = 10,
        fix_fragmentation: bool = False,
        accelerator: Any = None,
        preplan: bool = False,
        _steps: bool = True,
    ) -> None:
        validate(model, optimizer, scheduler, max_grad_norm, reduction, max_attempts, max_recovery_seconds)
        if step_journal not in ("auto", "always", "never"):
            raise GuardConfigError(f"step_journal must be 'auto', 'always' or 'never', got {step_journal!r}")
        check_optional_positive_int("relax_after", relax_after)
        check_optional_positive_int("log_every", log_every)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.ladder = resolve_ladder(ladder)
        self.transaction = OptimizerTransaction(optimizer, step_journal)
        self._device = next(model.parameters()).device
        self._ddp = ddp_of(model)
        core = unwrap(model)  # rungs change the module inside DDP, never the wrapper
        blocks = find_blocks(core)
        self._rung_context = RungContext(
            batch_size=0,
            num_blocks=len(blocks),
            bf16_supported=bf16_supported(self._device),
            checkpointed=user_checkpointing(core),
            amp_available=accelerator is None or getattr(accelerator, "mixed_precision", "no") == "no",
        )
        self.effects = Effects(core, optimizer, blocks)
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
            ddp=self._ddp,
            accelerator=accelerator,
            steps=_steps,
        )
        self._log_file = log_file
        self._sinks: list[EventSink] = list(sinks)
        self._book = PlanBook(relax_after, PeakModel() if predictive else None)
        self._state_file = state_file
        self._bucket = bucket
        self._log_every = log_every
        self._fix_fragmentation = fix_fragmentation
        self._step_fn, self._max_grad_norm, self._preplan = step_fn, max_grad_norm, preplan
        self._grad_bytes = grad_bytes(core)
        self._started = False
        self._last_bucket: int | None = None
        self._last_plan = Plan()
        self._plan_rung: str | None = None
        self._steps = 0
        self._events: collections.deque[Event] = collections.deque(maxlen=_EVENTS_KEPT)
        self._fallbacks: collections.Counter[str] = collections.Counter()
        self._steps_by_rung: collections.Counter[str] = collections.Counter()
        self._relaxations = [0, 0]
        self._ooms = 0
        self._recovered = 0
        self._exhausted = 0
        self._seconds_lost = 0.0
        stop = tenacity.stop_after_attempt(max_attempts) | stop_if_exhausted
        self._max_attempts = max_attempts
        self._max_seconds = max_recovery_seconds
        self._retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda outcome: isinstance(outcome, Failed)),
            stop=stop,
            after=self._recover,
            retry_error_callback=self._give_up,
            wait=tenacity.wait_none(),
            sleep=_no_sleep,
        )

    # -- public state -----------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan of the last call (its batch bucket's plan). Assign a :class:`Plan` to start every bucket on it."""
        return self._last_plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        if not isinstance(plan, Plan):
            raise GuardConfigError(f"guard.plan takes an oomguard.Plan, got {type(plan).__name__}")
        self._book.reset(plan)
        self._last_plan, self._plan_rung = plan, None

    @property
    def plans(self) -> dict[int, Plan]:
        """The plan of every batch bucket seen so far (and those loaded from the state file)."""
        return self._book.plans()

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
            plan=self._last_plan,
            relaxations=(self._relaxations[0], self._relaxations[1]),
            steps_by_rung=dict(self._steps_by_rung),
        )

    # -- the loop ---------------------------------------------------------------------------------------
    def _start(self, backend: MemoryBackend, batch: Any) -> None:
        """First call: join the process group if there is one, open the log, load the state file, preplan."""
        if self._started:
            return
        self._started = True
        rank = 0
        if distributed_active():
            self._runner.agreement = Agreement(self._device)
            rank = self._runner.agreement.rank
        if self._log_file is not None:  # one log per rank: rank k > 0 writes NAME.rank<k>.jsonl beside it
            path = Path(self._log_file)
            self._sinks.insert(0, JsonlSink(path if rank == 0 else path.with_suffix(f".rank{rank}{path.suffix}")))
        if self._state_file is not None:  # every rank reads the plans; only rank 0 writes them
            fingerprint = model_fingerprint(unwrap(self.model))
            self._book.load(PlanStore(self._state_file, fingerprint, backend.identity(), writable=rank == 0))
        if self._preplan and not self._book.plans():  # a remembered plan beats a predicted one
            self._start_on_planned(backend, batch)

    def _start_on_planned(self, backend: MemoryBackend, batch: Any) -> None:
        """``preplan=True``: start from the dry-run planner's recommendation for the first batch."""
        from oomguard._planner.fakes import preplan  # the planner drives a guard of its own

        report = preplan(
            self._step_fn, batch, model=self.model, optimizer=self.optimizer, backend=backend,
            ladder=self.ladder.rungs, max_grad_norm=self._max_grad_norm, bf16=self._rung_context.bf16_supported,
            distributed=self._runner.agreement is not None,
        )  # fmt: skip
        if report is not None and report.recommended is not None:
            self.plan = report.recommended

    def __call__(self, batch: Any) -> StepResult:
        """Train on ``batch``: one optimizer step, however many attempts and micro-batches it takes."""
        size = batch_size(batch)  # raises BatchSplitError for a batch that could never be split
        backend = current_backend(self._device)
        self._start(backend, batch)
        per_sample = items_per_sample(batch, size)
        choice = self._book.choose(self._bucket(batch), size, lambda plan: self._predict(plan, backend, per_sample))
        agreement = self._runner.agreement
        if agreement is not None:  # every rank starts the call on the same plan
            agreed = agreement.plan(choice.plan, size)
            if agreed != choice.plan:
                choice = dataclasses.replace(choice, plan=agreed, relaxing=False, fallback=None)
        call = Call(batch, size, backend, choice, choice.plan, per_sample)
        self._last_bucket = choice.bucket
        result = self._retrying(self._attempt, call)
        if not isinstance(result, StepResult):  # tenacity returns a failure only through _give_up, which raises
            raise AssertionError(f"unexpected attempt outcome {result!r}")
        return result

    def protected_step(self, run: Callable[[], None], replay: Callable[[], None]) -> None:
        """An optimizer step driven from outside the guard (the Trainer's), made undoable and recoverable.

        ``run`` steps the optimizer; on an OOM it is undone, the guard recovers one rung down (the phase is the
        optimizer step, so the ladder skips to what relieves it), ``replay`` recomputes the gradients of the same
        batch on the new plan, and the step runs again: still exactly one committed step.
        """
        backend = current_backend(self._device)
        tried: list[tuple[Plan, FailureSummary]] = []
        for attempt in range(1, self._max_attempts + 1):
            started = time.perf_counter()
            try:
                self.transaction.step(backend, run=run)
                return
            except Exception as exc:
                if isinstance(exc, OOMGuardError) or not is_oom(exc):
                    raise
                summary = FailureSummary.from_exception(exc, "optimizer", 0, snapshot(backend))
            # Outside the except block: the exception and its frames are gone.
            plan = self._last_plan
            free_failed_attempt(self._runner, backend, self._device, "optimizer", base=None)
            tried.append((plan, summary))
            seconds = time.perf_counter() - started
            self._ooms += 1
            self._seconds_lost += seconds
            memory = snapshot(backend)
            self._emit(
                OOMEvent(
                    self._steps, plan.to_dict(), summary.memory, attempt, self._plan_rung, summary, memory, seconds
                )
            )
            context = dataclasses.replace(
                self._rung_context, batch_size=1, phase="optimizer", can_offload=backend.offloads
            )
            cheaper = self.ladder.next(plan, context)
            if cheaper is None or self._last_bucket is None:
                raise LadderExhausted(
                    f"oomguard: the optimizer step ran out of memory on every plan ({len(tried)} tried); the model "
                    f"and optimizer are unchanged. Lower the batch size, add layer_offload to ladder=, or use a "
                    f"smaller model or a larger GPU.",
                    step=self._steps,
                    tried=tuple(tried),
                    memory=memory,
                )
            rung, new_plan = cheaper
            self._book.escalated(self._last_bucket, new_plan)
            self._last_plan, self._plan_rung = new_plan, rung.name
            self._fallbacks[rung.name] += 1
            self._emit(
                FallbackEvent(
                    self._steps, new_plan.to_dict(), memory, rung.name, plan.to_dict(), summary.memory,
                    f"{plan.describe()} -> {new_plan.describe()}",
                )
            )  # fmt: skip
            replay()
        raise RecoveryLimitExceeded(
            f"oomguard: the bound of {self._max_attempts} attempts was reached for one optimizer step; the model "
            f"and optimizer are unchanged. Raise max_attempts= or lower the batch size.",
            step=self._steps,
            tried=tuple(tried),
            memory=snapshot(backend),
        )

    def _predict(self, plan: Plan, backend: MemoryBackend, per_sample: float) -> int | None:
        """The largest micro-batch the peak model predicts for ``plan`` on ``backend`` now, if it can tell."""
        predictor, capacity = self._book.predictor, backend.total_memory()
        if predictor is None or capacity is None or not backend.tracks_allocations:
            return None
        return predictor.max_micro_batch(plan, capacity, backend.memory_allocated(), per_sample, self._grad_bytes)

    def _attempt(self, call: Call) -> StepResult | Failed:
        plan = call.plan
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
            predictor = self._book.predictor
            if predictor is not None and call.backend.tracks_allocations:
                items = round(output.micro_batch_size * call.items_per_sample)
                predictor.record_success(plan, items, output.peak - output.base, self._grad_bytes)
            return self._succeed(call, plan, output.loss, output.grad_norm, output.micro_batches, output.peak)
        return Failed(plan, summary, time.perf_counter() - started, self._runner.base)

    def _succeed(
        self, call: Call, plan: Plan, loss: float, grad_norm: float | None, micro_batches: int, peak: int
    ) -> StepResult:
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
        self._last_plan = plan
        self._steps_by_rung.update(result.rungs or ("none",))
        choice = call.choice
        self._book.succeeded(choice, plan)
        if choice.relaxing and plan == choice.plan:
            self._relaxations[0] += 1
            self._emit_relax(call, "held")
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
        if self._log_every is not None and (step % self._log_every == 0 or ooms):
            memory = dataclasses.replace(snapshot(call.backend), peak=peak)
            self._emit(ProgressEvent(step, plan.to_dict(), memory, loss, choice.bucket, dict(self._steps_by_rung)))
        return result

    def _emit_relax(self, call: Call, outcome: str) -> None:
        choice = call.choice
        assert choice.fallback is not None
        self._emit(
            RelaxEvent(
                step=self._steps - (outcome == "held"),
                plan=choice.plan.to_dict(),
                memory=snapshot(call.backend),
                rung=_given_back(choice.fallback, choice.plan),
                previous_plan=choice.fallback.to_dict(),
                outcome=outcome,
                next_try_after=self._book.next_try_after(choice.bucket),
                description=f"{choice.fallback.describe(call.size)} -> {choice.plan.describe(call.size)}",
            )
        )

    def _recover(self, retry_state: tenacity.RetryCallState) -> None:
        """After a failed attempt: free what it held, log it, and move one rung down."""
        call: Call = retry_state.args[0]
        failed = retry_state.outcome.result() if retry_state.outcome is not None else None
        if not isinstance(failed, Failed):
            raise AssertionError("tenacity retried an attempt that did not fail")
        cleanup_started = time.perf_counter()
        backend = call.backend
        free_failed_attempt(self._runner, backend, self._device, failed.summary.phase, failed.base)
        freed = snapshot(backend)
        call.tried.append((failed.plan, failed.summary))
        lost = failed.seconds + time.perf_counter() - cleanup_started  # the attempt and the cleanup after it
        call.seconds_lost += lost
        self._ooms += 1
        self._seconds_lost += lost
        telemetry = call.backend.telemetry(failed.summary.requested_bytes)
        if self._fix_fragmentation and telemetry and telemetry.get("fragmentation"):
            apply_expandable_segments()
        self._emit(
            OOMEvent(
                step=self._steps,
                plan=failed.plan.to_dict(),
                memory=failed.summary.memory,
                attempt=retry_state.attempt_number,
                rung=self._plan_rung,
                error=failed.summary,
                memory_after_recovery=freed,
                seconds=lost,
                telemetry=telemetry,
            )
        )
        self._learn_from_failure(call, failed)
        agreement, verdict = self._runner.agreement, self._runner.verdict
        time_up = self._max_seconds is not None and time.monotonic() - call.started >= self._max_seconds
        call.time_up = agreement.any(time_up) if agreement is not None else time_up
        if call.choice.relaxing and failed.plan == call.choice.plan:  # the try at a cheaper plan: go back
            call.plan = self._book.relax_failed(call.choice)
            self._relaxations[1] += 1
            self._emit_relax(call, "failed")
            return
        context = dataclasses.replace(
            self._rung_context,
            batch_size=call.size,
            # Under distributed training every rank escalates from the same agreed figures, so all
            # reach the same plan: the deepest phase any rank failed in, and no per-rank prediction.
            phase=verdict.phase if verdict is not None and verdict.outcome != "ok" else failed.summary.phase,
            can_offload=call.backend.offloads,
            max_micro_batch=(
                None if agreement is not None else self._predict(failed.plan, call.backend, call.items_per_sample)
            ),
        )
        cheaper = self.ladder.next(failed.plan, context)
        if cheaper is None:
            call.exhausted = True
            return
        rung, plan = cheaper
        call.plan, self._plan_rung = plan, rung.name
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

    def _learn_from_failure(self, call: Call, failed: Failed) -> None:
        predictor, capacity = self._book.predictor, call.backend.total_memory()
        if predictor is None or capacity is None or not call.backend.tracks_allocations:
            return
        items = round(failed.plan.effective_micro_batch_size(call.size) * call.items_per_sample)
        predictor.record_failure(failed.plan, items, capacity, failed.base, self._grad_bytes)

    def _give_up(self, retry_state: tenacity.RetryCallState) -> StepResult:
        call: Call = retry_state.args[0]
        memory = snapshot(call.backend)
        error: type[LadderExhausted | RecoveryLimitExceeded]
        if call.exhausted:
            reason, error = "ladder", LadderExhausted
        elif call.time_up:
            reason, error = "time", RecoveryLimitExceeded
        else:
            reason, error = "attempts", RecoveryLimitExceeded
        self._exhausted += 1
        self._emit(
            ExhaustedEvent(
                step=self._steps,
                plan=call.plan.to_dict(),
                memory=memory,
                reason=reason,
                ooms=len(call.tried),
                tried=tuple(plan.to_dict() for plan, _ in call.tried),
            )
        )
        message = give_up_message(
            call, reason, memory, step=self._steps, max_attempts=self._max_attempts, max_seconds=self._max_seconds,
            rungs=", ".join(self.ladder.names),
        )  # fmt: skip
        raise error(message, step=self._steps, tried=tuple(call.tried), memory=memory)

    def _emit(self, event: Event) -> None:
        self._events.append(event)
        log_event(event)
        for sink in self._sinks:
            try:
                sink(event)
            except Exception:  # a broken sink must not kill a long training job
                logger.exception("oomguard: event sink %r failed", sink)
