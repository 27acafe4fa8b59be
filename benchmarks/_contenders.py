"""The contenders, each run on one scenario under its SimulatedGPU budget, and what each run is measured by.

* ``reference``: a hand-written step (forward, backward, ``optimizer.step()``) with no budget (a SimulatedGPU of
  1 TiB, so its step time carries the same simulator overhead as everyone else's).
* ``accelerate``: Hugging Face Accelerate's ``find_executable_batch_size`` exactly as its documentation shows it:
  the whole training loop (model, optimizer, dataloader built inside) is decorated; on an OOM the decorator
  shrinks the batch size (the current release multiplies it by 0.9) and restarts the loop from the beginning.
* ``composer``: the re-creation of Composer's automatic micro-batching in ``_composer_rule.py``.
* ``oomguard`` and ``oomguard_preplan``: ``oom_guard(model=..., optimizer=...)`` with its default ladder,
  without and with ``preplan=True``.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from _composer_rule import AutoMicrobatching
from _scenarios import LR, Batch, Scenario
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size
from accelerate.utils.memory import should_reduce_batch_size

from oomguard import GuardedStep, Plan, oom_guard
from oomguard.testing import SimulatedGPU

__all__ = ["CONTENDERS", "RunRecord", "run_reference"]

_UNLIMITED = 2**40


@dataclass
class RunRecord:
    """What one contender did on one scenario. Times are seconds; ``None`` where it does not apply."""

    contender: str
    finished: bool
    failure: str | None
    steps: int
    final_batch_size: int
    ooms_before_first_step: int | None
    ooms_total: int
    wasted_s: float
    wall_s: float
    settled: str
    step_s: float | None
    planning_s: float | None = None
    eval_loss: float | None = None
    eval_loss_delta: float | None = None
    weight_distance: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Trace:
    """The course of a run over the scenario's batches."""

    started: float = field(default_factory=time.perf_counter)
    times: list[float] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    ooms_before_first_step: int | None = None
    failure: str | None = None
    wall: float = 0.0

    def settled(self, long_at: int | None) -> str:
        if self.failure is not None:
            return f"none (last plan that fitted: {self.plans[-1]})" if self.plans else "none"
        last = self.plans[-1]
        if long_at is not None and len(self.plans) >= long_at and self.plans[long_at - 1] != last:
            return f"{last}; long batch: {self.plans[long_at - 1]}"
        return last

    def step_s(self) -> float | None:
        """The median step time, leaving out the first step (it creates Adam's state, may plan or recover)."""
        if self.failure is not None or not self.times:
            return None
        return statistics.median(self.times[1:] or self.times)


def _failure(error: BaseException) -> str:
    """Why a run stopped, in one line: the error type and the first sentences of its message."""
    text = ""
    for sentence in str(error).replace("\n", " ").split(". "):
        if text and len(text) + len(sentence) > 100:
            break
        text = f"{text}. {sentence}" if text else sentence
    return f"{type(error).__name__}: {text.strip().rstrip('.')}"


def _drive(batches: list[Batch], step: Callable[[Batch], str], ooms: Callable[[], int]) -> _Trace:
    """Call ``step`` on every batch in turn (it returns the plan it ran); stop at the first error."""
    trace = _Trace()
    for batch in batches:
        started = time.perf_counter()
        try:
            trace.plans.append(step(batch))
        except Exception as error:  # a contender gave up: that is a result, recorded, not a crash
            trace.failure = _failure(error)
            break
        trace.times.append(time.perf_counter() - started)
        if trace.ooms_before_first_step is None:
            trace.ooms_before_first_step = ooms()
    trace.wall = time.perf_counter() - trace.started
    return trace


def _record(name: str, scenario: Scenario, trace: _Trace, ooms: int, wasted: float) -> RunRecord:
    return RunRecord(
        contender=name, finished=trace.failure is None, failure=trace.failure, steps=len(trace.times),
        final_batch_size=scenario.spec.batch_size, ooms_before_first_step=trace.ooms_before_first_step,
        ooms_total=ooms, wasted_s=wasted, wall_s=trace.wall, settled=trace.settled(scenario.spec.long_at),
        step_s=trace.step_s(),
    )  # fmt: skip


def _fresh(scenario: Scenario) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(scenario.template)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def run_reference(scenario: Scenario) -> tuple[RunRecord, torch.nn.Module]:
    """The hand-written step with no memory budget; returns its record and its trained model."""
    model, optimizer = _fresh(scenario)

    def step(batch: Batch) -> str:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return "whole batch"

    with SimulatedGPU(_UNLIMITED) as gpu:
        gpu.adopt(model)
        trace = _drive(scenario.batches, step, lambda: 0)
    return _record("reference", scenario, trace, 0, 0.0), model


def run_composer(scenario: Scenario) -> tuple[RunRecord, torch.nn.Module]:
    model, optimizer = _fresh(scenario)
    size = scenario.spec.batch_size
    rule = AutoMicrobatching(model, optimizer, size)

    def step(batch: Batch) -> str:
        outcome = rule.train_batch(batch)
        return Plan(micro_batch_size=outcome.microbatch_size).describe(size)

    with SimulatedGPU(scenario.capacity) as gpu:
        gpu.adopt(model)
        trace = _drive(scenario.batches, step, lambda: rule.ooms)
    return _record("composer", scenario, trace, rule.ooms, rule.seconds_lost), model


class _PreplanClock(logging.Handler):
    """Notes when the guard logs its preplan outcome (its ``planned`` event's line, ``step 0: preplan: ...``, or
    the planner's warning, ``preplan: ...``): the dry run's time is from the first call to then."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and "preplan:" in record.getMessage():
            self.at = time.perf_counter()

    @contextmanager
    def attached(self) -> Iterator[None]:
        logger = logging.getLogger("oomguard")
        level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)


class _LostTime:
    """A guard event sink: in each call, the time from its start until its last fallback was decided.

    That span is the call's failed attempts plus the recovery after each (the guard's own ``seconds_lost``
    counts the attempts only), measured the way the peers' lost time is: up to the moment the retry can start.
    """

    def __init__(self, preplan: _PreplanClock) -> None:
        self.total, self._preplan, self._started = 0.0, preplan, 0.0
        self._last: float | None = None

    def begin(self) -> None:
        self._started, self._last = time.perf_counter(), None

    def __call__(self, event: Any) -> None:
        if event.kind == "fallback":
            self._last = time.perf_counter()

    def settle(self) -> None:
        if self._last is not None:  # the first call's dry run (preplan) is not a failed attempt
            self.total += self._last - max(self._started, self._preplan.at or 0.0)


def _run_guard(scenario: Scenario, preplan: bool) -> tuple[RunRecord, torch.nn.Module]:
    model, optimizer = _fresh(scenario)
    clock = _PreplanClock()
    lost = _LostTime(clock)
    guarded: GuardedStep[Batch] = oom_guard(
        lambda batch: model(**batch), model=model, optimizer=optimizer, preplan=preplan, sinks=[lost]
    )

    def step(batch: Batch) -> str:
        lost.begin()
        try:
            result = guarded(batch)
        finally:
            lost.settle()
        return result.plan.describe(result.batch_size)

    with SimulatedGPU(scenario.capacity) as gpu, clock.attached():
        gpu.adopt(model)
        trace = _drive(scenario.batches, step, lambda: guarded.guard.summary().ooms)
        gpu.capacity = _UNLIMITED  # the run is over: lift the budget so the plan can be undone for evaluation
        guarded.guard.close()
    name = "oomguard_preplan" if preplan else "oomguard"
    record = _record(name, scenario, trace, guarded.guard.summary().ooms, lost.total)
    if preplan and clock.at is not None:
        record.planning_s = clock.at - trace.started
    return record, model


def run_oomguard(scenario: Scenario) -> tuple[RunRecord, torch.nn.Module]:
    return _run_guard(scenario, preplan=False)


def run_oomguard_preplan(scenario: Scenario) -> tuple[RunRecord, torch.nn.Module]:
    return _run_guard(scenario, preplan=True)


@dataclass
class _Attempts:
    """Accelerate's restarts: each attempt's batch size and start, and the step times of the current one."""

    sizes: list[int] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    ooms: int = 0
    ooms_before_first_step: int | None = None

    def begin(self, batch_size: int) -> None:
        self.sizes.append(batch_size)
        self.starts.append(time.perf_counter())
        self.times, self.plans = [], []

    def stepped(self, seconds: float, batch_size: int) -> None:
        self.times.append(seconds)
        self.plans.append(f"batch size {batch_size} (whole)")
        if self.ooms_before_first_step is None:
            self.ooms_before_first_step = self.ooms


def _pad_collate(samples: list[Batch]) -> Batch:
    """Stack samples into a batch, right-padding shorter ones (mask 0, label -100) when lengths differ."""
    length = max(int(s["input_ids"].numel()) for s in samples)
    ids = torch.zeros((len(samples), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, sample in enumerate(samples):
        n = int(sample["input_ids"].numel())
        ids[row, :n], mask[row, :n], labels[row, :n] = sample["input_ids"], 1, sample["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _samples(batches: list[Batch]) -> list[Batch]:
    """The scenario's batches as one dataset of samples, in order: what a DataLoader would be built over."""
    return [
        {name: tensor[row] for name, tensor in batch.items()}
        for batch in batches
        for row in range(len(batch["input_ids"]))
    ]


def run_accelerate(scenario: Scenario) -> tuple[RunRecord, torch.nn.Module]:
    samples, attempts = _samples(scenario.batches), _Attempts()
    accelerator = Accelerator(cpu=True)

    # As in Accelerate's docs: everything that holds device memory is built inside the decorated loop.
    @find_executable_batch_size(starting_batch_size=scenario.spec.batch_size)  # type: ignore[untyped-decorator]
    def inner_training_loop(batch_size: int) -> torch.nn.Module:
        nonlocal accelerator
        accelerator.free_memory()  # drop the previous attempt's references
        attempts.begin(batch_size)
        try:
            return _accelerate_epoch(accelerator, scenario, samples, batch_size, attempts)
        except Exception as error:  # only counted here; the decorator decides what to do with it
            attempts.ooms += bool(should_reduce_batch_size(error))
            raise

    trace = _Trace()
    with SimulatedGPU(scenario.capacity) as gpu:
        try:
            model: torch.nn.Module | None = inner_training_loop()
        except Exception as error:
            trace.failure, model = _failure(error), None
        gpu.capacity = _UNLIMITED
    trace.wall = time.perf_counter() - trace.started
    trace.times, trace.plans = attempts.times, attempts.plans
    trace.ooms_before_first_step = attempts.ooms_before_first_step
    finished = trace.failure is None
    wasted = attempts.starts[-1] - attempts.starts[0] if finished else trace.wall
    record = _record("accelerate", scenario, trace, attempts.ooms, wasted)
    record.final_batch_size = attempts.sizes[-1] if finished else 0
    accelerator.free_memory()
    return record, model if model is not None else scenario.template


def _accelerate_epoch(
    accelerator: Any, scenario: Scenario, samples: list[Batch], batch_size: int, attempts: _Attempts
) -> torch.nn.Module:
    """One pass over the scenario's samples in batches of ``batch_size``, built and prepared the documented way."""
    model, optimizer = _fresh(scenario)  # copied inside the simulated device: counted, as model.to("cuda")
    loader: torch.utils.data.DataLoader[Batch] = torch.utils.data.DataLoader(
        samples,  # type: ignore[arg-type]  # a list of samples is a map-style dataset
        batch_size=batch_size,
        collate_fn=_pad_collate,
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        started = time.perf_counter()
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        attempts.stepped(time.perf_counter() - started, batch_size)
    return model  # type: ignore[no-any-return]


Runner = Callable[[Scenario], tuple[RunRecord, torch.nn.Module]]
#: The contenders, in table order: each returns its record and its trained model.
CONTENDERS: dict[str, Runner] = {
    "accelerate": run_accelerate,
    "composer": run_composer,
    "oomguard": run_oomguard,
    "oomguard_preplan": run_oomguard_preplan,
}
