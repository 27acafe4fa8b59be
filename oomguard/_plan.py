"""The plan: a small immutable description of how one training step is run.

A plan says how the batch is split and (in later rungs) which memory-saving techniques are engaged. Rungs
turn a plan into a cheaper one; the step runner reads it; nothing else changes it. Being frozen, a plan can be
logged, compared, used as a dict key and stored on disk as it is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """How a training step is run.

    Attributes:
        micro_batch_size: the largest number of samples run through forward and backward at once; ``None``
            runs the whole batch in one pass. A batch larger than this is split into
            ``ceil(batch_size / micro_batch_size)`` micro-batches whose gradients are accumulated exactly.

    >>> Plan().micro_batches(8), Plan(micro_batch_size=3).micro_batches(8)
    (1, 3)
    """

    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.micro_batch_size is not None and (
            isinstance(self.micro_batch_size, bool)
            or not isinstance(self.micro_batch_size, int)
            or self.micro_batch_size < 1
        ):
            raise ValueError(
                f"Plan.micro_batch_size must be a positive int or None (the whole batch), got {self.micro_batch_size!r}"
            )

    def effective_micro_batch_size(self, batch_size: int) -> int:
        """The micro-batch size this plan uses for a batch of ``batch_size`` samples."""
        if self.micro_batch_size is None:
            return batch_size
        return min(self.micro_batch_size, batch_size)

    def micro_batches(self, batch_size: int) -> int:
        """How many micro-batches a batch of ``batch_size`` samples is split into."""
        return max(1, math.ceil(batch_size / max(1, self.effective_micro_batch_size(batch_size))))

    def rungs(self, batch_size: int) -> tuple[str, ...]:
        """Names of the rungs in effect for a batch of this size (``"micro_batch"`` only if it is split)."""
        return ("micro_batch",) if self.micro_batches(batch_size) > 1 else ()

    def replace(self, **changes: Any) -> Plan:
        """A copy of this plan with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready data."""
        return dataclasses.asdict(self)

    def describe(self, batch_size: int | None = None) -> str:
        """A short human-readable form, e.g. ``"whole batch"`` or ``"micro-batches of 4 (x2)"``."""
        if self.micro_batch_size is None or (batch_size is not None and self.micro_batch_size >= batch_size):
            return "whole batch"
        if batch_size is None:
            return f"micro-batches of {self.micro_batch_size}"
        return f"micro-batches of {self.micro_batch_size} (x{self.micro_batches(batch_size)})"
