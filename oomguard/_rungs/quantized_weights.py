"""The quantized_weights rung (opt-in): frozen ``nn.Linear`` weights in 8 bits on the device, then in 4 (NF4).

Changes the maths; its effect is :class:`~oomguard._effects.weights.QuantizedWeightsEffect`. Inapplicable to a
model with no frozen linear weight; layer offload ends it. While the plan has ``chunked_loss``, the output head is
that rung's and stays whole (:func:`~oomguard._effects.weights.chunked_head`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._effects.base import EffectTarget
from oomguard._effects.sharding import SHARDED, sharded_fact
from oomguard._effects.weights import QuantizedWeightsEffect, frozen_linears, lm_head
from oomguard._ladder.plan import EVERY_PHASE, Phase, Plan
from oomguard._ladder.rungs import FieldRung, RungContext

__all__ = ["QuantizedWeights"]


@dataclass(frozen=True)
class QuantizedWeights(FieldRung):
    """Keep frozen ``nn.Linear`` weights (a LoRA job's base model) in 8 bits on the device, per output channel,
    then, one level deeper, in 4 bits (NF4 codes with one scale per 64 values), and their exact originals on the
    host; trainable parameters are never quantized. Changes the maths like ``amp``. Inapplicable to a model with
    no frozen linear weight; layer offload ends it. The output head of a plan with ``chunked_loss`` is left to
    that rung, whole (exact): a frozen head is then not one of the weights this rung has to quantize."""

    name: str = "quantized_weights"
    relieves: frozenset[Phase] = EVERY_PHASE  # the weights are resident in every phase

    field: ClassVar[str] = "quantized_weights"
    levels: ClassVar[tuple[Any, ...]] = (False, True, "4bit")
    phrases: ClassVar[tuple[str, ...]] = ("8-bit frozen weights", "4-bit frozen weights")
    after: ClassVar[str] = "quantized_optimizer"
    opt_in: ClassVar[bool] = True  # (it changes the maths, as the 8-bit optimizer state does)
    exact: ClassVar[bool] = False

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        frozen = context.frozen_linears
        if plan.level("chunked_loss"):  # (the head is the chunked loss's then: are there others?)
            frozen = context.fact("frozen_linears_besides_head", frozen)
        if plan.quantized_weights == "4bit" or not frozen or context.fact(SHARDED, False):
            return None
        return plan.replace(quantized_weights="4bit" if plan.quantized_weights else True)

    def effect(self) -> type[QuantizedWeightsEffect]:
        return QuantizedWeightsEffect

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        return {
            "frozen_linears": bool(frozen_linears(target.model)),
            "frozen_linears_besides_head": bool(frozen_linears(target.model, lm_head(target.model))),
            **sharded_fact(target),  # (FSDP2's weights are DTensors it gathers itself)
        }
