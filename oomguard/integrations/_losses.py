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

__all__ = ["Weighting", "batch_coupled", "completion_tokens", "weighting"]

Weighting = Literal["sum", "tokens", "samples"]

#: GRPO's loss types by how a loss over part of a batch relates to the whole batch's.
GRPO_LOSSES: dict[str, Weighting] = {
    "dapo": "sum",
    "cispo": "sum",
    "vespo": "sum",  # normalised by a token count over the whole batch
    "bnpo": "tokens",  # a mean over the micro-batch's completion tokens
    "grpo": "samples",
    "sapo": "samples",
    "dr_grpo": "samples",
    "luspo": "samples",  # a mean over its sequences
}


def weighting(trainer: Any) -> Weighting | None:
    """How ``trainer``'s micro-batch losses combine where its class decides (GRPO's loss types); None where the
    Trainer's own rule holds. Raises :class:`~oomguard.GuardConfigError` for a GRPO loss type it does not know,
    rather than weigh it wrongly."""
    if not _is_trl(trainer, "GRPOTrainer"):
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


def _is_trl(trainer: Any, name: str) -> bool:
    """Whether ``trainer`` is TRL's trainer class ``name`` or a subclass of it."""
    return any(k.__name__ == name and k.__module__.startswith("trl.") for k in type(trainer).__mro__)


def batch_coupled(trainer: Any) -> str | None:
    """Why ``trainer``'s loss is not a sum over its samples, so that micro-batches change it (what the guard warns
    of when it splits a batch); None where it is.

    TRL's KTOTrainer estimates its KL term as a mean over the batch's mismatched completions: split, each
    micro-batch has its own estimate, and in micro-batches of one the KL term equals the implied reward (TRL
    itself refuses a batch of one for that reason).
    """
    if _is_trl(trainer, "KTOTrainer") and getattr(trainer, "calculate_KL", False):
        return (
            "KTO's KL term is estimated over each micro-batch instead of the whole batch (in micro-batches of one "
            "it equals the implied reward); leave micro_batch off the ladder or set oomguard.MicroBatch(min_size=...)"
        )
    return None
