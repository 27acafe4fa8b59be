"""The dry-run planner: which plan a training step needs on a device, from one step on fake tensors.

The planner runs the guard's own step runner (forward, backward, clipping, the optimizer step, with each plan's
effects applied exactly as in training) on PyTorch fake tensors (``FakeTensorMode``: shapes and dtypes, no
data, no memory), on an unlimited simulated device that accounts every tensor the way
:class:`~oomguard.testing.SimulatedGPU` does (:mod:`oomguard._backends.accounting`). So a plan's predicted peak is
what SimulatedGPU, or ``torch.cuda.max_memory_allocated``, would measure for it, without a GPU or the memory.

It walks the guard's ladder from the plain step (:mod:`oomguard._planner.walk`): a plan that does not fit is
followed by the plan the guard would try next after an OOM in the same phase, with micro-batch sizes predicted
from the peaks measured so far, until one fits, then looks for the largest micro-batch that still fits in that
configuration. Where that ends on offloaded layers or offloaded optimizer state it walks again from bf16 weights
with fp32 masters on the host. Of the fitting plans measured, the one the device model
(:mod:`oomguard._planner.speed`) predicts fastest is the recommendation. Each measured step runs after a warm-up
step, so the optimizer state is resident as in any step but the first.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from oomguard._backends.accounting import AccountedDevice
from oomguard._backends.memory import nbytes
from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Phase, Plan
from oomguard._ladder.rungs import Rung, RungContext
from oomguard._options import GuardOptions, build_runner, model_context
from oomguard._planner.masks import unpadded_masks
from oomguard._planner.reads import PlaceholderReads
from oomguard._planner.report import Candidate, PlanReport, Target, device_overhead, tensor_budget
from oomguard._planner.search import SearchBudget, configurations, inexact, search
from oomguard._planner.speed import DeviceSpeed, FlopCount
from oomguard._planner.walk import master_weights_instead, walk
from oomguard._step.batch import batch_size, split_batch
from oomguard._step.runner import StepRunner

__all__ = ["Residue", "dry_run"]

_UNLIMITED = 2**62


class _Probe(AccountedDevice):
    """An unlimited simulated device that notes in which phase usage first passed ``budget``, and the peak of
    each phase. ``phase`` must not hold the runner: the probe's storage finalizers outlive the dry run."""

    def __init__(self, budget: int, phase: Callable[[], Phase]) -> None:
        super().__init__(_UNLIMITED, name="planner", on_allocate=self._note)
        self.budget = budget
        self.per_micro_batch = self.per_step = 0  # host<->device bytes of the step measured now
        self.beside = 0  # of ``per_micro_batch``: device-to-host copies a side stream runs beside the compute
        self.crossed: Phase | None = None
        self.phase_peaks: dict[Phase, int] = {}
        self._phase_of = phase

    def start(self) -> int:
        """Measure a new step from here; returns what is resident now."""
        self.reset_peak_memory_stats()
        self.crossed, self.phase_peaks = None, {}
        self.per_micro_batch = self.per_step = self.beside = 0
        return self.memory_allocated()

    def transfers(self, micro_batches_run: int, micro_batches: int) -> int:
        """Host<->device bytes of a whole step with ``micro_batches``, from a run of ``micro_batches_run``: what
        the forward and backward copied is per micro-batch, the rest (the optimizer's journal) per step."""
        return self.per_micro_batch * micro_batches // micro_batches_run + self.per_step

    def overlapped(self, micro_batches_run: int, micro_batches: int) -> int:
        """Of :meth:`transfers`, the bytes copied beside the compute: on CUDA a device-to-host copy during forward
        and backward runs on the backend's copy stream, and the compute waits for none of it."""
        return self.beside * micro_batches // micro_batches_run

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._phase_of() in (Phase.FORWARD, Phase.BACKWARD):
            self.beside += nbytes(tensor)
        self._attribute(tensor)
        return super().to_host(tensor, out)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        self._attribute(tensor)
        return super().to_device(tensor)

    def upload(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self._attribute(host)
        super().upload(device, host)

    def _attribute(self, tensor: torch.Tensor) -> None:
        moved = nbytes(tensor)
        if self._phase_of() in (Phase.FORWARD, Phase.BACKWARD):
            self.per_micro_batch += moved
        else:
            self.per_step += moved

    def failing_phase(self, base: int) -> Phase:
        """The phase a plan that does not fit fails in, as far as the rungs are concerned.

        What is resident before the step (weights, optimizer state) or needed by the optimizer step cannot be
        relieved by rungs that shrink activations: that is an optimizer-phase failure, whichever allocation
        would have been the first to fail.
        """
        late = max(self.phase_peaks.get(phase, 0) for phase in (Phase.CLIP, Phase.OPTIMIZER))
        if base > self.budget or late > self.budget:
            return Phase.OPTIMIZER
        return self.crossed or Phase.FORWARD

    def _note(self, allocated: int) -> None:
        """The ``on_allocate`` observer: after every allocation, and every resize of a tracked storage."""
        phase = self._phase_of()
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), allocated)
        if self.crossed is None and allocated > self.budget:
            self.crossed = phase


def dry_run(
    step_fn: Callable[[Any], Any],
    batch: Any,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    capacity: int,
    target: Target,
    label: str,
    ladder: Iterable[str | Rung] | None = None,
    max_grad_norm: float | None = None,
    bf16: bool = True,
    seq_len: int | None = None,
    optimizer_name: str | None = None,
    plans: Sequence[Plan] | None = None,
    speed: DeviceSpeed | None = None,
    search_around: Plan | None = None,
    residue: Residue | None = None,
    max_seconds: float | None = None,
    host_budget: int | None = None,
    search_seconds: float | None = None,
    known: dict[Plan, Candidate] | None = None,
) -> PlanReport:
    """Walk the ladder for ``batch`` on fake tensors (or measure just ``plans``, in order, if given; or search
    every configuration around the plan ``search_around``, :mod:`oomguard._planner.search`); recommend the
    fitting plan predicted fastest by ``speed`` (a 6 GB consumer GPU by default). ``residue``, where given, is
    told the device the dry run accounted on, to see afterwards what it left alive. A dry run past ``max_seconds``,
    or a step that reads more than :data:`~oomguard._planner.reads.MAX_READS` fake values, raises
    :class:`~oomguard._planner.reads.DryRunLimit`. ``host_budget``: the host memory the guard may fill (None:
    unlimited); a plan whose host bytes are past it does not fit, and the walk goes another way. The search
    starts no measurement past ``search_seconds`` (but its first) and does not run again a plan in ``known``
    (an earlier dry run's measurements, added to here): see :class:`~oomguard._planner.search.SearchBudget`.

    Everything passed in must already be fake: call it inside the ``FakeTensorMode`` that made the model, the
    optimizer and the batch. The model's effects are undone before it returns.
    """
    started = time.perf_counter()
    size = batch_size(batch)
    options = GuardOptions(model=model, optimizer=optimizer, ladder=ladder, max_grad_norm=max_grad_norm)
    runner = build_runner(step_fn, options, item_counter=batch_size)  # fake tensors hold no labels to count
    bench = _Bench(runner, batch, size, capacity, target, speed or DeviceSpeed(), host_budget)
    if residue is not None:
        residue.probe = bench.probe
    bench.reads = PlaceholderReads(None if max_seconds is None else time.monotonic() + max_seconds)
    # (the effects are undone inside: on the probe, not the caller's device; reads of values get placeholders)
    with bench.probe, unpadded_masks(), bench.reads:
        try:
            bench.probe.adopt(model, _tensors(batch))
            bench.run(split_batch(batch, 1)[0], Plan())  # a one-sample warm-up creates the optimizer state
            context = dataclasses.replace(model_context(runner), batch_size=size)
            budget = SearchBudget(search_seconds, known)
            _measure(bench, options.rungs, context, plans, search_around, bf16, budget)
        finally:
            runner.effects.close()
    candidates = bench.candidates if bf16 else _as_fp16(bench.candidates)
    # The fastest fitting plan by the time model (ties: the first measured, the one the ladder reached first).
    fitting = [c.plan for c in sorted((c for c in candidates if c.fits), key=lambda c: c.predicted_seconds)]
    return PlanReport(
        model=label,
        capacity_bytes=capacity,
        target=target,
        batch_size=size,
        seq_len=seq_len,
        optimizer=optimizer_name or type(optimizer).__name__,
        candidates=tuple(candidates),
        recommended=fitting[0] if fitting else None,
        seconds=time.perf_counter() - started,
        host_budget_bytes=host_budget,
        fake_steps=bench.steps,
        complete=budget.complete,
    )


def _measure(
    bench: _Bench,
    ladder: Ladder,
    context: RungContext,
    plans: Sequence[Plan] | None,
    search_around: Plan | None,
    bf16: bool,
    budget: SearchBudget,
) -> None:
    """What :func:`dry_run` measures: ``plans``, then the search around ``search_around``, or else the walk down
    ``ladder`` (and on from master weights instead of offloaded layers or state, where bf16 is measured)."""
    size = context.batch_size
    for given in plans or ():
        bench.measure(given)
    if search_around is not None:
        configs = configurations(search_around, ladder, context)
        smallest, fixed = ladder.min_micro_batch(size), inexact(ladder)
        fits = budget.fits(lambda plan: bench.measure(plan)[0], bench.candidates.append)
        search(configs, size, smallest, fits, fixed=fixed, more=budget.more)
    elif not plans:
        walk(bench, ladder, context)
        master = master_weights_instead(bench.candidates, ladder, context) if bf16 else None
        if master is not None:
            walk(bench, ladder, context, start=master)


def _as_fp16(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates of a dry run measured in bf16 (fp16's GradScaler reads values fake tensors do not have) for a
    device without bf16: fp16 autocast keeps the same sizes; the master level has none (its weights on the device
    are bf16), so it is not offered."""
    kept = [c for c in candidates if c.plan.optimizer_offload != "master"]
    return [dataclasses.replace(c, plan=_fp16(c.plan)) for c in kept]


class _Bench:
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
        self.probe = _Probe(self.budget, _phase_of(runner))
        self.reads = PlaceholderReads()
        self.candidates: list[Candidate] = []
        self.steps = 0  # fake steps run

    def run(self, batch: Any, plan: Plan) -> None:
        """One step (nothing holds signals around a step of fake tensors: there is nothing an interrupt can split)."""
        self.steps += 1
        self.reads.new_step()
        self.runner.run(batch, batch_size(batch), plan, self.probe)

    def measure(self, plan: Plan) -> tuple[Candidate, int]:
        """The plan's measurement, and the memory resident when its step began."""
        probe = self.probe
        self.runner.effects.apply(plan, probe)  # as in any step but the plan's first: offloaded state moved
        self.runner.transaction.release_host_copies()  # (the journal's copies are added below, not measured)
        base = probe.start()
        batch = _two_micro_batches(self.batch, plan, self.size)
        with FlopCount() as counted:
            self.run(batch, plan)
        peak = probe.max_memory_allocated()
        # The first step on a plan is journaled (the runner forgets the step's bound when a plan moves memory), and
        # its copies stay on the host through the next step: on top of what the fast step measured here; unless
        # they would not fit the host budget, where the guard skips the journal (OptimizerTransaction).
        host, journal = probe.max_host_memory_allocated(), self.runner.transaction.journal_bytes
        journaled = self.host_budget is None or host + journal <= self.host_budget
        host += journal if journaled else 0
        overhead = device_overhead(peak, self.target)
        on_device = peak + overhead <= self.capacity
        on_host = self.host_budget is None or host <= self.host_budget
        run, parts = plan.micro_batches(batch_size(batch)), plan.micro_batches(self.size)
        transfers = probe.transfers(run, parts)
        # (copies overlap compute, or the host step, on a CUDA device only: under the simulator a copy is a memcpy
        # on the same thread)
        cuda = self.target == "cuda"
        overlapped = probe.overlapped(run, parts) if cuda else 0
        uploaded_beside = self.runner.effects.uploaded_beside if cuda else 0
        seconds = self.speed.seconds(
            flops=counted.total * parts / run,
            precision=plan.precision,
            transfer_bytes=transfers,
            host_params=self._host_params(plan),
            micro_batches=parts,
            ops=counted.ops * parts / run,
            overlapped_bytes=overlapped,
            uploaded_beside_bytes=uploaded_beside,
        )
        phase = None if on_device else probe.failing_phase(base)
        fits = on_device and on_host
        candidate = Candidate(plan, peak, overhead, fits, phase, transfers, seconds, host, on_host, journaled)
        self.candidates.append(candidate)
        return self.candidates[-1], base

    def _host_params(self, plan: Plan) -> int:
        """Parameters the optimizer steps on the host on ``plan``: all of them with optimizer offload, else those of
        the offloaded blocks (the first ones)."""
        target = self.runner.effects.target
        if plan.optimizer_offload:
            return sum(p.numel() for g in target.optimizer.param_groups for p in g["params"] if p.requires_grad)
        blocks = target.blocks[: plan.offload_layers]
        return sum(p.numel() for block in blocks for p in block.parameters() if p.requires_grad)


def _phase_of(runner: StepRunner) -> Callable[[], Phase]:
    """The runner's phase, read through a weak reference (see :class:`_Probe`)."""
    held = weakref.ref(runner)
    return lambda: getattr(getattr(held(), "progress", None), "phase", Phase.DONE)


@dataclasses.dataclass
class Residue:
    """What a dry run's device still holds once the dry run is over: the storages of fake tensors someone kept
    (see :func:`oomguard._planner.isolation.leftovers`)."""

    probe: AccountedDevice | None = None

    def storages(self) -> set[int]:
        """Identities of the dry run's storages still alive."""
        return self.probe.live_storages() if self.probe is not None else set()


def _two_micro_batches(batch: Any, plan: Plan, size: int) -> Any:
    """The first two micro-batches of ``batch`` on ``plan``: the same peak as all of them, in less time.

    The first micro-batch runs without gradients resident, the second with them, and every later one exactly
    like the second; the optimizer step does not depend on the batch at all.
    """
    micro = plan.effective_micro_batch_size(size)
    return split_batch(batch, 2 * micro)[0] if 2 * micro < size else batch


def _fp16(plan: Plan) -> Plan:
    return plan.replace(precision="fp16") if plan.precision is not None else plan


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, torch.Tensor)]
