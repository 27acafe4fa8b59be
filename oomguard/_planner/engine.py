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

Where it can build the model with fewer blocks (``dry_run``'s ``shallow``), a deep model's plans are measured on
one- and two-block copies (up to four where layers stream) and composed (:mod:`oomguard._planner.compose`), and
only the recommendation is measured with a full step, where it comes within 3 % of the device or the host budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from oomguard._backends.accounting import AccountedDevice
from oomguard._distributed.agreement import distributed_active
from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Phase, Plan
from oomguard._ladder.rungs import Rung, RungContext
from oomguard._options import GuardOptions, build_runner, model_context
from oomguard._planner.bench import StepBench, close
from oomguard._planner.compose import MIN_BLOCKS, Composed, Traces, confirm
from oomguard._planner.helper import usable
from oomguard._planner.masks import unpadded_masks
from oomguard._planner.reads import PlaceholderReads
from oomguard._planner.report import Candidate, PlanReport, Target
from oomguard._planner.search import Paused, SearchBudget, configurations, inexact, search
from oomguard._planner.speed import DeviceSpeed
from oomguard._planner.walk import Bench, master_weights_instead, walk
from oomguard._step.batch import batch_size

__all__ = ["Residue", "dry_run"]


class ShallowModel(NamedTuple):
    """The model with fewer blocks (see :func:`dry_run`'s ``shallow``): its step function, model and optimizer;
    and, where it is the deep model itself cut short (a guard's model, which the user's step function calls),
    ``around``: what is entered around each of its steps to cut it (the model whole again after each)."""

    step_fn: Callable[[Any], Any]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    around: Callable[[], contextlib.AbstractContextManager[None]] | None = None


#: ``dry_run``'s ``shallow``: ``shallow(n)`` is the model with ``n`` blocks (a tuple of step function, model and
#: optimizer will do, where it is a model of its own).
Shallow = Callable[[int], ShallowModel | tuple[Callable[[Any], Any], torch.nn.Module, torch.optim.Optimizer]]


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
    traces: Traces | None = None,
    shallow: Shallow | None = None,
    every_parameter_steps: bool = False,
    helper: bool = False,
    failed: tuple[Plan, Phase] | None = None,
) -> PlanReport:
    """Walk the ladder for ``batch`` on fake tensors (or measure just ``plans``, in order, if given; or search
    every configuration around the plan ``search_around``, :mod:`oomguard._planner.search`); recommend the
    fitting plan predicted fastest by ``speed`` (a 6 GB consumer GPU by default). ``residue``, where given, is
    told the device the dry run accounted on, to see afterwards what it left alive. A dry run past ``max_seconds``,
    or a step that reads more than :data:`~oomguard._planner.reads.MAX_READS` fake values, raises
    :class:`~oomguard._planner.reads.DryRunLimit`. ``host_budget``: the host memory the guard may fill (None:
    unlimited); a plan whose host bytes are past it does not fit, and the walk goes another way. The search
    starts no measurement past ``search_seconds`` (but its first), nor a shallow step of one, and does not run
    again a plan in ``known`` or a shallow step in ``traces`` (an earlier dry run's measurements, added to here):
    see :class:`~oomguard._planner.search.SearchBudget`.
    ``shallow(n)``, where given, is the model with ``n`` blocks (:class:`ShallowModel`): a deep model's plans are
    then composed from shallow steps (:mod:`oomguard._planner.compose`). ``every_parameter_steps``: the step makes
    optimizer state for every parameter the optimizer trains (a real step showed it): the warm-up that makes that
    state is then the optimizer step alone. ``helper``: run some of the shallow steps in a forked process, where
    this machine has a second core (:mod:`oomguard._planner.helper`; not inside a training process). ``failed``: a
    plan the step ran out of memory on, on the device itself, and the phase it did (the guard's jump): the walk
    starts past it without measuring it again, where it starts there (:func:`~oomguard._planner.walk.walk`).

    Everything passed in must be fake (made in the caller's ``FakeTensorMode``); the effects are undone after.
    """
    started = time.perf_counter()
    size = batch_size(batch)
    options = GuardOptions(model=model, optimizer=optimizer, ladder=ladder, max_grad_norm=max_grad_norm)
    runner = build_runner(step_fn, options, item_counter=batch_size)  # fake tensors hold no labels to count
    bench = StepBench(runner, batch, size, capacity, target, speed or DeviceSpeed(), host_budget)
    bench.reads = PlaceholderReads(None if max_seconds is None else time.monotonic() + max_seconds)
    bench.every_parameter_steps = every_parameter_steps
    composed = _composed(shallow, bench, options, residue if residue is not None else Residue(), helper, traces)
    asked = _Asked(plans, search_around, bf16, failed)
    budget = _planned(bench, composed, options.rungs, asked, search_seconds, known)
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
        fake_steps=bench.steps + (composed.steps if composed is not None else 0),
        complete=budget.complete,
        composed=composed is not None and composed.made > 0 and not composed.refuted,
        confirmed=composed is not None and composed.confirmed and not composed.refuted,
    )


class _Asked(NamedTuple):
    """What :func:`dry_run` was asked to measure (its arguments of those names)."""

    plans: Sequence[Plan] | None
    search_around: Plan | None
    bf16: bool
    failed: tuple[Plan, Phase] | None


def _planned(
    bench: StepBench,
    composed: Composed | None,
    ladder: Ladder,
    asked: _Asked,
    search_seconds: float | None,
    known: dict[Plan, Candidate] | None,
) -> SearchBudget:
    """What :func:`dry_run` measures, on ``bench`` or composed from shallow steps, and confirmed; the effects undone
    after (on the probes, not the caller's device; reads of values get placeholders). The search's budget."""
    with unpadded_masks():
        try:
            if composed is None:
                bench.warm()  # a one-sample warm-up creates the optimizer state (the deep model's: when confirming)
            # (under torch.distributed, what the guard's rungs may do there: each rank plans as its guard walks)
            context = dataclasses.replace(
                model_context(bench.runner), batch_size=bench.size, distributed=distributed_active()
            )
            budget = SearchBudget(search_seconds, known)
            bench.gate = budget.gate  # (and every shallow bench's, made from it)
            try:
                _measure(composed or bench, ladder, context, asked, budget)
                # (the deep model's warm-up makes its optimizer state by an optimizer step alone where the copies
                # show that a whole step would make state for every parameter)
                # (a search cut short by its time is run again in a later call, which confirms what it recommends
                # then: the caller takes nothing of this one's)
                if composed is not None and budget.complete:
                    bench.every_parameter_steps = bench.every_parameter_steps or composed.stepped_every_parameter()
                    confirmed = confirm(bench, composed.composed)
                    composed.confirmed = confirmed.measured
                    composed.refuted = not confirmed.stands
                    # A walk that followed a wrong composition is walked again, in full. A search is not (full steps
                    # of the deep model, inside a training call): each plan it composed that fitted was measured in
                    # full and did not fit, and the guard's tuning times the plans it ranks fastest on real steps,
                    # where one that does not fit is dropped.
                    if composed.refuted and asked.search_around is None:
                        bench.candidates.clear()
                        _measure(bench, ladder, context, asked, budget)
            except Paused:  # (the search's time is up between two fake steps of a measurement)
                pass
        finally:
            if composed is not None:
                composed.close()
            close(bench, *(composed.benches.values() if composed is not None else ()))
    return budget


def _measure(bench: Bench, ladder: Ladder, context: RungContext, asked: _Asked, budget: SearchBudget) -> None:
    """What :func:`dry_run` measures: ``plans``, then the search around ``search_around``, or else the walk down
    ``ladder`` (and on from master weights instead of offloaded layers or state, where bf16 is measured)."""
    size, search_around = context.batch_size, asked.search_around
    for given in asked.plans or ():
        bench.measure(given)
    if search_around is not None:
        configs = configurations(search_around, ladder, context)
        smallest, fixed = ladder.min_micro_batch(size), inexact(ladder)
        fits = budget.fits(lambda plan: bench.measure(plan)[0], bench.candidates.append)
        search(configs, size, smallest, fits, fixed=fixed, more=budget.more)
    elif not asked.plans:
        walk(bench, ladder, context, failed=asked.failed)
        master = master_weights_instead(bench.candidates, ladder, context) if asked.bf16 else None
        if master is not None:
            walk(bench, ladder, context, start=master)


def _as_fp16(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates of a dry run measured in bf16 (fp16's GradScaler reads values fake tensors do not have) for a
    device without bf16: fp16 autocast keeps the same sizes; the master level has none (its weights on the device
    are bf16), so it is not offered."""
    kept = [c for c in candidates if c.plan.optimizer_offload != "master"]
    return [dataclasses.replace(c, plan=_fp16(c.plan)) for c in kept]


@dataclasses.dataclass
class Residue:
    """What a dry run's devices still hold once the dry run is over: the storages of fake tensors someone kept
    (see :func:`oomguard._planner.isolation.leftovers`)."""

    probes: list[AccountedDevice] = dataclasses.field(default_factory=list)

    def storages(self) -> set[int]:
        """Identities of the dry run's storages still alive."""
        return {key for probe in self.probes for key in probe.live_storages()}


def _fp16(plan: Plan) -> Plan:
    return plan.replace(precision="fp16") if plan.precision is not None else plan


def _composed(
    shallow: Shallow | None,
    deep: StepBench,
    options: GuardOptions,
    residue: Residue,
    helped: bool,
    traces: Traces | None,
) -> Composed | None:
    """The bench composing ``deep``'s plans from shallow ones (those in ``traces`` already run), where ``shallow`` is
    given and the model is deep enough to gain from it; None: every plan is measured on ``deep``. ``residue`` is
    told every bench's device (the helper's, if ``helped``, are in another process)."""
    residue.probes.append(deep.probe)
    blocks = len(deep.runner.effects.target.blocks)
    if shallow is None or blocks < MIN_BLOCKS:
        return None
    made = _shallow(shallow, deep.batch, options, deep, residue)
    return Composed(deep, blocks, made, helped=helped and usable(), traces=traces)


def _shallow(
    shallow: Shallow, batch: Any, options: GuardOptions, deep: StepBench, residue: Residue
) -> Callable[[int], StepBench]:
    """``Composed``'s maker of shallow benches: the model of ``n`` blocks, on the deep bench's terms."""

    def make(blocks: int) -> StepBench:
        made = ShallowModel(*shallow(blocks))
        given = dataclasses.replace(options, model=made.model, optimizer=made.optimizer)
        with made.around() if made.around is not None else contextlib.nullcontext():
            runner = build_runner(made.step_fn, given, item_counter=batch_size)  # (its effects: on the blocks kept)
        bench = StepBench(runner, batch, deep.size, deep.capacity, deep.target, deep.speed, deep.host_budget)
        bench.reads, bench.around, bench.gate = deep.reads, made.around, deep.gate
        bench.every_parameter_steps = deep.every_parameter_steps
        residue.probes.append(bench.probe)
        return bench

    return make
