"""A deep model's plan measured on shallow copies of it: a decoder stack is one block N times, so the planner
traces the model with one and two blocks (up to four, where it streams some) and composes what N blocks would
measure.

Within each phase of a step (forward, backward, clipping, the optimizer step), and within each region of a phase
(before the blocks, inside them, past them: :mod:`oomguard._planner.regions`), every figure the planner takes of a
plan (the peak, what was resident when the step began, host memory, the journal, host<->device bytes, FLOPs and
operations) is affine in the number of identical blocks: each block adds its weights, gradients,
optimizer state and saved activations, and the embedding, the head and the loss are there once whatever the depth.
So two shallow traces give a figure's intercept and its slope, and the N-block figure follows. Where a plan
streams some of the blocks (``offload_layers``), resident and streamed blocks each have their slope: three traces.
Partial checkpointing checkpoints every other block, so its unit is a pair of blocks.

A shallow step costs a fraction of a deep one (the cost of a fake step is per operator dispatched), so the walk
and the search run at a fraction of their cost. The plan they recommend is then confirmed with one full fake step
of the deep model, which replaces the composed figures with measured ones, where it comes within :data:`CLEAR` of
the device or the host budget (:func:`confirm`). ``oomguard plan
--exact`` (``plan(..., exact=True)``) measures every candidate on the deep model instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from oomguard._effects.blocks import is_transformers_model
from oomguard._effects.layers import PREFETCH_FROM
from oomguard._ladder.plan import Phase, Plan
from oomguard._planner.helper import Helper
from oomguard._planner.reads import DryRunLimit
from oomguard._planner.report import Candidate
from oomguard._planner.search import Paused
from oomguard._planner.speed import DeviceSpeed

__all__ = [
    "CLEAR",
    "MIN_BLOCKS",
    "Composed",
    "Confirmed",
    "Trace",
    "Traces",
    "compose",
    "confirm",
    "points",
    "uniform_blocks",
]

logger = logging.getLogger("oomguard")

#: The fewest blocks a model needs for its plans to be composed (a shallower one is measured as it is): two shallow
#: steps (of one and two blocks, two to four where layers stream) cost what a step of about twelve does where the
#: embedding, head and loss weigh as much as four blocks (a small model's), so composing pays from about there.
MIN_BLOCKS = 12

#: How much of the device (and of the host budget) a composed recommendation must leave free to stand without a full
#: step of the deep model (:func:`confirm`).
CLEAR = 0.03


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one fake step of a plan measured (or what a composition of such steps predicts)."""

    base: int  # device bytes resident when the step began
    #: The device peak of each phase of each micro-batch (forward and backward: a peak is affine in the blocks only
    #: within one: the first micro-batch runs without gradients resident, the second with them), in each region of
    #: the phase (before, inside or past the blocks: :mod:`oomguard._planner.regions`), in the order reached.
    phases: tuple[tuple[tuple[Phase, int, int], int], ...]
    crossed: Phase | None  # the phase in which usage first passed the bench's budget (None: it never did)
    host: int  # the host peak, the journal aside
    journal: int  # the journal's host copies of the plan's first step
    transfers: int  # host<->device bytes of the whole step
    overlapped: int  # of which copies run beside the compute (on CUDA)
    uploaded: int  # of which copies to the device run beside the host step (the master level's weights, on CUDA)
    flops: float  # matrix FLOPs of the whole step
    ops: float  # operations dispatched in the whole step
    early: int = 0  # parameters (elements) stepped on the host during the last backward (the master level's)
    window: float = 0.0  # matrix FLOPs of the last micro-batch's backward: what those host steps run beside
    #: The host's peak in each phase and region where it grew (as ``phases``), and what it held when the step began:
    #: ``host`` is the largest of them. Composed each on its own, as the device's are.
    hosts: tuple[tuple[tuple[Phase, int, int], int], ...] = ()
    host_base: int = 0

    @property
    def peak(self) -> int:
        """The device peak of the step."""
        return max([self.base, *(peak for _, peak in self.phases)])

    def failing_phase(self, budget: int) -> Phase:
        """The phase a plan past ``budget`` fails in, as far as the rungs are concerned.

        What is resident before the step (weights, optimizer state) or needed by the optimizer step cannot be
        relieved by rungs that shrink activations: that is an optimizer-phase failure, whichever allocation
        would have been the first to fail.
        """
        late = max((peak for (phase, *_), peak in self.phases if phase in (Phase.CLIP, Phase.OPTIMIZER)), default=0)
        if self.base > budget or late > budget:
            return Phase.OPTIMIZER
        return self.crossed or Phase.FORWARD


#: Shallow steps run, by the plan on the shallow model, its blocks and layer offload's ``prefetch_from``: what
#: :class:`Composed` keeps, and a search keeps from one of its dry runs to the next.
Traces = dict[tuple[Plan, int, int], Trace]


def points(plan: Plan, blocks: int, prefetching: bool = False, fewest: int = 1) -> list[tuple[Plan, int, float]]:
    """The shallow steps that compose ``plan`` on a model of ``blocks`` blocks: (the plan on the shallow model,
    its blocks, the weight of its figures in the composition); the weights sum to 1.

    A model without streamed blocks is composed from ``fewest`` blocks and one more (pairs, for partial
    checkpointing): one for a transformers model, two for others, whose blocks the guard finds as a list of at
    least two alike (a one-block copy would have none to checkpoint, or show another list as its blocks). Where
    layer offload ``prefetching`` the next streamed block (on the deep model: see :data:`PREFETCH_FROM`), every
    shallow step streams at least two blocks, so that each prefetches as the deep one does: its one more block
    resident is there once, whatever the count streamed, not a figure that grows with it. Activation offload composes
    from two blocks and three: the first block, whose input is the embedding's output, keeps less on the device than
    any later one (TinyLlama: its input, 32 MiB), so a one-block copy would make each block after it weigh that much
    more.

    >>> [(p.offload_layers, n, w) for p, n, w in points(Plan(), 22)]
    [(0, 1, -20.0), (0, 2, 21.0)]
    >>> [(p.offload_layers, n, w) for p, n, w in points(Plan(offload_layers=2), 22)]
    [(1, 2, -19.0), (1, 3, 19.0), (2, 3, 1.0)]
    >>> [(p.offload_layers, n, w) for p, n, w in points(Plan(offload_layers=5), 22, prefetching=True)]
    [(2, 3, -18.0), (2, 4, 16.0), (3, 4, 3.0)]
    """
    unit = 2 if plan.checkpointing == "partial" else 1  # (every other block: a pair is the unit that repeats)
    fewest = max(fewest, 2) if plan.activation_offload else fewest
    streamed = plan.offload_layers
    resident = blocks - streamed
    least = max(unit, 2) if prefetching else unit  # the fewest blocks a shallow step streams
    if streamed == 0 or resident == 0:
        low = least if streamed else max(unit, fewest)
        scale = (blocks - low) / unit
        return [
            (plan.replace(offload_layers=low if streamed else 0), low, 1 - scale),
            (plan.replace(offload_layers=low + unit if streamed else 0), low + unit, scale),
        ]
    more_resident, more_streamed = (resident - unit) / unit, (streamed - least) / unit
    return [
        (plan.replace(offload_layers=least), least + unit, 1 - more_resident - more_streamed),
        (plan.replace(offload_layers=least), least + 2 * unit, more_resident),
        (plan.replace(offload_layers=least + unit), least + 2 * unit, more_streamed),
    ]


def compose(traces: list[tuple[Trace, float]], budget: int) -> Trace:
    """The trace of the deep step: each figure the weighted sum of the shallow ones' (see :func:`points`). The
    phase that first crosses ``budget`` is taken as the first phase, in the order they ran, whose composed peak
    does."""

    def total(figure: Callable[[Trace], float]) -> float:
        return sum(weight * figure(trace) for trace, weight in traces)

    def rounded(figure: Callable[[Trace], float]) -> int:
        return max(0, round(total(figure)))

    def phase_peak(key: tuple[Phase, int, int]) -> Callable[[Trace], float]:
        return lambda trace: dict(trace.phases).get(key, trace.base)

    def host_peak(key: tuple[Phase, int, int]) -> Callable[[Trace], float]:
        return lambda trace: dict(trace.hosts)[key]

    phases = tuple((key, rounded(phase_peak(key))) for key, _ in traces[-1][0].phases)
    crossed = next((phase for (phase, *_), peak in phases if peak > budget), None)
    # (the host's figures per region, where every shallow step's host grew in the same ones; else its peak's line)
    keys = [dict(trace.hosts).keys() for trace, _ in traces]
    alike = all(key == keys[0] for key in keys)
    hosts = tuple((key, rounded(host_peak(key))) for key in keys[0]) if alike else ()
    host_base = rounded(lambda t: t.host_base)
    host = max([host_base, *(peak for _, peak in hosts)]) if alike else rounded(lambda t: t.host)
    return Trace(
        base=rounded(lambda t: t.base), phases=phases, crossed=crossed, host=host, hosts=hosts, host_base=host_base,
        journal=rounded(lambda t: t.journal), transfers=rounded(lambda t: t.transfers),
        overlapped=rounded(lambda t: t.overlapped), uploaded=rounded(lambda t: t.uploaded),
        flops=max(0.0, total(lambda t: t.flops)), ops=max(0.0, total(lambda t: t.ops)),
        early=rounded(lambda t: t.early), window=max(0.0, total(lambda t: t.window)),
    )  # fmt: skip


class Deep(Protocol):
    """What :class:`Composed` needs of the engine's bench on the deep model."""

    batch: Any
    size: int
    budget: int
    capacity: int
    host_budget: int | None
    runner: Any
    speed: DeviceSpeed
    candidates: list[Candidate]

    def measure(self, plan: Plan) -> tuple[Candidate, int]: ...

    def judge(self, plan: Plan, trace: Trace) -> Candidate: ...


class Composed:
    """A bench (:class:`~oomguard._planner.walk.Bench`) whose measurements of the deep model are composed from
    shallow benches: ``shallow(n)`` is a bench of the same model with ``n`` blocks (made once, when first needed),
    whose ``trace(plan)`` runs a fake step. Where a shallow step fails, this plan and every later one is measured
    on the deep model instead. ``helped``: some of the shallow steps run in a :class:`~oomguard._planner.helper.Helper`
    process beside this one's (forked at the first measurement; :meth:`close` ends it). ``traces``: the shallow
    steps an earlier dry run of the same search ran (by plan, blocks and ``prefetch_from``), not run again; those
    run here are added to it."""

    def __init__(
        self,
        deep: Deep,
        blocks: int,
        shallow: Callable[[int], Any],
        helped: bool = False,
        traces: Traces | None = None,
    ) -> None:
        self.deep, self.blocks, self._make, self._helped = deep, blocks, shallow, helped
        self._fewest = 1 if is_transformers_model(deep.runner.effects.target.model) else 2  # (see points)
        self._helper: Helper | None = None
        self.batch, self.size, self.budget, self.runner = deep.batch, deep.size, deep.budget, deep.runner
        self.candidates, self.speed = deep.candidates, deep.speed
        self.benches: dict[int, Any] = {}
        #: The candidates composed so far (not measured in full); why composing stopped, if it did.
        self.composed: list[Candidate] = []
        self.failed: str | None = None
        self.refuted = False  # every composed plan that fitted did not in full (a walk then measured all in full)
        self.made = 0  # candidates composed (some may then have been measured in full)
        self.confirmed = False  # a composed recommendation was measured in full (confirm)
        self._traces: Traces = {} if traces is None else traces

    @property
    def steps(self) -> int:
        """Fake steps run on the shallow models (by the helper too)."""
        helped = self._helper.steps if self._helper is not None else 0
        return helped + sum(int(bench.steps) for bench in self.benches.values())

    def stepped_every_parameter(self) -> bool:
        """Whether every shallow copy's steps made optimizer state for every parameter it trains: then so does the
        deep model's step (its blocks are the copies' blocks, repeated), and its warm-up need not run forward and
        backward (:meth:`~oomguard._planner.bench.StepBench.stepped_every_parameter`)."""
        benches = list(self.benches.values())
        return self.failed is None and bool(benches) and all(bench.stepped_every_parameter() for bench in benches)

    def measure(self, plan: Plan) -> tuple[Candidate, int]:
        if self.failed is None:
            try:
                # (Layer offload's prefetching as on the deep model: from two streamed blocks on, or never.)
                prefetching = plan.offload_layers >= PREFETCH_FROM
                ahead = 2 if prefetching else self.blocks + 1
                steps = points(plan, self.blocks, prefetching, self._fewest)
                shallow = self._traces_of([(p, n, ahead) for p, n, _ in steps])
                traces = [(trace, weight) for trace, (*_, weight) in zip(shallow, steps, strict=True)]
            except (DryRunLimit, Paused):
                raise
            except Exception as error:  # a model that does not run with fewer blocks (indexed by a count, say)
                self.failed = f"{type(error).__name__}: {error}"
                logger.debug("planner: measuring every plan in full (a shallow copy failed: %s)", self.failed)
            else:
                trace = compose(traces, self.budget)
                self.composed.append(self.deep.judge(plan, trace))
                self.made += 1
                return self.composed[-1], trace.base
        return self.deep.measure(plan)

    def close(self) -> None:
        """End the helper process, if one runs."""
        if self._helper is not None:
            self._helper.close()

    def _traces_of(self, steps: list[tuple[Plan, int, int]]) -> list[Trace]:
        """The shallow steps' traces, each run once; with a helper, some run there (see :func:`_helps`), beside those
        run here."""
        if self._helped and self._helper is None:
            self._helper = Helper(self._trace, lambda: self.steps)
        helper = self._helper
        there = [] if helper is None else [s for s in dict.fromkeys(steps) if s not in self._traces and _helps(s)]
        for step in there:
            helper.send(step)  # type: ignore[union-attr]
        for step in steps:
            if step not in there:
                self._trace(*step)
        for step in there:
            self._traces[step] = helper.receive()  # type: ignore[union-attr]
        return [self._traces[step] for step in steps]

    def _trace(self, plan: Plan, blocks: int, prefetch_from: int) -> Trace:
        """The shallow step, run once: plans that differ only in how many of the deep model's blocks they stream
        share their shallow steps (a walk down layer offload's levels costs its first level's)."""
        if (plan, blocks, prefetch_from) not in self._traces:
            bench = self._bench(blocks)
            bench.runner.effects.target.prefetch_from = prefetch_from
            self._traces[plan, blocks, prefetch_from] = bench.trace(plan)
        return self._traces[plan, blocks, prefetch_from]

    def _bench(self, blocks: int) -> Any:
        if blocks not in self.benches:
            bench = self._make(blocks)
            # (where a copy's steps made state for every parameter, so do a deeper copy's, whose blocks are the
            # same: its warm-up is then the optimizer step alone, not a whole step of its blocks)
            bench.every_parameter_steps = bench.every_parameter_steps or self.stepped_every_parameter()
            self.benches[blocks] = bench
        return self.benches[blocks]


def _helps(step: tuple[Plan, int, int]) -> bool:
    """Whether a shallow step runs in the helper: those of an even depth in the plan's units (blocks, or pairs of
    them for partial checkpointing) do. So every composition's steps are split between the two processes (1 and 2
    blocks; 2 and 3; 3 and 4 where streamed blocks are prefetched; 2 and 4 for pairs; 4 and 6 for pairs streamed),
    and each depth's model is built and warmed in one process, but for the 2-block one where pairs are measured."""
    plan, blocks, _ = step
    return (blocks // (2 if plan.checkpointing == "partial" else 1)) % 2 == 0


def confirm(deep: Deep, composed: list[Candidate]) -> Confirmed:
    """Measure on the deep model the composed plan predicted fastest among those that fit, in its place in
    ``deep.candidates``, unless it clears the device and the host by :data:`CLEAR`; again with the next one where
    the full step does not fit after all. ``refuted`` where every composed plan that fitted was refuted so (the walk
    stopped on a composition that was wrong: measure in full).

    A composition is exact where each phase's peak in each region of it (:mod:`oomguard._planner.regions`) is one
    moment whatever the depth: byte for byte on every candidate of the three 1B-class presets' walks (63 plans) and
    of the tests' models. A peak that switches moments within a region as blocks are added would make the line
    through two shallow depths pass below the deep one (as the backward's did before regions: llama-3.2-1b, 9 %
    below, at the embedding's gradient on two blocks and inside the stack on sixteen). The margin is for that.
    """
    refuted = measured = False
    while True:
        fitting = sorted((c for c in composed if c.fits), key=lambda c: c.predicted_seconds)
        if not fitting:
            return Confirmed(not refuted, measured)
        if _clear(fitting[0], deep.capacity, deep.host_budget):
            return Confirmed(True, measured)
        composed.remove(fitting[0])
        measured = True
        where = next(i for i, c in enumerate(deep.candidates) if c is fitting[0])
        full, _ = deep.measure(fitting[0].plan)
        deep.candidates[where] = deep.candidates.pop()  # (measure appended it)
        if full.fits:
            return Confirmed(True, True)
        refuted = True


class Confirmed(NamedTuple):
    """What :func:`confirm` found: whether a composed plan that fits stands (none refuted, or one measured that
    fits), and whether one was measured in full."""

    stands: bool
    measured: bool


def _clear(candidate: Candidate, capacity: int, host_budget: int | None) -> bool:
    """Whether a composed ``candidate`` leaves :data:`CLEAR` of the device and of the host budget free."""
    device = candidate.peak_bytes + candidate.device_overhead_bytes <= (1 - CLEAR) * capacity
    return device and (host_budget is None or candidate.host_bytes <= (1 - CLEAR) * host_budget)


def uniform_blocks(config: Any) -> bool:
    """Whether a transformers ``config`` (or None) builds blocks that are alike: not where its per-layer settings
    (``layer_types``: sliding and full attention, say) differ from block to block, as a shallow copy would keep only
    its first blocks' kinds. Such a model is measured in full.

    >>> uniform_blocks(None), uniform_blocks(type("C", (), {"layer_types": ["sliding_attention", "full_attention"]}))
    (True, False)
    """
    kinds = getattr(config, "layer_types", None)
    return not isinstance(kinds, list) or len(set(kinds)) <= 1
