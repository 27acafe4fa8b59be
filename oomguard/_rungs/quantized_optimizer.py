"""The quantized_optimizer rung (opt-in): Adam's moments in block-wise 8-bit storage on the device.

Changes the maths; its effect is :class:`~oomguard._effects.quantized.QuantizedOptimizerEffect`. Only for torch's
Adam and AdamW; offloading the optimizer's state ends it (see those rungs' ``ends``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._effects.base import EffectTarget
from oomguard._effects.quantized import QuantizedOptimizerEffect, can_quantize
from oomguard._effects.sharding import SHARDED, sharded_fact
from oomguard._ladder.plan import EVERY_PHASE, Phase, Plan
from oomguard._ladder.rungs import FieldRung, RungContext

__all__ = ["QuantizedOptimizer"]


@dataclass(frozen=True)
class QuantizedOptimizer(FieldRung):
    """Keep Adam's moments in block-wise 8-bit storage on the device (2 bytes of state per parameter instead of
    8); the optimizer runs its own algorithm on them, dequantized a few parameters at a time. Changes the maths
    like ``amp``: each moment keeps about 3 significant bits. Only for torch's Adam and AdamW; offloading the
    optimizer's state supersedes it (those rungs end it)."""

    name: str = "quantized_optimizer"
    relieves: frozenset[Phase] = EVERY_PHASE  # the state is resident in every phase

    field: ClassVar[str] = "quantized_optimizer"
    levels: ClassVar[tuple[Any, ...]] = (False, True)
    phrases: ClassVar[tuple[str, ...]] = ("8-bit optimizer state",)
    after: ClassVar[str] = "layer_offload"
    # Not in the default ladder: it changes the maths, and where it should stand against the exact offload rungs
    # is to be measured on GPUs.
    opt_in: ClassVar[bool] = True
    exact: ClassVar[bool] = False

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.quantized_optimizer or not context.optimizer_quantizable or context.fact(SHARDED, False):
            return None
        return plan.replace(quantized_optimizer=True)

    def effect(self) -> type[QuantizedOptimizerEffect]:
        return QuantizedOptimizerEffect

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        return {"optimizer_quantizable": can_quantize(target.optimizer), **sharded_fact(target)}  # (not DTensors)
