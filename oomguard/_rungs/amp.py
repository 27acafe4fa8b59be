"""The amp rung: mixed precision, bf16 autocast where the device supports it, else fp16 with a gradient scaler.

Its effect is :class:`~oomguard._effects.precision.AutocastEffect`; it changes the maths (within amp's
tolerance), so tuning searches it only where memory already forced it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._backends.memory import bf16_supported
from oomguard._effects.base import EffectTarget
from oomguard._effects.precision import AutocastEffect
from oomguard._effects.sharding import SHARDED, sharded_fact
from oomguard._ladder.plan import ACTIVATION_PHASES, Phase, Plan, Precision
from oomguard._ladder.rungs import FieldRung, RungContext, Trade

__all__ = ["Amp"]


@dataclass(frozen=True)
class Amp(FieldRung):
    """Mixed precision: bf16 autocast where the device supports it, else fp16 with a gradient scaler.

    ``dtype`` forces one of the two.
    """

    dtype: Precision | None = None
    name: str = "amp"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    field: ClassVar[str] = "precision"
    levels: ClassVar[tuple[Any, ...]] = (None, "bf16", "fp16")  # fp16 the deeper: what every device runs
    phrases: ClassVar[tuple[str, ...]] = ("{}", "{}")
    after: ClassVar[str] = "micro_batch"
    exact: ClassVar[bool] = False
    trade: ClassVar[Trade] = "levels"

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.precision is not None or not context.amp_available:
            return None
        dtype: Precision = self.dtype or ("bf16" if context.bf16_supported else "fp16")
        if dtype == "fp16" and context.fact(SHARDED, False):
            return None  # (FSDP2: GradScaler's unscale would decide on each rank's shard alone)
        return plan.replace(precision=dtype)

    def relax(self, plan: Plan, batch_size: int) -> Plan | None:
        return plan.replace(precision=None) if plan.precision is not None else None

    def reaches(self, plan: Plan, context: RungContext) -> bool:
        if plan.precision == "fp16" and self.dtype is None and context.distributed and context.amp_available:
            return True  # ranks on devices that differ agree on fp16, which every device runs
        return super().reaches(plan, context)

    def effect(self) -> type[AutocastEffect]:
        return AutocastEffect

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        """Whether the device runs bf16, and whether mixed precision is ours to give (not Accelerate's)."""
        accelerator = target.accelerator
        return {
            "bf16_supported": bf16_supported(target.device),
            "amp_available": accelerator is None or getattr(accelerator, "mixed_precision", "no") == "no",
            **sharded_fact(target),
        }
