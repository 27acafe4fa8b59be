"""How the losses of a step's micro-batches make the whole batch's, for trainers whose loss says it itself.

The Trainer tells a loss normalised over the whole batch by ``num_items_in_batch``; TRL's GRPOTrainer (and its
subclasses) does not: its ``loss_type`` decides. ``"dapo"`` (the default), ``"cispo"`` and ``"vespo"`` divide by
a token count of the whole batch carried in the batch itself, so a micro-batch's loss is its share of the sum
and the shares are added; ``"bnpo"`` averages over the micro-batch's completion tokens, so each is weighed by
its tokens; the others average per sequence, so each is weighed by its sequences. Averaged as a plain mean
loss, a ``"dapo"`` step split in 4 trained on a quarter of its gradient, without any error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from oomguard._errors import GuardConfigError

__all__ = ["Weighting", "completion_tokens", "weighting"]

Weighting = Literal["sum", "tokens", "samples"]

#: GRPO's loss types by how a loss over part of a batch relates to the whole batch's.
GRPO_LOSSES: dict[str, Weighting] = {
    "dapo": "sum", "cispo": "sum", "vespo": "sum",  # normalised by a token count over the whole batch
    "bnpo": "tokens",  # a mean over the micro-batch's completion tokens
    "grpo": "samples", "sapo": "samples", "dr_grpo": "samples", "luspo": "samples",  # a mean over its sequences
}  # fmt: skip


def weighting(trainer: Any) -> Weighting | None:
    """How ``trainer``'s micro-batch losses combine where its class decides (GRPO's loss types); None where the
    Trainer's own rule holds. Raises :class:`~oomguard.GuardConfigError` for a GRPO loss type it does not know,
    rather than weigh it wrongly."""
    if not any(k.__name__ == "GRPOTrainer" and k.__module__.startswith("trl.") for k in type(trainer).__mro__):
        return None
    loss_type = getattr(trainer, "loss_type", None)
    if loss_type not in GRPO_LOSSES:
        raise GuardConfigError(
            f"GRPO loss_type {loss_type!r} is new to oomguard, which knows {sorted(GRPO_LOSSES)}: it cannot tell "
            f"how micro-batches of it add up to the whole batch's loss; use one of those, or a newer oomguard"
        )
    return GRPO_LOSSES[loss_type]


def completion_tokens(part: Mapping[str, Any]) -> float:
    """The completion tokens a GRPO micro-batch's ``"bnpo"`` loss averages over (its completion mask, and its tool
    mask where there is one)."""
    mask = part["completion_mask"]
    if "tool_mask" in part:
        mask = mask * part["tool_mask"]
    return float(mask.sum())
