"""The micro_batch rung: split the batch into 2, 4, 8 ... micro-batches with exact gradient accumulation.

The ladder's sizing rung (see :mod:`oomguard._ladder.ladder`). It has no effect of its own: the step runner
splits the batch the plan says, and nothing to ask of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from oomguard._ladder.plan import ACTIVATION_PHASES, Phase, Plan
from oomguard._ladder.rungs import RungContext, Sizing, Trade

__all__ = ["MicroBatch"]


@dataclass(frozen=True)
class MicroBatch(Sizing):
    """Halve the micro-batch size: 2, 4, 8 ... micro-batches with exact gradient accumulation.

    Stops at ``min_size`` samples per micro-batch (1 by default). An uneven last micro-batch is fine. Its level
    is how many samples fewer than the batch a micro-batch holds.
    """

    min_size: int = 1
    name: str = "micro_batch"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    field: ClassVar[str] = "micro_batch_size"
    after: ClassVar[None] = None  # the first rung: the one that changes least
    trade: ClassVar[Trade] = "fixed"  # (the search measures every configuration at its largest micro-batch)

    def level(self, plan: Plan, batch_size: int) -> int:
        return batch_size - plan.effective_micro_batch_size(batch_size)

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        return plan.replace(micro_batch_size=None if level <= 0 else batch_size - level)

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        current = plan.effective_micro_batch_size(context.batch_size)
        if current <= self.min_size:
            return None
        target = -(-current // 2)
        if context.max_micro_batch is not None:  # jump past halvings the peak model says cannot fit
            target = min(target, context.max_micro_batch)
        return plan.replace(micro_batch_size=max(self.min_size, target))

    def relax(self, plan: Plan, batch_size: int) -> Plan | None:
        """Micro-batches twice as large, up to the whole batch."""
        current = plan.effective_micro_batch_size(batch_size)
        if current >= batch_size:
            return None
        doubled = 2 * current
        return plan.replace(micro_batch_size=None if doubled >= batch_size else doubled)

    def floor(self, batch_size: int) -> int:
        return min(self.min_size, batch_size)

    def reaches(self, plan: Plan, context: RungContext) -> bool:
        """Micro-batches of any size down to ``min_size`` (predictive sizing picks sizes halving never visits)."""
        return plan.micro_batch_size is None or plan.micro_batch_size >= self.min_size

    def setting(self, plan: Plan, batch_size: int) -> str:
        return f"micro_batch_size={plan.micro_batch_size}"
