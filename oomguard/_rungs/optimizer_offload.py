"""The optimizer_offload rung: the optimizer's state on the host and its step run there; at its ``master`` level
the fp32 master weights too, with only a bf16 copy of them on the device.

Exact at its first level, within amp's tolerance at the second. Its effect is
:class:`~oomguard._effects.optimizer.OptimizerOffloadEffect`. Where the master level can run is one rule,
:func:`~oomguard._ladder.plan.keeps_master_weights`; the plan itself keeps to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._effects.base import EffectTarget
from oomguard._effects.footprint import host_facts
from oomguard._effects.optimizer import OptimizerOffloadEffect, can_step_on_host
from oomguard._effects.sharding import SHARDED, sharded_fact
from oomguard._ladder.plan import EVERY_PHASE, Phase, Plan, keeps_master_weights
from oomguard._ladder.rungs import FieldRung, RungContext, Trade

__all__ = ["OptimizerOffload"]


@dataclass(frozen=True)
class OptimizerOffload(FieldRung):
    """Keep the optimizer's state (Adam's moments) in host memory and run the optimizer step there: the device
    keeps the parameters and gradients only. Each step copies the gradients and parameters to the host and the
    updated parameters back; the maths is the optimizer's own, on the host.

    Its second level, where the plan runs bf16 and offloads no layer, also keeps the fp32 master weights on the
    host and only a bf16 copy on the device (under DDP too: the guard's ranks never use DDP's gradient buckets,
    made for the parameters' dtype; they all-reduce the fp32 sums on the host, see
    :mod:`oomguard._distributed.agreement`): weights and gradients take half the device memory, a step moves 4 bytes per
    parameter, and the maths is bf16 training with fp32 master weights (within amp's tolerance)."""

    name: str = "optimizer_offload"
    relieves: frozenset[Phase] = EVERY_PHASE  # the state is resident in every phase; the master level halves weights

    field: ClassVar[str] = "optimizer_offload"
    levels: ClassVar[tuple[Any, ...]] = (False, True, "master")
    phrases: ClassVar[tuple[str, ...]] = (
        "optimizer state offloaded",
        "optimizer state and fp32 master weights offloaded (bf16 weights on the device)",
    )
    after: ClassVar[str] = "activation_offload"
    trade: ClassVar[Trade] = "off_or_level"
    ends: ClassVar[Mapping[str, int]] = {"quantized_optimizer": 0}  # (state on the host: in fp32)

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        if not context.can_offload or not context.optimizer_offloadable or context.fact(SHARDED, False):
            return None  # (FSDP2: its state is DTensors; the user's CPUOffloadPolicy is FSDP's own offload)
        if not plan.optimizer_offload:
            return plan.replace(optimizer_offload=True)
        if plan.optimizer_offload is True and keeps_master_weights(plan.precision, plan.offload_layers):
            return plan.replace(optimizer_offload="master")
        return None

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        """``plan`` at ``level``; the master level only where ``plan`` can keep master weights (see
        :func:`~oomguard._ladder.plan.keeps_master_weights`), the first level elsewhere: what would run."""
        if level == 2 and not keeps_master_weights(plan.precision, plan.offload_layers):
            level = 1
        return super().at_level(plan, level, batch_size)

    def effect(self) -> type[OptimizerOffloadEffect]:
        return OptimizerOffloadEffect

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        return {
            "optimizer_offloadable": can_step_on_host(target.optimizer),
            **host_facts(target),
            **sharded_fact(target),
        }

    def host_bytes(self, plan: Plan, context: RungContext) -> int:
        """The state of every trainable parameter (the offloaded blocks' too: the layer-offload rung counts their
        weights and gradients, not their state), and per parameter on the device a host copy of its weight and
        one of its gradient for the step on the host; at the master level the fp32 masters, their gradients'
        fp32 sum and two bf16 buffers (the image and the staging) in place of those copies."""
        if not plan.optimizer_offload:
            return 0
        trainable = int(context.fact("trainable_bytes", 0))
        state = int(context.fact("state_ratio", 0.0) * trainable)
        if plan.optimizer_offload == "master" and keeps_master_weights(plan.precision, plan.offload_layers):
            return state + 3 * trainable  # masters + fp32 gradient sums + bf16 image and staging (a half each)
        offloaded = int(sum(context.fact("block_bytes", ())[: plan.offload_layers]))
        return state + 2 * (trainable - offloaded)
