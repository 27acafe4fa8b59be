"""The layer_offload rung: the parameters, gradients and optimizer state of 1, 2, 4 ... blocks in host memory,
streamed to the device while in use.

Exact; its effect is :class:`~oomguard._effects.layers.LayerOffloadEffect`. Offloaded blocks keep fp32 weights
and state on the host whole, so it ends 8-bit storage; master weights end by the plan's own rule
(:func:`~oomguard._ladder.plan.keeps_master_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._effects.base import EffectTarget
from oomguard._effects.footprint import host_facts
from oomguard._effects.layers import LayerOffloadEffect
from oomguard._effects.sharding import SHARDED, sharded_fact
from oomguard._ladder.plan import EVERY_PHASE, Phase, Plan
from oomguard._ladder.rungs import Rung, RungContext, Trade

__all__ = ["LayerOffload"]


@dataclass(frozen=True)
class LayerOffload(Rung):
    """Keep the parameters, gradients and optimizer state of 1, 2, 4 ... blocks (up to all) in host memory."""

    name: str = "layer_offload"
    relieves: frozenset[Phase] = EVERY_PHASE

    field: ClassVar[str] = "offload_layers"
    after: ClassVar[str] = "optimizer_offload"
    trade: ClassVar[Trade] = "off_or_level"
    ends: ClassVar[Mapping[str, int]] = {"quantized_optimizer": 0, "quantized_weights": 0}
    # Its saved-tensor hook must see the copies of streamed weights before activation offload would move them to
    # the host; optimizer offload moves back the state of the layers it restores, and amp holds the frozen weights
    # of the blocks it brings back in half precision again (before the step, not one step late).
    effect_before: ClassVar[tuple[str, ...]] = ("activation_offload", "optimizer_offload", "amp")

    def level(self, plan: Plan, batch_size: int) -> int:
        return plan.offload_layers

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        return plan.replace(offload_layers=level)

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.offload_layers >= context.num_blocks or not context.can_offload or context.fact(SHARDED, False):
            return None
        return plan.replace(offload_layers=min(context.num_blocks, max(1, 2 * plan.offload_layers)))

    def reaches(self, plan: Plan, context: RungContext) -> bool:
        """Any number of blocks up to all (stepping back up halves what escalation doubled: 6 -> 3), where host
        memory is distinct from the device's."""
        return not plan.offload_layers or (context.can_offload and plan.offload_layers <= context.num_blocks)

    def describe(self, plan: Plan, batch_size: int | None) -> str | None:
        return f"{plan.offload_layers} layer(s) offloaded" if plan.offload_layers else None

    def setting(self, plan: Plan, batch_size: int) -> str:
        return f"offload_layers={plan.offload_layers}"

    def relax(self, plan: Plan, batch_size: int) -> Plan | None:
        """Half as many blocks offloaded (4 -> 2 -> 1 -> 0), as escalation doubled them."""
        return plan.replace(offload_layers=plan.offload_layers // 2) if plan.offload_layers else None

    def effect(self) -> type[LayerOffloadEffect]:
        return LayerOffloadEffect

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        return {**host_facts(target), **sharded_fact(target)}  # (FSDP2 gathers and frees the blocks' weights)

    def host_bytes(self, plan: Plan, context: RungContext) -> int:
        """The offloaded blocks' weights and gradients, and their optimizer state unless the optimizer-offload
        rung counts it (it counts every parameter's)."""
        blocks = sum(context.fact("block_bytes", ())[: plan.offload_layers])
        state = 0.0 if plan.optimizer_offload else context.fact("state_ratio", 0.0)
        return int((2 + state) * blocks)
