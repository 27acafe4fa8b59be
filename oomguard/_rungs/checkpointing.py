"""The checkpointing rung: activation checkpointing of the repeated blocks, every other block, then every block.

Exact; its effect is :class:`~oomguard._effects.checkpointing.CheckpointingEffect`. Nothing to add where the user
already checkpoints every block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._effects.base import EffectTarget
from oomguard._effects.checkpointing import CheckpointingEffect, user_checkpointing
from oomguard._ladder.plan import ACTIVATION_PHASES, Phase, Plan
from oomguard._ladder.rungs import FieldRung, RungContext, Trade

__all__ = ["Checkpointing"]


@dataclass(frozen=True)
class Checkpointing(FieldRung):
    """Activation checkpointing of the repeated blocks: every other block first, then every block."""

    name: str = "checkpointing"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    field: ClassVar[str] = "checkpointing"
    levels: ClassVar[tuple[Any, ...]] = (None, "partial", "full")
    phrases: ClassVar[tuple[str, ...]] = ("{} checkpointing", "{} checkpointing")
    after: ClassVar[str] = "amp"
    trade: ClassVar[Trade] = "levels"

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        if context.num_blocks == 0 or context.checkpointed or plan.checkpointing == "full":
            return None
        if plan.checkpointing is None and context.num_blocks > 1:
            return plan.replace(checkpointing="partial")
        return plan.replace(checkpointing="full")

    def effect(self) -> type[CheckpointingEffect]:
        return CheckpointingEffect

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        return {"checkpointed": user_checkpointing(target.model)}
