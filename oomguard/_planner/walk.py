"""The planner's walk down the ladder on fake tensors, as the guard would walk it after each OOM, and the largest
micro-batch that fits where it stops (see :mod:`oomguard._planner.engine`, whose bench measures each plan)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Phase, Plan
from oomguard._ladder.predict import PeakModel
from oomguard._ladder.rungs import Rung, RungContext
from oomguard._planner.report import Candidate
from oomguard._planner.search import deepest_exact, halvings, largest_fitting
from oomguard._planner.speed import DeviceSpeed
from oomguard._step.batch import items_per_sample

__all__ = ["WORTH", "Bench", "fewer_micro_batches", "grow", "master_weights_instead", "walk"]


class Bench(Protocol):
    """What the walk needs of the engine's bench: the batch, the tensor budget, the measurements so far, and a
    measurement of a plan (with the memory resident when its step began)."""

    batch: Any
    size: int
    budget: int
    runner: Any  # (its grad_bytes)
    speed: DeviceSpeed
    candidates: list[Candidate]

    def measure(self, plan: Plan) -> tuple[Candidate, int]: ...


def walk(
    bench: Bench,
    ladder: Ladder,
    context: RungContext,
    start: Plan | None = None,
    failed: tuple[Plan, Phase] | None = None,
) -> None:
    """Down the ladder from ``start`` (the plain plan), as the guard would go after an OOM in the same phase,
    until a plan fits; then the largest micro-batch that fits in its configuration (and, on a small model, before
    and after it splits the batch, the same configuration with its exact activation rungs as deep as they go:
    :func:`fewer_micro_batches`). A plan the host has no room for is left for what another rung makes of the plan
    before it, as the guard's walk leaves a rung whose host memory is past the budget: the rungs after it would
    only add to the device's relief, not take from the host's load (TinyLlama's offloaded state needs 20.5 GiB of
    host memory on every plan that walks on from it). A plan the walk comes to that was measured before (that
    candidate, measured whole before the walk split the batch) is not measured again: the walk goes on from it, as
    the guard's walk would, until the ladder ends (:class:`_Measurements`).

    ``failed``: a plan that ran out of memory on the device itself, and the phase it did (the guard's jump, after a
    real OOM). Where it is the plan the walk starts from, the walk starts past it, as the guard's own walk would,
    without measuring it again: unless the next rung splits the batch, whose micro-batch size a measurement of the
    whole batch predicts."""
    size, grad_bytes = bench.size, bench.runner.grad_bytes
    peaks = PeakModel(margin=0.0)  # the measurements are exact: no safety margin on top of the overhead
    per_sample = items_per_sample(bench.batch, size)
    measure = _Measurements(bench)
    plan: Plan | None = start or Plan()
    came: tuple[Plan, RungContext] | None = None  # the plan that did not fit on the device, and its context
    refused: set[str] = set()  # rungs whose plans the host has no room for
    step: tuple[Rung, Plan] | None = None  # the rung that made ``plan``, and ``plan``
    if failed is not None and failed[0] == plan:
        past = (plan, dataclasses.replace(context, phase=failed[1]))
        following = ladder.next(*past)
        if following is not None and following[0] is not ladder.sizing:
            came, step, plan = past, following, following[1]
    walked: set[Plan] = set()  # (a custom rung whose steps come back to a plan would walk in a circle)
    while plan is not None and plan not in walked:
        walked.add(plan)
        measured, base = measure(plan)
        if measured.fits:
            grow(plan, size, bench.candidates, bench.measure)
            fewer_micro_batches(plan, bench, ladder, context)
            return
        # The host is short (the device may be too): another rung, from the plan before.
        if not measured.host_fits and came is not None and step is not None:
            refused.add(step[0].name)
            step = ladder.next(*came, skip=refused)
            plan = step[1] if step is not None else None
            continue
        sized = None
        if base is not None:  # (None: measured before this walk; the ladder halves where it cannot size)
            items = round(plan.effective_micro_batch_size(size) * per_sample)
            peaks.record_success(plan, items, measured.peak_bytes - base)
            sized = peaks.max_micro_batch(plan, bench.budget, base, per_sample, grad_bytes)
        phase = measured.phase or Phase.FORWARD
        came = (plan, dataclasses.replace(context, phase=phase, max_micro_batch=sized))
        step = ladder.next(*came, skip=refused)
        if _exact_instead(measured, step, measure, ladder, context):
            return
        plan = step[1] if step is not None else None


class _Measurements:
    """The walk's measurements of plans: a plan measured before (the deepest exact configuration measured before a
    split, which the walk may come to again rung by rung; a plan another walk measured) is not measured again, and
    the walk goes on from it as from a new one. It used to stop there and answer that no plan fits where the ladder
    had deeper rungs left, and the guard walked them one OOM at a time (a ladder with micro-batches found less than
    the same rungs with micro-batches last: 7 to 27 OOMs for nanoGPT, GPT-2 and Gemma-3 at deep budgets)."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.bases: dict[Plan, int] = {}  # the memory resident when each step this walk measured began

    def __call__(self, plan: Plan) -> tuple[Candidate, int | None]:
        """``plan``'s measurement, and the memory resident when its step began (None: measured before this walk)."""
        known = next((c for c in self.bench.candidates if c.plan == plan), None)
        if known is not None:
            return known, self.bases.get(plan)
        measured, self.bases[plan] = self.bench.measure(plan)
        return measured, self.bases[plan]


#: The deepest exact configuration is measured where the micro-batches it could save might take this much of the
#: step's predicted time (:func:`fewer_micro_batches`).
WORTH = 0.1


def fewer_micro_batches(fitting: Plan, bench: Bench, ladder: Ladder, context: RungContext) -> None:
    """Where the walk stopped on micro-batches (``fitting``'s configuration): the same plan with every exact rung
    that relieves activations as deep as it goes (:func:`~oomguard._planner.search.deepest_exact`), at the
    largest micro-batch that fits.

    The ladder splits the batch before it recomputes or offloads activations: on a large model each micro-batch
    costs little beside its compute. On a small one each costs its launches (or, under a simulated device, its
    dispatches): micro-batches of 2 of a 16-layer model of width 64 take 3x as long as the whole batch with its
    activations offloaded. The candidate costs a fake step or two, so it is measured only where the micro-batches
    it could save (at :class:`~oomguard._planner.speed.DeviceSpeed`'s fixed cost each) are :data:`WORTH` a tenth
    of the step's predicted time."""
    size, config = context.batch_size, fitting.replace(micro_batch_size=None)
    same = [c for c in bench.candidates if c.fits and c.plan.replace(micro_batch_size=None) == config]
    found = max(same, key=lambda c: c.plan.effective_micro_batch_size(size))  # (what grow found)
    deepest = _deepest_worth(found, found.plan.micro_batches(size), bench, ladder, context)
    if deepest is not None:  # (as much relief at every micro-batch: it fits where the walk's plan does)
        grow(deepest.replace(micro_batch_size=found.plan.micro_batch_size), size, bench.candidates, bench.measure)


def _exact_instead(
    whole: Candidate, step: tuple[Rung, Plan] | None, measure: _Measurements, ladder: Ladder, context: RungContext
) -> bool:
    """Where the walk's next ``step`` splits the ``whole`` batch (a candidate that did not fit) into micro-batches
    (as the ladder sizes them), :func:`fewer_micro_batches`' candidate on the whole batch; whether it fits and is
    predicted faster than any split of the whole batch could be (its work, and one more micro-batch's fixed cost
    at least): the walk can end there."""
    size, bench = context.batch_size, measure.bench
    deepest = None
    if step is not None and step[0] is ladder.sizing and whole.plan.micro_batches(size) == 1:
        deepest = _deepest_worth(whole, step[1].micro_batches(size), bench, ladder, context)
    if deepest is None or deepest in {c.plan for c in bench.candidates}:
        return False
    measured, _ = measure(deepest)
    return measured.fits and measured.predicted_seconds <= whole.predicted_seconds + bench.speed.micro_batch_seconds


def _deepest_worth(candidate: Candidate, parts: int, bench: Bench, ladder: Ladder, context: RungContext) -> Plan | None:
    """:func:`~oomguard._planner.search.deepest_exact` of ``candidate``'s configuration, on the whole batch, where
    it differs and ``parts`` micro-batches' fixed cost is :data:`WORTH` measuring it; else None."""
    config = candidate.plan.replace(micro_batch_size=None)
    deepest = deepest_exact(config, ladder, context)
    saved = (parts - 1) * bench.speed.micro_batch_seconds
    return None if deepest == config or saved < WORTH * candidate.predicted_seconds else deepest


def master_weights_instead(tried: list[Candidate], ladder: Ladder, context: RungContext) -> Plan | None:
    """Where the walk ended on offloaded layers or on offloaded optimizer state: the same plan with bf16 weights on
    the device and fp32 masters on the host instead (optimizer_offload's second level), to walk on from; None
    where the ladder cannot.

    The walk from the plain plan meets layer offload before mixed precision (resident state is not what amp
    relieves), and the master level needs amp; yet it halves the weights on the device and moves a fraction of
    what streaming layers moves. And the walk stops at the state's level, which fits: yet each of its steps moves
    fp32 gradients and weights both ways (12 bytes a parameter), the master level 4.
    """
    fitting = next((c.plan for c in reversed(tried) if c.fits), None)
    if fitting is None or not (fitting.offload_layers or fitting.optimizer_offload is True):
        return None
    master = fitting.replace(offload_layers=0, optimizer_offload="master", precision="bf16")
    rungs = {rung.name: rung for rung in ladder.known}
    listed = set(ladder.names)
    # Each rung it takes says whether it could get there (its preconditions: bf16 on this device, an optimizer
    # that steps on the host, the master level's own rule); amp need not be listed where the walk already ran bf16.
    usable = "optimizer_offload" in listed and ("amp" in listed or fitting.precision == "bf16")
    reached = all(rungs[name].reaches(master, context) for name in ("amp", "optimizer_offload"))
    return master if usable and reached else None


def grow(fitting: Plan, size: int, tried: list[Candidate], measure: Callable[[Plan], Any]) -> None:
    """Find the largest micro-batch that fits in ``fitting``'s configuration, among the sizes halving visits
    (size/2, size/4...), by bisection between the one that fits and the smallest one known not to."""
    config = fitting.replace(micro_batch_size=None)
    same = [c for c in tried if c.plan.replace(micro_batch_size=None) == config]
    failed = [c.plan.effective_micro_batch_size(size) for c in same if not c.fits]
    fitted = [c.plan.effective_micro_batch_size(size) for c in same if c.fits]
    low, high = max([fitting.effective_micro_batch_size(size), *fitted]), min(failed, default=size + 1)
    sizes = [s for s in halvings(size) if low < s < high]
    largest_fitting(sizes, lambda micro: bool(measure(config.replace(micro_batch_size=_size(micro, size)))[0].fits))


def _size(micro: int, size: int) -> int | None:
    """The plan's micro_batch_size for micro-batches of ``micro`` on a batch of ``size`` (None: the whole batch)."""
    return None if micro >= size else micro
