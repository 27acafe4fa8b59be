"""Nested batches drawn by hypothesis (tensors, per-sample sequences and other leaves in dicts, lists, tuples and
named tuples), and the check that the parts a batch is split into rejoin into it exactly."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st

from oomguard import batch_size


class Pair(NamedTuple):
    inputs: Any
    targets: Any


def shares_storage(part: torch.Tensor, whole: torch.Tensor) -> bool:
    return part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def has_batch_tensor(value: Any) -> bool:
    """Whether ``value`` holds, at any depth of mappings, lists and tuples, a tensor with a dim 0."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    if isinstance(value, dict):
        return any(has_batch_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_batch_tensor(item) for item in value)
    return False


def is_per_sample(value: Any, size: int) -> bool:
    """The documented rule: a list or tuple (not a named tuple, not a ``torch.Size``) with one entry per sample
    and no tensor with a dim 0 inside it is split with the batch."""
    return (
        isinstance(value, (list, tuple))
        and not hasattr(value, "_fields")
        and not isinstance(value, torch.Size)
        and len(value) == size
        and not has_batch_tensor(value)
    )


def assert_rejoins(original: Any, parts: list[Any], size: int | None = None) -> None:
    """The parts have the original's structure and types; tensors and per-sample sequences concatenate back to
    it exactly; other leaves (and 0-d tensors) are the very same objects in every part."""
    assert parts, "a batch with samples must give at least one part"
    if size is None:
        size = batch_size(original)
    for part in parts:
        assert type(part) is type(original)
    if is_per_sample(original, size):
        entries = [item for part in parts for item in part]
        assert len(entries) == len(original)
        assert all(a is b for a, b in zip(entries, original, strict=True))  # the very same entries, in order
        return
    if isinstance(original, torch.Tensor) and original.dim() > 0:
        joined = torch.cat(parts)
        assert joined.dtype == original.dtype
        assert torch.equal(joined, original)
        for part in parts:
            assert shares_storage(part, original)  # a view, not a copy
    elif isinstance(original, dict):
        for part in parts:
            assert list(part) == list(original)
        for key, value in original.items():
            assert_rejoins(value, [part[key] for part in parts], size)
    elif isinstance(original, (list, tuple)):
        for part in parts:
            assert len(part) == len(original)
        for index, value in enumerate(original):
            assert_rejoins(value, [part[index] for part in parts], size)
    else:
        for part in parts:
            assert part is original


KEYS = st.text(alphabet="abcxyz_", min_size=1, max_size=4)


OTHER_LEAVES = st.one_of(
    st.none(),
    st.integers(-5, 5),
    st.text(max_size=3),
    st.floats(-2, 2, allow_nan=False).map(lambda value: torch.tensor(value)),  # 0-d tensor
)


@st.composite
def sample_tensors(draw: st.DrawFn, n: int) -> torch.Tensor:
    width = draw(st.integers(0, 3))
    start = draw(st.integers(-50, 50))
    dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.bool]))
    values = torch.arange(start, start + n * max(width, 1)).to(dtype)
    if width == 0:
        return values  # shape (n,)
    if draw(st.booleans()):
        return values.reshape(width, n).t()  # non-contiguous (n, width)
    return values.reshape(n, width)


@st.composite
def nested_batches(draw: st.DrawFn) -> tuple[Any, int]:
    n = draw(st.integers(1, 9))
    leaves = st.one_of(sample_tensors(n), OTHER_LEAVES)
    tree = draw(
        st.recursive(
            leaves,
            lambda children: st.one_of(
                st.lists(children, max_size=3),
                st.lists(children, max_size=3).map(tuple),
                st.dictionaries(KEYS, children, max_size=3),
                st.builds(Pair, children, children),
            ),
            max_leaves=8,
        )
    )
    anchor = draw(sample_tensors(n))  # at least one tensor with the batch dimension, wherever the tree has none
    outer = draw(st.sampled_from(["dict", "list", "named tuple", "bare tensor"]))
    if outer == "dict":
        return {"anchor": anchor, "rest": tree}, n
    if outer == "list":
        return [tree, anchor], n
    if outer == "named tuple":
        return Pair(anchor, tree), n
    return anchor, n
