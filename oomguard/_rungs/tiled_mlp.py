"""The tiled_mlp rung: each block's MLP run over chunks (shards) of tokens, below one whole sample's activations.

Exact (weight gradients summed over the chunks in fp32; up to float summation order); its effect is
:class:`~oomguard._effects.tiled_mlp.TiledMLPEffect`. Level ``k`` runs each MLP in ``2**k`` chunks of tokens (2,
4, 8 ... 64): a doubling walk, one level an out-of-memory error, as the ladder walks every rung; the planner's jump
measures each level on its dry run and goes straight to the one it predicts fits. Its level is kept in the plan
under its name (no field of ``Plan``), so the ranks' agreement, the state file and tuning carry it as any rung's.

Opt-in: at short sequences tiling only costs time (each MLP runs twice) and saves little, so the default ladder
leaves it out; list it in ``ladder=`` for long samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._effects.base import Effect, EffectTarget
from oomguard._effects.sharding import SHARDED, sharded_fact
from oomguard._effects.tiled_mlp import NAME, TiledMLPEffect, shards_at, why_not_tiled
from oomguard._ladder.plan import ACTIVATION_PHASES, Phase, Plan
from oomguard._ladder.rungs import Rung, RungContext, Trade

__all__ = ["TiledMLP"]

#: The fact the rung reads: a :class:`Refusal`, asked when the rung is first asked to engage.
REFUSAL = "tiled_mlp_refusal"


class Refusal:
    """Why the model's MLPs cannot be tiled (None where they can), found the first time it is asked: the probe runs
    the MLP, which a guard whose ladder never reaches the rung has no reason to do."""

    def __init__(self, target: EffectTarget) -> None:
        self._target: EffectTarget | None = target
        self._reason: str | None = None

    def reason(self) -> str | None:
        if self._target is not None:
            self._reason, self._target = why_not_tiled(self._target.model, self._target.blocks), None
        return self._reason


@dataclass(frozen=True)
class TiledMLP(Rung):
    """Run each block's MLP over chunks of tokens: 2, 4, 8 ... 64 (exact; opt-in, for long samples)."""

    name: str = NAME
    relieves: frozenset[Phase] = ACTIVATION_PHASES
    max_level: int = 6

    after: ClassVar[str] = "activation_offload"  # (registered last: right behind it, with the activation rungs)
    opt_in: ClassVar[bool] = True  # (exact, but slower and of no use at short sequences: see the module's notes)
    trade: ClassVar[Trade] = "off_or_level"  # (tuning: off, or its level; not 7 levels x every other choice)

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        # (a context that does not know, one made by hand, says no: the rung engages only where it was checked;
        # FSDP2 gathers and frees a block's weights around its forward and backward, and the recompute of each
        # chunk inside backward reads them again: refused)
        refusal = context.fact(REFUSAL)
        if not isinstance(refusal, Refusal) or context.fact(SHARDED, False) or refusal.reason() is not None:
            return None
        return super().deeper(plan, context)

    def describe(self, plan: Plan, batch_size: int | None) -> str | None:
        level = plan.level(self.name)
        return f"MLP tiled x{shards_at(level)}" if level else None

    def setting(self, plan: Plan, batch_size: int) -> str:
        return f"tiled_mlp={plan.level(self.name)} ({shards_at(plan.level(self.name))} chunks)"

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        return {REFUSAL: Refusal(target), **sharded_fact(target)}

    def effect(self) -> type[Effect]:
        return TiledMLPEffect
