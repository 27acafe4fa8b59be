"""The planner's search: for every combination of the rungs that trade time for memory, the largest micro-batch
that fits.

Walking the ladder finds the first plan that fits, not the fastest: whether micro-batches of 4 with activations
offloaded beat micro-batches of 1 in bf16 depends on the device. The search measures each configuration
(precision x checkpointing x activation offload, each offload rung either off or as deep as the plan searched
around) at the largest micro-batch that fits, so that a time model or a stopwatch can choose among them. Mixed
precision is searched only where that plan already runs it: a faster plan never makes the maths less exact than
memory forced it to be.

Two facts keep it short. A configuration with every rung at least as deep (the same precision) saves at least
as much memory, so its largest micro-batch is at least as large: the bisection starts there. And it does at
least as much work per sample: where a lighter configuration already runs the whole batch, the deeper one
cannot be faster and is not measured.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Plan
from oomguard._ladder.rungs import Rung, RungContext

__all__ = ["configurations", "search"]

#: Rungs searched at every level they reach; offload rungs only off or at the searched plan's level; others fixed.
_TRADING = frozenset({"amp", "checkpointing", "activation_offload"})
#: Rungs that change the training maths: searched only where the plan searched around already has them.
_INEXACT = frozenset({"amp"})
_OFFLOADING = frozenset({"optimizer_offload", "layer_offload"})
#: At most this many fake steps per search (each is a fraction of a second for a small model, seconds for 1B).
MAX_MEASUREMENTS = 40


def configurations(around: Plan, ladder: Ladder, context: RungContext) -> list[tuple[tuple[int, ...], Plan]]:
    """Every configuration of ``ladder``'s rungs (but micro-batching) to search around ``around``, as (levels,
    plan on the whole batch), the lightest first. ``levels`` puts the rung of precision first."""
    size = context.batch_size
    deeper = [rung for rung in ladder.rungs if rung is not ladder.sizing]
    deeper.sort(key=lambda rung: rung.name != "amp")  # precision first: configurations compare within one
    choices = [_levels(rung, around, context) for rung in deeper]
    found = []
    for levels in itertools.product(*choices):
        plan = around.replace(micro_batch_size=None)
        for rung, level in zip(deeper, levels, strict=True):
            plan = rung.at_level(plan, level, size)
        found.append((levels, plan))
    return sorted(found, key=lambda item: sum(item[0]))


def _levels(rung: Rung, around: Plan, context: RungContext) -> list[int]:
    size, level = context.batch_size, rung.level(around, context.batch_size)
    if rung.name in _OFFLOADING:
        return sorted({0, level})
    if rung.name not in _TRADING:
        return [level]
    if rung.name in _INEXACT and level == 0:
        return [0]
    levels, plan = [0], rung.at_level(around, 0, size)
    while True:
        deeper = rung.escalate(plan, context)
        if deeper is None or rung.level(deeper, size) in levels:
            return levels
        levels.append(rung.level(deeper, size))
        plan = deeper


def search(
    configs: list[tuple[tuple[int, ...], Plan]],
    size: int,
    smallest: int,
    fits: Callable[[Plan], bool],
    limit: int = MAX_MEASUREMENTS,
) -> dict[Plan, int | None]:
    """The largest micro-batch (among the sizes halving visits, down to ``smallest``) at which each configuration
    ``fits`` (a measurement), None where none does; configurations dominated as the module says are left out,
    and so is everything after ``limit`` measurements (a size the limit cut short is the largest known to fit)."""
    largest: dict[tuple[int, ...], int | None] = {}
    found: dict[Plan, int | None] = {}
    measured = 0
    for levels, config in configs:
        lighter = [
            largest[k] for k in largest if k[0] == levels[0] and all(a <= b for a, b in zip(k, levels, strict=True))
        ]
        if size in lighter:
            continue  # a lighter configuration runs the whole batch: this one only adds work
        low = max((m for m in lighter if m is not None), default=None)
        sizes = sorted(s for s in {-(-size // 2**k) for k in range(size.bit_length() + 1)} if s >= smallest)
        candidates = [s for s in sizes if low is None or s > low]
        best = low
        while candidates and measured < limit:
            middle = candidates[len(candidates) // 2]
            measured += 1
            if fits(config.replace(micro_batch_size=None if middle >= size else middle)):
                best, candidates = middle, [s for s in candidates if s > middle]
            else:
                candidates = [s for s in candidates if s < middle]
        largest[levels] = found[config] = best
        if measured >= limit:
            break
    return found
