"""Predictive sizing: how large a micro-batch fits, from the peaks of the steps that succeeded.

For one configuration (a plan without its micro-batch size) the peak device memory of an attempt is modelled as

    peak - base = fixed + per_item * items

where ``base`` is what was allocated when the attempt began (weights, optimizer state, the batch), ``items`` is
the size of the largest tensor in one micro-batch (samples x tokens for a language model, so batches of other
shapes share the model) and ``fixed`` is what does not grow with the micro-batch (gradients, workspaces). Two
successful attempts of different sizes give both coefficients; with one, ``fixed`` is taken as the gradients'
size. Failures tighten ``per_item`` from below. The largest micro-batch predicted to fit, with a safety margin,
lets the guard jump straight to it instead of halving blindly: on the way down after an OOM (never above a
halving), for a batch shape it has not seen, and on the way back up when it relaxes a plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oomguard._ladder.plan import Plan

__all__ = ["PeakModel"]

_MAX_POINTS = 8  # recent successes kept per configuration


@dataclass
class _Fit:
    successes: list[tuple[int, int]] = field(default_factory=list)  # (items, peak - base)
    per_item_floor: float = 0.0  # from failures: per_item must exceed this


class PeakModel:
    """Observed peaks per configuration, and the largest micro-batch predicted to fit.

    >>> model = PeakModel(margin=0.1)
    >>> model.record_success(Plan(micro_batch_size=4), items=400, excess=5_000)
    >>> model.max_micro_batch(Plan(), capacity=20_000, base=4_000, items_per_sample=100, fixed_hint=1_000)
    13
    """

    def __init__(self, margin: float = 0.1) -> None:
        if not 0 <= margin < 1:
            raise ValueError(f"the safety margin must be in [0, 1), got {margin}")
        self.margin = margin
        self._fits: dict[Plan, _Fit] = {}

    @staticmethod
    def _key(plan: Plan) -> Plan:
        return plan.replace(micro_batch_size=None)

    def record_success(self, plan: Plan, items: int, excess: int) -> None:
        """A successful attempt on ``plan``: its largest micro-batch held ``items``; it peaked ``excess`` above base."""
        if items <= 0 or excess <= 0:
            return
        fit = self._fits.setdefault(self._key(plan), _Fit())
        others = [point for point in fit.successes if point[0] != items]
        fit.successes = [*others[-(_MAX_POINTS - 1) :], (items, excess)]

    def record_failure(self, plan: Plan, items: int, capacity: int, base: int, fixed_hint: int) -> None:
        """An attempt on ``plan`` with micro-batches of ``items`` ran out of ``capacity``."""
        if items <= 0:
            return
        fit = self._fits.setdefault(self._key(plan), _Fit())
        fit.per_item_floor = max(fit.per_item_floor, (capacity - base - fixed_hint) / items)

    def coefficients(self, plan: Plan, fixed_hint: int) -> tuple[float, float] | None:
        """``(fixed, per_item)`` for ``plan``'s configuration, or None before any success."""
        fit = self._fits.get(self._key(plan))
        if fit is None or not fit.successes:
            return None
        points = fit.successes
        if len({items for items, _ in points}) >= 2:  # least squares through the points
            n = len(points)
            mean_x = sum(x for x, _ in points) / n
            mean_y = sum(y for _, y in points) / n
            var = sum((x - mean_x) ** 2 for x, _ in points)
            per_item = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
            fixed = mean_y - per_item * mean_x
            # Only trust the fit if it is physical; otherwise fall back to the one-point rule below.
            if per_item > 0 and fixed >= 0:
                return fixed, max(per_item, fit.per_item_floor)
        items, excess = max(points)  # the largest micro-batch seen
        per_item = max((excess - fixed_hint) / items, excess / (2 * items))
        return float(fixed_hint), max(per_item, fit.per_item_floor)

    def max_micro_batch(
        self, plan: Plan, capacity: int, base: int, items_per_sample: float, fixed_hint: int
    ) -> int | None:
        """The largest micro-batch (in samples) predicted to fit, or None when there is nothing to go on."""
        coefficients = self.coefficients(plan, fixed_hint)
        if coefficients is None or items_per_sample <= 0:
            return None
        fixed, per_item = coefficients
        room = capacity * (1 - self.margin) - base - fixed
        return max(0, math.floor(room / (per_item * items_per_sample)))
