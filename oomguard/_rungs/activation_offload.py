"""The activation_offload rung: the tensors saved for backward kept in host memory, brought back for backward.

Exact; its effect is :class:`~oomguard._effects.activations.ActivationOffloadEffect`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._effects.activations import ActivationOffloadEffect
from oomguard._ladder.plan import ACTIVATION_PHASES, Phase, Plan
from oomguard._ladder.rungs import FieldRung, RungContext, Trade

__all__ = ["ActivationOffload"]


@dataclass(frozen=True)
class ActivationOffload(FieldRung):
    """Keep the tensors saved for backward in host memory, bringing them back for backward."""

    name: str = "activation_offload"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    field: ClassVar[str] = "activation_offload"
    levels: ClassVar[tuple[Any, ...]] = (False, True)
    phrases: ClassVar[tuple[str, ...]] = ("activations offloaded",)
    after: ClassVar[str] = "checkpointing"
    trade: ClassVar[Trade] = "levels"

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.activation_offload or not context.can_offload:
            return None
        return plan.replace(activation_offload=True)

    def effect(self) -> type[ActivationOffloadEffect]:
        return ActivationOffloadEffect

    def host_bytes(self, plan: Plan, context: RungContext) -> int:
        """The saved tensors a forward keeps on the host: what the effect measured per sample at its peak in the
        last step on activation offload that worked (the fact ``activation_host_per_sample``, which the guard adds
        to its contexts: :mod:`oomguard._effects.activation_host`), times ``plan``'s micro-batch size. 0 until a
        step was measured: unknown, and the effect's own check as each tensor is copied is then the bound."""
        if not plan.activation_offload:
            return 0
        per_sample = float(context.fact("activation_host_per_sample", 0.0))
        return int(per_sample * plan.effective_micro_batch_size(context.batch_size))
