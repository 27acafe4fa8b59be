"""The amp rung: mixed precision, bf16 autocast where the device supports it, else fp16 with a gradient scaler.

Its effect is :class:`~oomguard._effects.precision.AutocastEffect`, which also holds frozen linear weights in that
precision on the device, exactly (their fp32 originals in host memory: its host bytes); it changes the maths
(within amp's tolerance), so tuning searches it only where memory already forced it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._backends.memory import bf16_supported
from oomguard._effects.base import EffectTarget
from oomguard._effects.precision import AutocastEffect, half_candidates, held_bytes
from oomguard._effects.sharding import SHARDED, sharded_fact
from oomguard._effects.weights import lm_head
from oomguard._ladder.plan import ACTIVATION_PHASES, Phase, Plan, Precision
from oomguard._ladder.rungs import FieldRung, RungContext, Trade

__all__ = ["Amp"]


@dataclass(frozen=True)
class Amp(FieldRung):
    """Mixed precision: bf16 autocast where the device supports it, else fp16 with a gradient scaler; frozen fp32
    linear weights (a LoRA job's base) held in that precision on the device meanwhile, their originals on the host
    (every matrix product reads the operands autocast would make, bit for bit; any other read the original).

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

    def host_bytes(self, plan: Plan, context: RungContext) -> int:
        """The fp32 originals of the frozen weights the effect holds in half precision (where host memory is not
        the device's), the output head's left out while the plan has the chunked loss. The weights layer offload
        streams, or the quantized_weights rung holds, are on the host whole in their place: the same bytes."""
        if plan.precision is None or not context.can_offload:
            return 0
        head = int(context.fact("half_head_bytes", 0)) if plan.level("chunked_loss") else 0
        return int(context.fact("half_bytes", 0)) - head

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        """Whether the device runs bf16, whether mixed precision is ours to give (not Accelerate's), and the bytes
        of the frozen weights the effect would hold (the output head's apart)."""
        accelerator = target.accelerator
        held = half_candidates(target.model)
        head = lm_head(target.model)
        return {
            "bf16_supported": bf16_supported(target.device),
            "amp_available": accelerator is None or getattr(accelerator, "mixed_precision", "no") == "no",
            "half_bytes": held_bytes(held),
            "half_head_bytes": held_bytes([(module, name) for module, name in held if module is head]),
            **sharded_fact(target),
        }
