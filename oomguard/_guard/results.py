"""What a guarded call returns, and what a guard says about itself."""

from __future__ import annotations

from dataclasses import dataclass

from oomguard._ladder.plan import Plan

__all__ = ["GuardSummary", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one guarded call did.

    ``loss`` is the whole batch's loss (weighted exactly across micro-batches); ``rungs`` names the rungs in
    effect for this step (``"micro_batch"`` only when the batch was split); ``ooms`` counts the out-of-memory
    errors caught during this call; ``transfer_bytes`` the bytes it copied between host and device, every attempt
    included (offloaded layers and activations, the optimizer journal).
    """

    loss: float
    micro_batch_size: int
    rungs: tuple[str, ...]
    ooms: int
    step: int
    batch_size: int
    micro_batches: int
    plan: Plan
    grad_norm: float | None = None
    seconds_lost: float = 0.0
    transfer_bytes: int = 0


@dataclass(frozen=True)
class GuardSummary:
    """Which fallbacks a guard needed, and how often. ``str()`` gives a readable paragraph."""

    steps: int
    ooms: int
    fallbacks: dict[str, int]
    recovered_steps: int
    exhausted: int
    seconds_lost: float
    plan: Plan
    #: Tries at stepping back up (a less degraded plan) after clean steps: how many held and how many ran out of memory.
    relaxations: tuple[int, int] = (0, 0)
    #: Steps run with each rung in effect.
    steps_by_rung: dict[str, int] | None = None
    #: Out-of-memory errors on a plan that had run clean, tried once more on it before moving down the ladder.
    retries: int = 0

    def __str__(self) -> str:
        if not self.ooms:
            return f"{self.steps} steps, no out-of-memory error: no fallback was needed."
        needed = ", ".join(f"{name} x{count}" for name, count in self.fallbacks.items()) or "none"
        lines = [
            f"{self.steps} steps, {self.ooms} out-of-memory error(s) caught, {self.recovered_steps} step(s) "
            f"recovered, {self.exhausted} given up; {self.seconds_lost:.1f} s spent on failed attempts.",
            f"Fallbacks needed: {needed}.",
            f"Current plan: {self.plan.describe()}.",
        ]
        if self.retries:
            lines.append(f"Tried the same plan once more after {self.retries} OOM(s) on a plan that had run clean.")
        held, failed = self.relaxations
        if held or failed:
            lines.append(f"Stepped back up {held} time(s); {failed} try(s) at a less degraded plan ran out of memory.")
        return "\n".join(lines)
