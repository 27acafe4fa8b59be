"""The planner's search: for every combination of the rungs that trade time for memory, the largest micro-batch
that fits.

Walking the ladder finds the first plan that fits, not the fastest: whether micro-batches of 4 with activations
offloaded beat micro-batches of 1 in bf16 depends on the device. The search measures each configuration of the
ladder's rungs, each as its ``trade`` declares (every level it reaches, as precision, checkpointing and
activation offload do; off or as deep as the plan searched around, as the offload rungs do; or as that plan has
it), at the largest micro-batch that fits, so that a time model or a stopwatch can choose among them. A rung
that is not exact (mixed precision) is searched only where that plan already engages it: a faster plan never
makes the maths less exact than memory forced it to be.

Three facts keep it short. A configuration with every rung at least as deep (the inexact ones at the same level)
saves at least as much memory, so its largest micro-batch is at least as large: the bisection starts at the
lighter ones' and stops at the deeper ones'. A configuration lighter than one that fits no micro-batch fits none
either, and is not measured. And a deeper configuration does at least as much work per sample: where a lighter
one already runs the whole batch, the deeper one cannot be faster and is not measured.

The lightest configuration is measured first. Where it fits some micro-batch (a small model), the rest follow
lightest first, and the dominated ones are skipped. Where it fits none (a large model, that only the deep rungs
fit), the rest are measured deepest first, so that each one that fails rules out every one lighter than it:
lightest first, a 1B model's search spent its every measurement on configurations that cannot fit and never
reached those that do.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Plan
from oomguard._ladder.rungs import Rung, RungContext
from oomguard._planner.report import Candidate

__all__ = [
    "Paused",
    "SearchBudget",
    "configurations",
    "deepest_exact",
    "halvings",
    "inexact",
    "largest_fitting",
    "search",
]

#: At most this many fake steps per search (each is a fraction of a second for a small model, seconds for 1B).
MAX_MEASUREMENTS = 40


def configurations(around: Plan, ladder: Ladder, context: RungContext) -> list[tuple[tuple[int, ...], Plan]]:
    """Every configuration of ``ladder``'s rungs (but micro-batching) to search around ``around``, as (levels,
    plan on the whole batch), the lightest first. ``levels`` puts the :func:`inexact` rungs first (precision):
    configurations compare within the same levels of those."""
    size = context.batch_size
    deeper = [rung for rung in ladder.rungs if rung is not ladder.sizing]
    deeper.sort(key=lambda rung: not _traded_inexact(rung))  # (a stable sort: the ladder's order otherwise)
    choices = [_levels(rung, around, context) for rung in deeper]
    found = []
    for levels in itertools.product(*choices):
        plan = around.replace(micro_batch_size=None)
        for rung, level in zip(deeper, levels, strict=True):
            plan = rung.at_level(plan, level, size)
        found.append((levels, plan))
    return sorted(found, key=lambda item: sum(item[0]))


def deepest_exact(around: Plan, ladder: Ladder, context: RungContext) -> Plan:
    """``around`` with every exact rung the search trades at every level (checkpointing, activation offload, the
    chunked loss) at the deepest level it reaches; the rest (precision, what is offloaded, the micro-batch) as
    ``around`` has them: the configuration that relieves the most activation memory without changing the maths
    or moving state."""
    plan = around
    for rung in ladder.rungs:
        if rung is not ladder.sizing and rung.trade == "levels" and rung.exact:
            plan = rung.at_level(plan, _levels(rung, plan, context)[-1], context.batch_size)
    return plan


def inexact(ladder: Ladder) -> int:
    """How many of the levels of each of :func:`configurations` belong to rungs traded at every level that are not
    exact: a configuration is lighter than another only at the same levels of those."""
    return sum(1 for rung in ladder.rungs if rung is not ladder.sizing and _traded_inexact(rung))


def _traded_inexact(rung: Rung) -> bool:
    return rung.trade == "levels" and not rung.exact


def _levels(rung: Rung, around: Plan, context: RungContext) -> list[int]:
    """The levels of ``rung`` the search tries around ``around``, as the rung's ``trade`` says."""
    size, level = context.batch_size, rung.level(around, context.batch_size)
    if rung.trade == "off_or_level":
        return sorted({0, level})
    if rung.trade == "fixed":
        return [level]
    if not rung.exact and level == 0:
        return [0]  # (the maths stays as exact as the plan searched around has it)
    levels, plan = [0], rung.at_level(around, 0, size)
    while True:
        deeper = rung.escalate(plan, context)
        if deeper is None or rung.level(deeper, size) in levels:
            return levels
        levels.append(rung.level(deeper, size))
        plan = deeper


def halvings(size: int) -> list[int]:
    """The micro-batch sizes halving visits from a batch of ``size``: size, size/2, size/4 ... 1 (rounded up),
    ascending."""
    return sorted({-(-size // 2**k) for k in range(size.bit_length() + 1)})


def _always() -> bool:
    return True


class Paused(Exception):
    """Raised by :meth:`SearchBudget.gate` where a search's time is up in the middle of a measurement: the dry run
    ends there, incomplete, and the search goes on in a later one."""


class SearchBudget:
    """What one dry run of a search may spend: no new measurement starts (but its first) that would end more than
    ``seconds`` after it began, by the time the measurements so far took on average; and a plan measured by an
    earlier dry run of the same search (``known``, kept by the caller and added to here) is not run again. A
    search that stopped for time (``complete`` False) is run again later, from the start: it makes the same
    choices, answered from ``known`` this time, and goes on where it stopped.

    A measurement composed of several fake steps of shallow copies (:mod:`oomguard._planner.compose`) may stop
    between two of them (:meth:`gate`), so that a call's search is about the time given whatever a measurement
    costs: the caller keeps the steps it ran, which the measurement takes again in the later dry run."""

    def __init__(self, seconds: float | None, known: dict[Plan, Candidate] | None = None) -> None:
        self.known = {} if known is None else known
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.new, self.complete = 0, True
        self._spent = 0.0  # seconds the new measurements took
        self._gated = 0  # fake steps started through the gate
        self._first = 0.0  # when the first of them started

    def more(self) -> bool:
        """Whether the search may measure one more plan (:func:`search`'s ``more``)."""
        if self.new and self.deadline is not None and time.monotonic() + self._spent / self.new > self.deadline:
            self.complete = False
        return self.complete

    def gate(self) -> None:
        """Before each fake step of a measurement: raise :class:`Paused` where it is expected to end past the time, by
        the mean of those this dry run started so far (its first always runs: every dry run of a search measures
        something)."""
        now = time.monotonic()
        if self._gated and self.deadline is not None and now + (now - self._first) / self._gated > self.deadline:
            self.complete = False
        if not self.complete:
            raise Paused
        if not self._gated:
            self._first = now
        self._gated += 1

    def fits(self, measure: Callable[[Plan], Candidate], known: Callable[[Candidate], None]) -> Callable[[Plan], bool]:
        """:func:`search`'s ``fits``: whether a plan fits, by ``measure`` or, for a plan measured before, from what
        was measured (passed to ``known``)."""

        def at(plan: Plan) -> bool:
            if plan in self.known:
                known(self.known[plan])
            else:
                started = time.monotonic()
                self.known[plan] = measure(plan)
                self.new, self._spent = self.new + 1, self._spent + time.monotonic() - started
            return self.known[plan].fits

        return at


def largest_fitting(
    sizes: Sequence[int], fits: Callable[[int], bool], more: Callable[[], bool] = _always
) -> int | None:
    """The largest of ``sizes`` (ascending) that ``fits``, by bisection, assuming that a size fits when a larger one
    does; None where none measured fits. ``more`` is asked before each measurement: when it says no, the largest
    size known to fit so far is the answer."""
    best, left = None, list(sizes)
    while left and more():
        middle = left[len(left) // 2]
        if fits(middle):
            best, left = middle, [s for s in left if s > middle]
        else:
            left = [s for s in left if s < middle]
    return best


def search(
    configs: list[tuple[tuple[int, ...], Plan]],
    size: int,
    smallest: int,
    fits: Callable[[Plan], bool],
    limit: int = MAX_MEASUREMENTS,
    fixed: int = 1,
    more: Callable[[], bool] = _always,
) -> dict[Plan, int | None]:
    """The largest micro-batch (among the sizes halving visits, down to ``smallest``) at which each configuration
    ``fits`` (a measurement), None where none does; configurations dominated as the module says are left out,
    and so is everything after ``limit`` measurements or once ``more`` says no (asked before each measurement:
    a time budget); a size cut short is the largest known to fit. The first ``fixed`` levels of
    each configuration are compared for equality, not order (see :func:`inexact`)."""
    largest: dict[tuple[int, ...], int | None] = {}
    found: dict[Plan, int | None] = {}
    measured, stopped = 0, False

    def going() -> bool:  # (asked only before a measurement)
        nonlocal stopped
        stopped = stopped or not more()
        return measured < limit and not stopped

    def measure(config: Plan) -> Callable[[int], bool]:
        def at(micro: int) -> bool:  # (one measurement, counted against the limit)
            nonlocal measured
            measured += 1
            return fits(config.replace(micro_batch_size=None if micro >= size else micro))

        return at

    def visit(levels: tuple[int, ...], config: Plan) -> None:
        lighter = [largest[k] for k in largest if _lighter(k, levels, fixed)]
        deeper = [largest[k] for k in largest if _lighter(levels, k, fixed)]
        if size in lighter:
            return  # a lighter configuration runs the whole batch: this one only adds work
        if None in deeper:
            largest[levels] = found[config] = None  # a deeper configuration fits no micro-batch: nor does this one
            return
        low = max((m for m in lighter if m is not None), default=None)
        high = min((m for m in deeper if m is not None), default=size)
        candidates = [s for s in halvings(size) if smallest <= s <= high and (low is None or s > low)]
        best = largest_fitting(candidates, measure(config), going)
        largest[levels] = found[config] = best if best is not None else low

    if not configs:
        return found
    visit(*configs[0])
    rest = configs[:0:-1] if found[configs[0][1]] is None else configs[1:]  # (deepest first: see the module)
    for levels, config in rest:
        if measured >= limit or stopped:
            break
        visit(levels, config)
    return found


def _lighter(known: tuple[int, ...], levels: tuple[int, ...], fixed: int) -> bool:
    """Whether the configuration at ``known`` levels is at most as deep as ``levels`` in every rung (the first
    ``fixed``, the inexact ones, at the same level)."""
    same = known[:fixed] == levels[:fixed]
    return same and all(a <= b for a, b in zip(known, levels, strict=True))
