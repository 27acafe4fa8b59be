"""What an attempt comes back with: what it produced, or where and on which plan it failed."""

from __future__ import annotations

from dataclasses import dataclass

from oomguard._distributed.agreement import Verdict
from oomguard._ladder.plan import Phase, Plan

__all__ = ["AttemptFailure", "AttemptOutput", "Progress"]


@dataclass(frozen=True)
class AttemptOutput:
    """What a successful attempt produced."""

    loss: float
    grad_norm: float | None
    micro_batches: int
    micro_batch_size: int
    base: int  # device memory allocated when the attempt began, after its plan was applied
    peak: int  # the attempt's peak device memory


@dataclass(frozen=True, eq=False)
class AttemptFailure:
    """A failed attempt as it comes back to the recovery loop: the error, the plan it ran, where it failed.

    What the attempt held is already dropped (its gradients, the plan's per-attempt state); the error still holds
    the frames of the failed forward and backward until the loop releases them.
    """

    error: Exception
    plan: Plan
    phase: Phase
    micro_batch: int  # the micro-batch it was on (0 outside forward and backward)
    base: int | None  # device memory allocated when it began, after its plan was applied (None: unknown)
    agreed_phase: Phase | None = None  # under distributed training: the deepest phase any rank failed in


@dataclass
class Progress:
    """Where the attempt in flight is: written by the step runner as it goes, read by what accounts memory during
    it (the dry-run planner's probe), and copied into the attempt's :class:`AttemptFailure` if it fails."""

    phase: Phase = Phase.APPLY
    micro_batch: int = 0
    base: int = 0
    verdict: Verdict | None = None  # what the ranks agreed after this attempt's backward
