"""Splitting a batch into micro-batches along dim 0, and counting what each one weighs in the loss.

A batch is any nesting of mappings, lists and tuples (named tuples included) whose tensor leaves share their
first dimension; other leaves (strings, numbers, ``None``, 0-d tensors) are passed to every micro-batch as
they are. Splitting keeps the container types, so a ``BatchEncoding`` stays a ``BatchEncoding``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from oomguard._errors import BatchSplitError

__all__ = ["batch_bucket", "batch_size", "count_items", "default_item_counter", "items_per_sample", "split_batch"]

B = TypeVar("B")

IGNORE_INDEX = -100  # the label value transformers (and torch's cross-entropy) leave out of the loss


def _leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Every splittable tensor leaf of ``batch`` with a readable path to it, e.g. ``batch['labels']``."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0:
            yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from _leaves(value, f"{path}[{index}]")


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the shared size of dim 0 of its tensors.

    Raises :class:`~oomguard.BatchSplitError` when the batch holds no tensor with a dim 0, or when its tensors
    disagree on dim 0 (the message names both tensors).

    >>> batch_size({"input_ids": torch.zeros(4, 16), "labels": torch.zeros(4, 16), "name": "x"})
    4
    """
    first: tuple[str, int] | None = None
    for path, tensor in _leaves(batch):
        size = tensor.shape[0]
        if first is None:
            first = (path, size)
        elif size != first[1]:
            raise BatchSplitError(
                f"the batch's tensors disagree on dim 0: {first[0]} has {first[1]} samples but {path} has "
                f"{size}. The guard splits batches along dim 0, so every tensor needs the batch dimension "
                f"first (a tensor shared by all samples can be 0-d, or be built inside the step function)."
            )
    if first is None:
        raise BatchSplitError(
            f"the batch ({type(batch).__name__}) holds no tensor with a batch dimension, so its size is "
            f"unknown and it cannot be split. Pass the batch's tensors (in a dict, list or tuple, nested as you "
            f"like) with the samples along dim 0."
        )
    return first[1]


def _rebuild(template: Any, values: Sequence[Any]) -> Any:
    """A container of the same type as ``template`` holding ``values``."""
    if isinstance(template, tuple) and hasattr(template, "_fields"):  # a named tuple
        return type(template)(*values)
    if isinstance(template, (list, tuple)):
        try:
            return type(template)(values)
        except TypeError:
            return list(values) if isinstance(template, list) else tuple(values)
    raise AssertionError("unreachable: only sequences are rebuilt here")


def _split(batch: Any, bounds: Sequence[tuple[int, int]]) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * len(bounds)
        return [batch[start:stop] for start, stop in bounds]  # views: splitting allocates nothing
    if isinstance(batch, Mapping):
        columns = {key: _split(value, bounds) for key, value in batch.items()}
        parts = [{key: column[i] for key, column in columns.items()} for i in range(len(bounds))]
        if type(batch) is dict:
            return parts
        try:
            mapping_type: Any = type(batch)
            return [mapping_type(part) for part in parts]
        except TypeError:  # a mapping type that cannot be built from a dict: fall back to plain dicts
            return parts
    if isinstance(batch, (list, tuple)):
        columns_seq = [_split(value, bounds) for value in batch]
        return [_rebuild(batch, [column[i] for column in columns_seq]) for i in range(len(bounds))]
    return [batch] * len(bounds)


def split_batch(batch: B, micro_batch_size: int) -> list[B]:
    """Split ``batch`` along dim 0 into consecutive parts of at most ``micro_batch_size`` samples.

    Tensors become views (no copy); containers keep their types; other leaves are shared. The last part may be
    smaller. Raises :class:`~oomguard.BatchSplitError` for a batch with no batch dimension or whose tensors
    disagree on dim 0, and ``ValueError`` for a micro-batch size below 1.

    >>> [part["x"].tolist() for part in split_batch({"x": torch.arange(5), "tag": "t"}, 2)]
    [[0, 1], [2, 3], [4]]
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    size = batch_size(batch)
    bounds = [(start, min(start + micro_batch_size, size)) for start in range(0, size, micro_batch_size)]
    return _split(batch, bounds)


def _shifts_labels(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` is a causal LM whose loss compares ``labels[:, 1:]`` with the logits before them."""
    while model is not None:
        names = [cls.__name__ for cls in type(model).__mro__]
        if any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in names):
            return True
        inner = getattr(model, "module", None)  # DDP / DataParallel / compiled wrappers
        model = inner if isinstance(inner, torch.nn.Module) else None
    return False


def default_item_counter(model: torch.nn.Module | None) -> Callable[[Any], int]:
    """The rule that weighs each micro-batch in a mean-reduced loss.

    For a mapping batch with ``shift_labels``, the number of those that are not -100. For a mapping batch with
    ``labels`` of two or more dimensions, the number of labels that are not -100, after the one-token shift
    a transformers causal LM applies (``labels[..., 1:]``) when ``model`` is one. Otherwise the number of
    samples (dim 0). Weighting every micro-batch's mean loss by its share of these items gives exactly the
    full batch's mean.
    """
    shifted = _shifts_labels(model)

    def count(batch: Any) -> int:
        if isinstance(batch, Mapping):
            shift_labels = batch.get("shift_labels")
            if isinstance(shift_labels, torch.Tensor):
                return int((shift_labels != IGNORE_INDEX).sum())
            labels = batch.get("labels")
            if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
                counted = labels[..., 1:] if shifted else labels
                return int((counted != IGNORE_INDEX).sum())
        return batch_size(batch)

    return count


def count_items(parts: Sequence[Any], counter: Callable[[Any], float]) -> list[float]:
    """The item count of each part, checked: finite and not negative."""
    counts = []
    for index, part in enumerate(parts):
        value = float(counter(part))
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"count_items returned {value!r} for micro-batch {index}; it must return a finite number >= 0 "
                f"(the number of items the step's mean loss is averaged over)"
            )
        counts.append(value)
    return counts


def _largest_numel(batch: Any) -> int:
    return max((tensor.numel() for _, tensor in _leaves(batch)), default=0)


def batch_bucket(batch: Any) -> int:
    """The bucket of a batch: its largest tensor's element count rounded up to a power of two.

    Batches of one bucket share a plan: a rare long batch escalates only its own.

    >>> batch_bucket({"input_ids": torch.zeros(16, 256)}), batch_bucket({"input_ids": torch.zeros(16, 300)})
    (4096, 8192)
    """
    numel = _largest_numel(batch)
    return 1 << max(0, numel - 1).bit_length()


def items_per_sample(batch: Any, size: int) -> float:
    """Elements of the largest tensor per sample (tokens per sequence for a language model): what a
    micro-batch's activations scale with."""
    return _largest_numel(batch) / max(1, size)
