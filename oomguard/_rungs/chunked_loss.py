"""The chunked_loss rung: a causal LM's output head and cross-entropy computed in chunks of tokens, so neither the
full logits nor their gradient ever exist (for big vocabularies the loss, not the layers, fills a small GPU).

Exact (the model's own loss, up to float summation order), or not applied: the rung engages only where
:meth:`~oomguard._effects.chunked_loss.ChunkedLoss.applies` finds a transformers causal LM whose forward calls
``self.lm_head`` and then ``self.loss_function`` (transformers' ``ForCausalLMLoss``) with a plain ``nn.Linear``
head. Its level is kept in the plan under its name (one file and one registration line, no field of ``Plan``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._effects.chunked_loss import ChunkedLoss as Chunking
from oomguard._effects.sharding import SHARDED, sharded_fact
from oomguard._ladder.plan import ACTIVATION_PHASES, Phase, Plan
from oomguard._ladder.rungs import Rung, RungContext, Trade

__all__ = ["ChunkedLoss", "ChunkedLossEffect"]


class ChunkedLossEffect(Effect):
    """Patches the model's head and loss while the plan has the rung, and undoes them exactly."""

    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self.chunking = Chunking()

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        wanted = plan.level(ChunkedLoss.name) > 0
        if wanted == self.holds:
            return False
        if wanted:
            self.chunking.apply(self.target.model)  # (refused models never get here: the rung did not engage)
        else:
            self.chunking.undo()
        return True

    @property
    def holds(self) -> bool:
        return self.chunking.applied

    @property
    def held(self) -> str:
        return "the chunked loss's head and loss patches"

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        return self._aside() if self.holds else None

    @contextlib.contextmanager
    def _aside(self) -> Iterator[None]:
        """The model as the user made it for the planner's dry run (which applies the rung itself where a plan
        it measures has it), patched again after."""
        self.chunking.undo()
        try:
            yield
        finally:
            self.chunking.apply(self.target.model)

    def close(self) -> None:
        self.chunking.undo()


@dataclass(frozen=True)
class ChunkedLoss(Rung):
    """Compute the output head and the cross-entropy in chunks of tokens (exact; for transformers causal LMs)."""

    name: str = "chunked_loss"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    # The first rung, ahead of micro-batching: exact and nearly free (the head's product runs once, its gradients
    # made in the forward; the batch stays whole, so the device's throughput does too), and for a big vocabulary
    # it relieves more than any other rung (benchmarks/ladder.py's row). Where it does not apply it is skipped.
    after: ClassVar[None] = None
    trade: ClassVar[Trade] = "levels"

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        # (a context that does not know, one made by hand, says no: the rung engages only where it is exact)
        applies = context.fact("chunked_loss_applies", False) and not context.fact(SHARDED, False)
        return super().deeper(plan, context) if applies else None  # (FSDP2: the lazy head reads a sharded weight)

    def describe(self, plan: Plan, batch_size: int | None) -> str | None:
        return "chunked loss" if plan.level(self.name) else None

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        return {"chunked_loss_applies": Chunking.applies(target.model) is None, **sharded_fact(target)}

    def effect(self) -> type[Effect]:
        return ChunkedLossEffect
