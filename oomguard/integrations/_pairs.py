"""Preference batches: two rows per sample, every chosen sequence first and every rejected one after them.

TRL's DPO and reward trainers collate a batch of ``n`` preference pairs as ``2n`` rows, ``input_ids[:n]`` the
chosen and ``input_ids[n:]`` the rejected sequences, and their loss pairs row ``i`` with row ``n + i``. Split
along dim 0 as it is, a micro-batch would hold chosen sequences only, or pair the wrong rows: the loss would be
computed, wrongly, without any error. :func:`pair_major` lays such a batch out one pair per row (a view, no
copy), so that the guard's splitting along dim 0 keeps every pair whole; :func:`chosen_then_rejected` gives a
micro-batch back the layout the trainer's loss expects. Tensors with one row per pair (DPO's precomputed
reference log-probabilities) are left as they are.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from oomguard._errors import BatchSplitError

__all__ = ["chosen_then_rejected", "collates_pairs", "pair_major"]

#: TRL's collators that lay a batch out as chosen rows, then rejected rows (DPO's and the reward trainer's
#: ``DataCollatorForPreference``, DPO's ``DataCollatorForVisionPreference``), by class name.
_PAIRED_COLLATORS = frozenset({"DataCollatorForPreference", "DataCollatorForVisionPreference"})


def collates_pairs(collator: Any) -> bool:
    """Whether ``collator`` is one of TRL's preference collators (chosen rows, then rejected rows) or an instance
    of a subclass of one: a user's collator that extends TRL's keeps its layout.

    TRL is an optional extra and is not imported here: a class that is TRL's, or inherits from it, was made by
    running TRL's module, which is therefore loaded already. A class that only shares a name is not TRL's.

    >>> class DataCollatorForPreference: pass  # a namesake of TRL's, not TRL's
    >>> collates_pairs(DataCollatorForPreference())
    False
    """
    return any(_is_trls_paired_collator(kind) for kind in type(collator).__mro__)


def _is_trls_paired_collator(kind: type) -> bool:
    """Whether ``kind`` is the very class that a module of TRL defines under one of the paired collators' names
    (by identity: a class named like it, or claiming its module, is not it)."""
    if kind.__name__ not in _PAIRED_COLLATORS or not kind.__module__.startswith("trl."):
        return False
    module = sys.modules.get(kind.__module__)  # (loaded: the class was made by running it)
    return getattr(module, kind.__name__, None) is kind


def pair_major(batch: Mapping[str, Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """``batch`` with each tensor of ``2n`` rows viewed as ``(n, 2, ...)``, pair ``i`` in row ``i``; and the keys
    so viewed. Tensors of ``n`` rows and other values are kept as they are.

    >>> ids = torch.tensor([[1], [2], [3], [4]])  # chosen 1, 2; rejected 3, 4
    >>> batch, keys = pair_major({"input_ids": ids, "ref_chosen_logps": torch.zeros(2)})
    >>> batch["input_ids"].tolist(), sorted(keys)
    ([[[1], [3]], [[2], [4]]], ['input_ids'])
    >>> chosen_then_rejected(batch, keys)["input_ids"].tolist()
    [[1], [2], [3], [4]]
    """
    if not isinstance(batch, Mapping):
        raise BatchSplitError(
            f"a preference batch is a mapping of tensors (TRL's collators make one), got {type(batch).__name__}"
        )
    rows = {key: value.shape[0] for key, value in batch.items() if isinstance(value, torch.Tensor) and value.dim()}
    pairs = max(rows.values(), default=0) // 2
    odd = {key: count for key, count in rows.items() if count not in (pairs, 2 * pairs)}
    if pairs == 0 or odd:
        raise BatchSplitError(
            f"a preference batch holds 2 rows per pair (every chosen sequence, then every rejected one) or 1, but "
            f"its tensors have {rows} rows; set trainer.oomguard_pairs = False if its collator does not lay pairs "
            f"out that way"
        )
    keys = frozenset(key for key, count in rows.items() if count == 2 * pairs)
    viewed = {key: batch[key].unflatten(0, (2, pairs)).transpose(0, 1) if key in keys else batch[key] for key in batch}
    return viewed, keys


def chosen_then_rejected(part: Mapping[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    """A micro-batch of :func:`pair_major`'s layout back in the trainer's: its chosen rows, then its rejected rows
    (a copy where the micro-batch is part of the batch; the whole batch comes back as the view it was)."""
    return {key: value.transpose(0, 1).flatten(0, 1) if key in keys else value for key, value in part.items()}
