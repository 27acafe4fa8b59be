"""The dry-run planner's bench: one model, optimizer and batch on fake tensors, measuring a plan's step (its trace)
and judging it on a device and host of given sizes (see :mod:`oomguard._planner.engine`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from oomguard._effects.elision import Repeat, eliding
from oomguard._ladder.plan import Phase, Plan
from oomguard._planner.compose import Trace
from oomguard._planner.probe import Probe
from oomguard._planner.reads import PlaceholderReads
from oomguard._planner.regions import stack
from oomguard._planner.report import Candidate, Target, device_overhead, tensor_budget
from oomguard._planner.speed import DeviceSpeed, FlopCount
from oomguard._step.batch import batch_size, batch_tensors, first_samples
from oomguard._step.runner import StepRunner

__all__ = ["StepBench", "close", "two_micro_batches"]


class StepBench:
    """Measures plans: each one's peak, on two micro-batches after the plan's effects are applied."""

    def __init__(
        self,
        runner: StepRunner,
        batch: Any,
        size: int,
        capacity: int,
        target: Target,
        speed: DeviceSpeed,
        host_budget: int | None = None,
    ) -> None:
        self.runner, self.batch, self.size, self.capacity, self.target = runner, batch, size, capacity, target
        self.speed, self.host_budget = speed, host_budget
        self.budget = tensor_budget(capacity, target)
        self.probe = Probe(self.budget, _phase_of(runner), _micro_batch_of(runner))
        self.reads = PlaceholderReads()
        self.candidates: list[Candidate] = []
        self.steps = 0  # fake steps run
        self.warmed = self._active = False
        #: Whether the warm-up may be an optimizer step alone: where the step leaves no parameter the optimizer trains
        #: without a gradient (which a whole step would make no state for), as a deep model's shallow copies tell.
        self.every_parameter_steps = False
        self.around: Callable[[], contextlib.AbstractContextManager[None]] | None = None  # (ShallowModel.around)
        #: Asked before each step measured (and its warm-up): a search's time budget, which may end the dry run there
        #: (:meth:`~oomguard._planner.search.SearchBudget.gate`).
        self.gate: Callable[[], None] | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The bench's device (and its placeholder reads) active around what runs inside, once however nested."""
        if self._active:
            yield
            return
        self._active = True
        try:
            with self.probe, self.reads:
                yield
        finally:
            self._active = False

    def warm(self) -> None:
        """Before the first step measured: the model and the batch on the device (again: another bench's effects
        may have replaced a tensor's storage, where they share it), and a one-sample warm-up step, which creates
        the optimizer state; or, where :attr:`every_parameter_steps`, just the optimizer step of one."""
        if not self.warmed:
            self.warmed = True
            with self._own_model():
                self.probe.adopt(self.runner.model, batch_tensors(self.batch))
                if self.every_parameter_steps:
                    self.steps += 1
                    self._optimizer_step(Plan())
                else:
                    self.run(first_samples(self.batch, 1), Plan())

    def stepped_every_parameter(self) -> bool:
        """Whether the steps run so far made optimizer state for every parameter the optimizer trains (none that
        the step leaves without a gradient)."""
        optimizer = self.runner.optimizer
        trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        return self.warmed and all(optimizer.state.get(p) for p in trained)

    def _optimizer_step(self, plan: Plan) -> None:
        """An optimizer step of ``plan`` on zero gradients of every parameter it trains, through the runner's one way
        to step. As the warm-up's: the same optimizer state as a whole warm-up step makes, without its forward and
        backward (a fake step costs per operation: a deep model's warm-up costs a full step's dispatches). Before a
        step of a plan that offloads the optimizer state: the host buffers its steps reuse, as every step but the
        plan's first begins with them (whatever plans the bench measured before)."""
        optimizer = self.runner.optimizer
        trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        with self.active():
            try:
                for parameter in trained:
                    parameter.grad = torch.zeros_like(parameter)
                self.runner.optimizer_step(plan, self.probe)
            finally:
                self.runner.zero_grad()
                for parameter in trained:
                    parameter.grad = None

    @contextlib.contextmanager
    def _own_model(self) -> Iterator[None]:
        """The bench's model as it measures it: where it shares its modules with other benches (``around``), cut to
        its blocks around what runs inside, accounted on its device again, and the plan's effects undone after."""
        if self.around is None:
            yield
            return
        with self.around():
            self.probe.adopt(self.runner.model, batch_tensors(self.batch))  # (whole and on the device: effects undone)
            try:
                yield
            finally:
                with self.active():
                    self.runner.effects.close()

    def run(self, batch: Any, plan: Plan) -> None:
        """One step (nothing holds signals around a step of fake tensors: there is nothing an interrupt can split)."""
        self.steps += 1
        self.reads.new_step()
        with self.active():
            self.runner.run(batch, batch_size(batch), plan, self.probe)

    def measure(self, plan: Plan) -> tuple[Candidate, int]:
        """The plan's measurement, and the memory resident when its step began."""
        trace = self.trace(plan)
        return self.judge(plan, trace), trace.base

    def trace(self, plan: Plan) -> Trace:
        """One fake step of ``plan`` (on two micro-batches, after its effects are applied), and what it measured."""
        if self.gate is not None:
            self.gate()
        probe = self.probe
        self.warm()
        with self._own_model(), self.active():
            self.runner.effects.apply(plan, probe)  # as in any step but the plan's first: offloaded state moved
            if plan.optimizer_offload is True:
                self._optimizer_step(plan)  # (and its host buffers made)
            self.runner.transaction.release_host_copies()  # (the journal's copies are added by judge)
            base = probe.start()
            batch = two_micro_batches(self.batch, plan, self.size)
            last = _last_backward(self.runner, plan.micro_batches(batch_size(batch)) - 1)
            counted = FlopCount(window=last)
            regions = probe.regions(stack(self.runner.effects.target))
            with self.reads.counting(counted), eliding(_repeating(counted)), regions:
                self.run(batch, plan)
            # (read before a shallow copy of the guard's own model undoes the plan's effects, on the same probe: the
            # optimizer state brought back counted as the step's peak after it, and as its transfers; a 14-block
            # job's plans that offload it composed at 1.2-1.45x their peak, and its jump found none that fits)
            run, parts = plan.micro_batches(batch_size(batch)), plan.micro_batches(self.size)
            traced = Trace(
                base=base, phases=tuple(probe.phase_peaks.items()), crossed=probe.crossed,
                host=probe.max_host_memory_allocated(), journal=self.runner.transaction.journal_bytes,
                transfers=probe.transfers(run, parts), overlapped=probe.overlapped(run, parts),
                uploaded=self.runner.effects.uploaded_beside,
                flops=counted.total * parts / run, ops=counted.ops * parts / run,
                early=self.runner.effects.stepped_early, window=counted.window,
                hosts=tuple(probe.host_peaks.items()), host_base=probe.host_start,
            )  # fmt: skip
        return traced

    def judge(self, plan: Plan, trace: Trace) -> Candidate:
        """The candidate ``trace`` makes of ``plan`` on this bench's device and host (added to ``candidates``)."""
        peak = trace.peak
        # The first step on a plan is journaled (the runner forgets the step's bound when a plan moves memory), and
        # its copies stay on the host through the next step: on top of what the fast step measured; unless they
        # would not fit the host budget, where the guard skips the journal (OptimizerTransaction).
        journaled = self.host_budget is None or trace.host + trace.journal <= self.host_budget
        host = trace.host + (trace.journal if journaled else 0)
        overhead = device_overhead(peak, self.target)
        on_device = peak + overhead <= self.capacity
        on_host = self.host_budget is None or host <= self.host_budget
        seconds = self.speed.seconds(
            flops=trace.flops,
            precision=plan.precision,
            transfer_bytes=trace.transfers,
            host_params=self._host_params(plan),
            micro_batches=plan.micro_batches(self.size),
            ops=trace.ops,
            # (copies overlap compute, or the host step, on a CUDA device only: under the simulator a copy is a memcpy
            # on the same thread)
            overlapped_bytes=trace.overlapped if self.target == "cuda" else 0,
            uploaded_beside_bytes=trace.uploaded if self.target == "cuda" else 0,
            early_params=trace.early if self.target == "cuda" else 0,
            early_window_flops=trace.window,
        )
        phase = None if on_device else trace.failing_phase(self.budget)
        fits = on_device and on_host
        self.candidates.append(
            Candidate(plan, peak, overhead, fits, phase, trace.transfers, seconds, host, on_host, journaled)
        )
        return self.candidates[-1]

    def _host_params(self, plan: Plan) -> int:
        """Parameters the optimizer steps on the host on ``plan``: all of them with optimizer offload, else those of
        the offloaded blocks (the first ones)."""
        target = self.runner.effects.target
        if plan.optimizer_offload:
            return sum(p.numel() for g in target.optimizer.param_groups for p in g["params"] if p.requires_grad)
        blocks = target.blocks[: plan.offload_layers]
        return sum(p.numel() for block in blocks for p in block.parameters() if p.requires_grad)


def _repeating(counted: FlopCount) -> Repeat:
    """What counts a repetition an effect ran once for ``times`` (:mod:`oomguard._effects.elision`): the operations
    and FLOPs it dispatched, ``times`` over. Its memory needs nothing: the repetitions not run would have allocated
    and freed the same."""

    @contextlib.contextmanager
    def repeat(times: int) -> Iterator[None]:
        flops, ops = counted.total, counted.ops
        yield
        counted.total += (counted.total - flops) * (times - 1)
        counted.ops += (counted.ops - ops) * (times - 1)

    return repeat


def _phase_of(runner: StepRunner) -> Callable[[], Phase]:
    """The runner's phase, read through a weak reference (see :class:`Probe`)."""
    held = weakref.ref(runner)
    return lambda: getattr(getattr(held(), "progress", None), "phase", Phase.DONE)


def _last_backward(runner: StepRunner, last: int) -> Callable[[], bool]:
    """Whether the runner is in the backward of its micro-batch ``last`` (read as :func:`_phase_of` reads)."""
    phase, micro_batch = _phase_of(runner), _micro_batch_of(runner)
    return lambda: micro_batch() == last and phase() == Phase.BACKWARD


def _micro_batch_of(runner: StepRunner) -> Callable[[], int]:
    """The runner's micro-batch, read as :func:`_phase_of` reads its phase."""
    held = weakref.ref(runner)
    return lambda: getattr(getattr(held(), "progress", None), "micro_batch", 0)


def two_micro_batches(batch: Any, plan: Plan, size: int) -> Any:
    """The first two micro-batches of ``batch`` on ``plan``: the same peak as all of them, in less time.

    The first micro-batch runs without gradients resident, the second with them, and every later one exactly
    like the second; the optimizer step does not depend on the batch at all.
    """
    micro = plan.effective_micro_batch_size(size)
    return first_samples(batch, 2 * micro) if 2 * micro < size else batch


def close(*benches: StepBench) -> None:
    """Undo every bench's effects (on its own probe)."""
    for bench in benches:
        with bench.active():
            bench.runner.effects.close()
