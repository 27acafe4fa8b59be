"""Batches for the models of :mod:`helpers.models`, each from a fixed seed."""

from __future__ import annotations

from collections import UserDict
from typing import Any

import torch

from helpers.models import VOCAB


def tuple_batch(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=generator), torch.randn(n, generator=generator)


def ragged_lm_batch(lengths: list[int], seq_len: int = 12, seed: int = 2) -> dict[str, torch.Tensor]:
    """Right-padded causal-LM batch: samples of different lengths, pads masked and labelled -100."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), seq_len), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lm_batch(n: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


#: Mapping batches torch's pytree takes for leaves (it walks plain dicts only): a tokenizer's output, a UserDict.
MAPPING_LEAVES = ("BatchEncoding", "UserDict")


def as_mapping_leaf(kind: str, batch: dict[str, torch.Tensor]) -> Any:
    """``batch`` as one of :data:`MAPPING_LEAVES`."""
    if kind == "BatchEncoding":
        from transformers.tokenization_utils_base import BatchEncoding

        return BatchEncoding(batch)
    return UserDict(batch)
