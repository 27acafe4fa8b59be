"""Splitting a batch into micro-batches along dim 0, and counting what each one weighs in the loss.

A batch is any nesting of mappings, lists and tuples (named tuples included) whose tensor leaves share their
first dimension. A list or tuple with one non-tensor entry per sample (the list of strings a collate function
gives for a text field) is split with the tensors; other leaves (strings, numbers, ``None``, 0-d tensors) are
passed to every micro-batch as they are. Splitting keeps the container types, so a ``BatchEncoding`` stays a
``BatchEncoding``. :func:`split_batch` states the rules in full.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_flatten, tree_map

from oomguard._errors import BatchSplitError

__all__ = [
    "batch_bucket",
    "batch_leaves",
    "batch_size",
    "batch_tensors",
    "count_items",
    "default_item_counter",
    "first_samples",
    "items_per_sample",
    "map_tensors",
    "split_batch",
    "warn_if_batch_statistics",
]

B = TypeVar("B")
logger = logging.getLogger("oomguard")

IGNORE_INDEX = -100  # the label value transformers (and torch's cross-entropy) leave out of the loss


_Parent = tuple[str, Sequence[Any]]  # a list or tuple holding tensors directly, with its path


def batch_leaves(batch: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every splittable tensor leaf of ``batch`` with a readable path to it, e.g. ``batch['labels']``."""
    for leaf_path, tensor, _ in _leaves_in(batch, "batch", None):
        yield leaf_path, tensor


def _leaves_in(batch: Any, path: str, parent: _Parent | None) -> Iterator[tuple[str, torch.Tensor, _Parent | None]]:
    """Like :func:`batch_leaves`, with the list or tuple (its path and itself) that holds each tensor directly, if
    any: what the error for a list of per-sample tensors needs to say which list it is."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0:
            yield path, batch, parent
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _leaves_in(value, f"{path}[{key!r}]", None)
    elif isinstance(batch, (list, tuple)):
        held = None if _is_record(batch) else (path, batch)
        for index, value in enumerate(batch):
            yield from _leaves_in(value, f"{path}[{index}]", held)


def _is_record(value: Any) -> bool:
    """Whether a tuple is a record of fields (a named tuple) or a shape, which never holds one entry per sample."""
    return isinstance(value, torch.Size) or (isinstance(value, tuple) and hasattr(value, "_fields"))


def _is_per_sample(value: Any, size: int) -> bool:
    """Whether ``value`` is a sequence of one non-tensor entry per sample, to be split with the batch's tensors.

    Only a plain list or tuple (or a subclass that is not a record) of exactly ``size`` entries with no tensor
    with a dim 0 anywhere inside qualifies. A sequence holding such tensors is a container of batch tensors
    (``(inputs, targets)``, per-layer states): its tensors carry the batch dimension themselves.
    """
    return (
        isinstance(value, (list, tuple))
        and not _is_record(value)
        and len(value) == size
        and next(batch_leaves(value), None) is None
    )


def _per_sample_tensor_hint(one: tuple[str, int, _Parent | None], other: tuple[str, int, _Parent | None]) -> str:
    """Advice for two tensors that disagree on dim 0 when they look like entries of a list of per-sample tensors.

    The hint is only given when the error is already certain (the tensors disagree), so it can never refuse a
    batch that would have split. It is left out where one wrong tensor is the likelier story, such as a pair
    ``(inputs, targets)`` that disagree (unless one of them has exactly two samples). It is given when a list
    of tensors has as many entries as the other tensor has samples (``{"input_ids": (8, T), "pixel_values":
    [8 images]}``), or when both tensors sit in one list of three or more tensors (``[ids_0, ids_1, ids_2]``,
    ragged sequences).
    """
    for (_, _, parent), (_, size, _) in ((one, other), (other, one)):
        if parent is not None and len(parent[1]) == size and _all_batch_tensors(parent[1]):
            return _stack_advice(parent[0])
    parent = one[2]
    if parent is not None and parent is other[2] and len(parent[1]) >= 3 and _all_batch_tensors(parent[1]):
        return _stack_advice(parent[0])
    return ""


def _all_batch_tensors(values: Sequence[Any]) -> bool:
    return all(isinstance(value, torch.Tensor) and value.dim() > 0 for value in values)


def _stack_advice(path: str) -> str:
    return (
        f" If {path} is a list of one tensor per sample (what a collate_fn that does not stack gives), build one "
        f"tensor with the samples along dim 0 in the collate_fn instead: torch.stack for samples of one shape, "
        f"torch.nn.utils.rnn.pad_sequence(..., batch_first=True) with a mask for ragged ones."
    )


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the shared size of dim 0 of its tensors.

    Raises :class:`~oomguard.BatchSplitError` when the batch holds no tensor with a dim 0, when its tensors
    disagree on dim 0 (the message names both tensors), or when it has no sample at all: the guard calls this
    first on every batch, and a step on an empty batch would return a NaN loss yet still apply weight decay and
    advance the optimizer's and scheduler's step counts, training on nothing.

    >>> batch_size({"input_ids": torch.zeros(4, 16), "labels": torch.zeros(4, 16), "name": "x"})
    4
    """
    first: tuple[str, int, _Parent | None] | None = None
    for path, tensor, parent in _leaves_in(batch, "batch", None):
        size = tensor.shape[0]
        if first is None:
            first = (path, size, parent)
        elif size != first[1]:
            hint = _per_sample_tensor_hint(first, (path, size, parent))
            raise BatchSplitError(
                f"the batch's tensors disagree on dim 0: {first[0]} has {first[1]} samples but {path} has "
                f"{size}. The guard splits batches along dim 0, so every tensor needs the batch dimension "
                f"first (a tensor shared by all samples can be 0-d, or be built inside the step function).{hint}"
            )
    if first is None:
        raise BatchSplitError(
            f"the batch ({type(batch).__name__}) holds no tensor with a batch dimension, so its size is "
            f"unknown and it cannot be split. Pass the batch's tensors (in a dict, list or tuple, nested as you "
            f"like) with the samples along dim 0."
        )
    if first[1] == 0:
        raise BatchSplitError(
            f"the batch is empty: {first[0]} has 0 samples in dim 0, so there is nothing to train on (a step "
            f"would return a NaN loss and still apply weight decay and advance the optimizer and scheduler). "
            f"Skip empty batches before the guarded call: give the DataLoader drop_last=True so that no short "
            f"last batch is made, and do not yield a batch from a sampler or collate_fn that filtered out every "
            f"sample."
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


def _remade(template: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """A mapping of the same type as ``template`` holding ``values``; a plain dict where that type cannot be built
    from a dict."""
    if type(template) is dict:
        return values
    try:
        mapping_type: Any = type(template)
        return mapping_type(values)
    except TypeError:
        return values


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: B) -> B:
    """``batch`` with every tensor ``t`` in it (0-d ones included) replaced by ``fn(t)``, walked as the guard walks
    batches: where torch's pytree goes (dicts, lists, tuples, named tuples, the types registered with it), and into
    the mappings, lists and tuples it takes for leaves, which :func:`split_batch` splits as it splits a dict or a
    list (a tokenizer's ``BatchEncoding``, a ``UserDict``, a subclass of list). Those keep their types where they
    can be rebuilt (see :func:`split_batch`); a container with no tensor inside is given back as it is.

    >>> from collections import UserDict
    >>> made = map_tensors(torch.zeros_like, {"inputs": UserDict({"ids": torch.ones(2)}), "tag": "t"})
    >>> type(made["inputs"]).__name__, made["inputs"]["ids"].tolist(), made["tag"]
    ('UserDict', [0.0, 0.0], 't')
    """

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if not isinstance(value, (Mapping, list, tuple)) or not batch_tensors(value):
            return value
        if isinstance(value, Mapping):  # (torch's pytree takes it for a leaf: it walks dict and its own types only)
            return _remade(value, {key: map_tensors(fn, item) for key, item in value.items()})
        return _rebuild(value, [map_tensors(fn, item) for item in value])  # (a subclass of list, or of tuple)

    mapped: B = tree_map(leaf, batch)
    return mapped


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in ``batch`` (0-d ones included), found as :func:`map_tensors` finds them."""
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif isinstance(leaf, Mapping):
            found += batch_tensors(list(leaf.values()))
        elif isinstance(leaf, (list, tuple)):
            found += batch_tensors(list(leaf))
    return found


def _split(batch: Any, bounds: Sequence[tuple[int, int]], size: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * len(bounds)
        return [batch[start:stop] for start, stop in bounds]  # views: splitting allocates nothing
    if isinstance(batch, Mapping):
        columns = {key: _split(value, bounds, size) for key, value in batch.items()}
        return [_remade(batch, {key: column[i] for key, column in columns.items()}) for i in range(len(bounds))]
    if isinstance(batch, (list, tuple)):
        if _is_per_sample(batch, size):  # one entry per sample: each micro-batch gets its own entries
            return [_rebuild(batch, batch[start:stop]) for start, stop in bounds]
        columns_seq = [_split(value, bounds, size) for value in batch]
        return [_rebuild(batch, [column[i] for column in columns_seq]) for i in range(len(bounds))]
    return [batch] * len(bounds)


def split_batch(batch: B, micro_batch_size: int) -> list[B]:
    """Split ``batch`` along dim 0 into consecutive parts of at most ``micro_batch_size`` samples.

    Tensors become views (no copy); containers keep their types. The last part may be smaller. The rules, so
    that every micro-batch holds exactly its own samples:

    * The batch size is the shared dim 0 of the tensors with a dim 0, wherever they sit in mappings, lists and
      tuples; every such tensor is sliced along dim 0.
    * A list or tuple with exactly one entry per sample and no tensor with a dim 0 inside (strings, numbers,
      ``None``, 0-d tensors, or lists and dicts of those: ``{"input_ids": ..., "text": ["a", "b", ...]}``) is
      per-sample data: each part gets the slice of its own samples, in the sequence's type. A named tuple or a
      ``torch.Size`` is a record, not a list of samples, and is never sliced. When a sequence and the
      sequences in it all have one entry per sample, the outer one is taken as the list of samples.
    * Every other leaf, and every non-tensor list or tuple of another length, is given whole to every part.
    * A list or tuple that holds tensors is a container of batch tensors (``(inputs, targets)``, a list of
      per-layer states), split element by element, never a list of samples: a list of per-sample tensors of
      one shape looks exactly like ``[input_ids, attention_mask, labels]`` or a list of per-layer states, so
      it is not guessed at. When such a list disagrees with the batch on dim 0, the error says to stack the
      samples in the collate function; when it happens to agree, it is split as a container, so stack
      per-sample tensors before the guard.

    Raises :class:`~oomguard.BatchSplitError` for a batch with no batch dimension, whose tensors disagree on
    dim 0, or with no sample, and ``ValueError`` for a micro-batch size below 1.

    >>> parts = split_batch({"x": torch.arange(5), "text": list("abcde"), "tag": "t"}, 2)
    >>> [(part["x"].tolist(), part["text"], part["tag"]) for part in parts]
    [([0, 1], ['a', 'b'], 't'), ([2, 3], ['c', 'd'], 't'), ([4], ['e'], 't')]
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    size = batch_size(batch)
    bounds = [(start, min(start + micro_batch_size, size)) for start in range(0, size, micro_batch_size)]
    return _split(batch, bounds, size)


def first_samples(batch: B, count: int) -> B:
    """The first ``count`` samples of ``batch`` (all of them where it has fewer): ``split_batch(batch, count)[0]``,
    by the same rules, without slicing the parts after it. The planner's one-sample warm-up and its first two
    micro-batches take this: a batch of a million rows split whole to take its first part made a million slices
    (fake ones in a dry run: 10 minutes and 7 GB on the guard's first OOM).

    >>> first_samples({"x": torch.arange(5), "text": list("abcde"), "tag": "t"}, 2)
    {'x': tensor([0, 1]), 'text': ['a', 'b'], 'tag': 't'}
    """
    if count < 1:
        raise ValueError(f"the number of samples must be at least 1, got {count}")
    size = batch_size(batch)
    first: B = _split(batch, [(0, min(count, size))], size)[0]
    return first


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
    return max((tensor.numel() for _, tensor in batch_leaves(batch)), default=0)


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


#: Models already looked at for layers that micro-batches change (once per model, planner included: not a walk of
#: every module on every split step).
_CHECKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def warn_if_batch_statistics(model: torch.nn.Module, micro: int) -> None:
    """Say once per model that its BatchNorm layers in training mode see micro-batches, not the batch.

    Every other layer computes each sample on its own, so micro-batches with exact accumulation give the whole
    batch's gradients; a BatchNorm layer normalises by the statistics of the samples it is given (and updates its
    running estimates from them), so the step is no longer the whole batch's, by an amount no one can bound here.
    """
    if model in _CHECKED:
        return
    _CHECKED.add(model)
    norms = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training
    ]
    if not norms:
        return
    shown = ", ".join(norms[:3]) + (f" and {len(norms) - 3} more" if len(norms) > 3 else "")
    logger.warning(
        "micro-batches of %d: the model's BatchNorm layers in training mode (%s) now normalise by each micro-batch's "
        "statistics and update their running estimates from them, so a step is no longer exactly the whole "
        "batch's. If that matters, leave micro_batch off the ladder (ladder=[...] without it) or set its floor "
        "(oomguard.MicroBatch(min_size=...)), or use GroupNorm/LayerNorm, which micro-batching does not change.",
        micro,
        shown,
    )
