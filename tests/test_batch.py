"""Splitting batches into micro-batches along dim 0, and weighing each micro-batch in the loss."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import pytest
import torch
from helpers.batch_trees import KEYS, OTHER_LEAVES, Pair, assert_rejoins, nested_batches, shares_storage
from helpers.batches import MAPPING_LEAVES, as_mapping_leaf
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten

from oomguard import BatchSplitError, batch_size, split_batch
from oomguard._step.batch import (
    batch_leaves,
    batch_tensors,
    count_items,
    default_item_counter,
    first_samples,
    map_tensors,
)

IGNORE = -100


class MyDict(dict):  # type: ignore[type-arg]
    """A user's dict subclass: splitting must keep it."""


# -- splitting --------------------------------------------------------------------------------------------


def test_single_tensor_splits_into_views_with_an_uneven_last_part() -> None:
    whole = torch.arange(14.0).reshape(7, 2)
    parts = split_batch(whole, 3)
    assert [part.shape[0] for part in parts] == [3, 3, 1]
    assert torch.equal(parts[2], whole[6:])
    assert_rejoins(whole, parts)


def test_micro_batch_size_at_least_the_batch_gives_one_part() -> None:
    whole = torch.arange(5)
    for size in (5, 6, 100):
        (part,) = split_batch(whole, size)
        assert torch.equal(part, whole)
        assert shares_storage(part, whole)


def test_micro_batch_size_one_gives_one_part_per_sample() -> None:
    batch = {"x": torch.arange(4), "y": torch.arange(4) * 10}
    parts = split_batch(batch, 1)
    assert [part["y"].tolist() for part in parts] == [[0], [10], [20], [30]]


def test_parts_are_views_of_the_input() -> None:
    x = torch.randn(6, 3)
    parts = split_batch({"x": x}, 4)
    for part in parts:
        assert shares_storage(part["x"], x)
    parts[1]["x"][0, 0] = 123.0  # writing through a part writes the batch: nothing was copied
    assert x[4, 0].item() == 123.0


def test_non_contiguous_tensor_splits_exactly() -> None:
    x = torch.arange(24).reshape(4, 6).t()  # 6 samples, strided
    parts = split_batch(x, 4)
    assert [part.shape for part in parts] == [(4, 4), (2, 4)]
    assert_rejoins(x, parts)


def test_dict_of_tensors_with_non_tensor_leaves() -> None:
    scale = torch.tensor(0.5)  # 0-d: shared by every sample, not split
    batch = {"input_ids": torch.arange(10).reshape(5, 2), "name": "books", "epoch": 3, "mask": None, "scale": scale}
    parts = split_batch(batch, 2)
    assert len(parts) == 3
    for part in parts:
        assert part["name"] == "books"
        assert part["epoch"] == 3
        assert part["mask"] is None
        assert part["scale"] is scale
    assert_rejoins(batch, parts)


def test_lists_tuples_and_nesting() -> None:
    batch = {
        "features": [torch.randn(5, 3), (torch.arange(5), "tag")],
        "meta": {"ids": torch.arange(5) + 100, "weights": (torch.ones(5, 1), 7)},
    }
    parts = split_batch(batch, 2)
    assert [batch_size(part) for part in parts] == [2, 2, 1]
    assert type(parts[0]["features"]) is list
    assert type(parts[0]["features"][1]) is tuple
    assert parts[2]["meta"]["ids"].tolist() == [104]
    assert_rejoins(batch, parts)


def test_tuple_batch_keeps_its_type() -> None:
    batch = (torch.randn(5, 16), torch.randn(5))
    parts = split_batch(batch, 3)
    assert all(type(part) is tuple for part in parts)
    assert_rejoins(batch, parts)


def test_named_tuple_keeps_its_type_and_fields() -> None:
    batch = Pair(inputs=torch.randn(5, 2), targets=[torch.arange(5), "label"])
    parts = split_batch(batch, 2)
    assert all(isinstance(part, Pair) for part in parts)
    assert parts[1].targets[0].tolist() == [2, 3]
    assert parts[1].targets[1] == "label"
    assert_rejoins(batch, parts)


@pytest.mark.parametrize("mapping_type", [MyDict, OrderedDict])
def test_dict_subclasses_keep_their_type(mapping_type: type) -> None:
    batch = mapping_type(x=torch.arange(5), y=torch.arange(5) * 2)
    parts = split_batch(batch, 2)
    assert all(type(part) is mapping_type for part in parts)
    assert [part["y"].tolist() for part in parts] == [[0, 2], [4, 6], [8]]


def test_transformers_batch_encoding_stays_a_batch_encoding() -> None:
    from transformers import BatchEncoding

    batch = BatchEncoding({"input_ids": torch.arange(12).reshape(4, 3), "attention_mask": torch.ones(4, 3)})
    parts = split_batch(batch, 3)
    assert all(type(part) is BatchEncoding for part in parts)
    assert parts[1].input_ids.tolist() == [[9, 10, 11]]  # attribute access still works
    assert torch.equal(torch.cat([part["attention_mask"] for part in parts]), batch["attention_mask"])
    assert all(shares_storage(part["input_ids"], batch["input_ids"]) for part in parts)


class Row(list):  # type: ignore[type-arg]
    """A user's list subclass: a leaf to torch's pytree, split as a list."""


@pytest.mark.parametrize("kind", MAPPING_LEAVES)
def test_map_tensors_walks_into_what_torch_pytree_takes_for_leaves_as_splitting_does(kind: str) -> None:
    """Issue 45, finding 13: the dry run faked a batch's tensors with torch's pytree, which walks plain dicts, lists
    and tuples only: a ``BatchEncoding``'s or a ``UserDict``'s tensors stayed real. ``map_tensors`` (the dry run's
    walk now) and ``batch_tensors`` find every tensor ``split_batch`` splits, and keep the containers' types."""
    inner = as_mapping_leaf(kind, {"input_ids": torch.ones(2, 3), "labels": torch.zeros(2, 3)})
    batch = {"text": as_mapping_leaf(kind, {"ids": inner, "rows": Row([torch.ones(2), "a"])}), "tag": "t"}
    made = map_tensors(lambda tensor: tensor + 1, batch)
    assert type(made["text"]) is type(batch["text"]) and type(made["text"]["ids"]) is type(inner)
    assert made["text"]["ids"]["labels"].tolist() == [[1.0] * 3] * 2 and made["tag"] == "t"
    assert type(made["text"]["rows"]) is Row and made["text"]["rows"][0].tolist() == [2.0, 2.0]
    assert made["text"]["rows"][1] == "a"
    assert (
        [tuple(t.shape) for t in batch_tensors(batch)]
        == [(2, 3), (2, 3), (2,)]
        == [tuple(t.shape) for _, t in batch_leaves(batch)]
    )
    plain = as_mapping_leaf(kind, {"names": ["a", "b"]})
    assert map_tensors(torch.zeros_like, plain) is plain, "a container with no tensor is given back as it is"


# -- errors -----------------------------------------------------------------------------------------------


def test_tensors_disagreeing_on_dim_zero_name_both_paths() -> None:
    batch = {"inputs": {"ids": torch.zeros(4, 3)}, "extra": [torch.zeros(5)]}
    with pytest.raises(BatchSplitError) as caught:
        split_batch(batch, 2)
    message = str(caught.value)
    assert "batch['inputs']['ids']" in message
    assert "batch['extra'][0]" in message
    assert "4" in message
    assert "5" in message


def test_batch_size_reports_the_same_disagreement() -> None:
    with pytest.raises(BatchSplitError, match=r"batch\[0\].*batch\[1\]"):
        batch_size((torch.zeros(3), torch.zeros(2)))


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param({"name": "x", "n": 3}, id="no-tensor"),
        pytest.param([], id="empty-list"),
        pytest.param({"scale": torch.tensor(1.0)}, id="only-0d-tensor"),
        pytest.param("just a string", id="string"),
    ],
)
def test_batch_without_a_batch_dimension_is_refused(batch: Any) -> None:
    with pytest.raises(BatchSplitError, match="no tensor with a batch dimension"):
        split_batch(batch, 2)


def test_batch_split_error_is_also_a_value_error() -> None:
    # Callers that catch ValueError for bad input keep working.
    with pytest.raises(ValueError, match="disagree on dim 0"):
        split_batch([torch.zeros(2), torch.zeros(3)], 1)


@pytest.mark.parametrize("micro_batch_size", [0, -1])
def test_micro_batch_size_below_one_is_refused(micro_batch_size: int) -> None:
    with pytest.raises(ValueError, match="micro_batch_size must be at least 1"):
        split_batch(torch.zeros(4), micro_batch_size)


def test_batch_size_of_nested_batch() -> None:
    assert batch_size({"a": "text", "b": [None, {"c": torch.zeros(6, 2)}]}) == 6


# -- weighing micro-batches -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def lm_batch() -> dict[str, torch.Tensor]:
    """Four rows whose ignored labels sit in different places, so the one-token shift changes the counts."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (4, 6), generator=generator)
    labels = ids.clone()
    labels[0, 0] = IGNORE  # dropped by the shift anyway
    labels[2, 4:] = IGNORE  # right padding
    labels[3, :2] = IGNORE  # a masked prompt
    return {"input_ids": ids, "labels": labels}


def test_causal_lm_counts_labels_after_the_shift(tiny_llama: torch.nn.Module) -> None:
    batch = lm_batch()
    labels = batch["labels"]
    count = default_item_counter(tiny_llama)
    # Shifted: row 0 keeps 5, row 1 keeps 5, row 2 keeps 3 (positions 1..3), row 3 keeps 4 (positions 2..5).
    assert count(batch) == 5 + 5 + 3 + 4
    assert count(batch) == int((labels[..., 1:] != IGNORE).sum())
    assert count(batch) != int((labels != IGNORE).sum())  # the batch is built so that the shift matters


def test_causal_lm_counts_make_micro_batch_losses_add_up_to_the_full_loss(tiny_llama: torch.nn.Module) -> None:
    # The reason for the counts: weighting each micro-batch's mean loss by its share of counted items gives the
    # full batch's mean loss exactly; weighting by unshifted label counts does not.
    batch = lm_batch()
    count = default_item_counter(tiny_llama)
    with torch.no_grad():
        full = tiny_llama(**batch).loss
        parts = split_batch(batch, 1)
        losses = [tiny_llama(**part).loss for part in parts]
    counts = count_items(parts, count)
    weighted = sum(loss * n for loss, n in zip(losses, counts, strict=True)) / sum(counts)
    assert torch.allclose(weighted, full, rtol=1e-5, atol=1e-6)

    unshifted = [float((part["labels"] != IGNORE).sum()) for part in parts]
    wrong = sum(loss * n for loss, n in zip(losses, unshifted, strict=True)) / sum(unshifted)
    assert not torch.allclose(wrong, full, rtol=1e-5, atol=1e-6)


def test_wrapped_causal_lm_still_shifts(tiny_llama: torch.nn.Module) -> None:
    class Wrapper(torch.nn.Module):  # what DDP and DataParallel look like: the model under .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    batch = lm_batch()
    assert default_item_counter(Wrapper(tiny_llama))(batch) == int((batch["labels"][..., 1:] != IGNORE).sum())


def test_non_lm_model_counts_labels_without_shift() -> None:
    batch = lm_batch()
    expected = int((batch["labels"] != IGNORE).sum())  # every non-ignored label, first column included
    assert default_item_counter(torch.nn.Linear(4, 4))(batch) == expected
    assert default_item_counter(None)(batch) == expected


def test_shift_labels_are_counted_as_they_are(tiny_llama: torch.nn.Module) -> None:
    shift_labels = torch.tensor([[1, 2, IGNORE], [IGNORE, IGNORE, 5]])
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "shift_labels": shift_labels}
    assert default_item_counter(tiny_llama)(batch) == 3
    # shift_labels win over labels when a batch has both
    batch["labels"] = torch.zeros(2, 3, dtype=torch.long)
    assert default_item_counter(tiny_llama)(batch) == 3
    assert default_item_counter(None)(batch) == 3


def test_one_dimensional_labels_count_samples(tiny_llama: torch.nn.Module) -> None:
    # Classification labels (one per sample) carry no shift: the weight is the number of samples.
    batch = {"x": torch.zeros(5, 2), "labels": torch.tensor([0, 1, IGNORE, 1, 0])}
    assert default_item_counter(torch.nn.Linear(2, 2))(batch) == 5
    assert default_item_counter(tiny_llama)(batch) == 5


def test_tuple_batch_counts_samples() -> None:
    counter = default_item_counter(torch.nn.Linear(16, 1))
    assert counter((torch.randn(7, 16), torch.randn(7))) == 7
    parts = split_batch((torch.randn(7, 16), torch.randn(7)), 3)
    assert count_items(parts, counter) == [3.0, 3.0, 1.0]


def test_count_items_accepts_zero() -> None:
    # A micro-batch whose labels are all ignored weighs nothing; that is legal.
    assert count_items([{"labels": torch.full((1, 4), IGNORE)}], default_item_counter(None)) == [0.0]


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf])
def test_count_items_rejects_negative_and_non_finite_counts(bad: float) -> None:
    with pytest.raises(ValueError, match="micro-batch 1") as caught:
        count_items(["a", "b"], lambda part: 2 if part == "a" else bad)
    assert repr(float(bad)) in str(caught.value)


# -- property: split, then join, gives the batch back --------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(nested_batches(), st.integers(1, 12))
def test_split_then_join_gives_the_batch_back(drawn: tuple[Any, int], micro_batch_size: int) -> None:
    batch, n = drawn
    parts = split_batch(batch, micro_batch_size)
    assert len(parts) == math.ceil(n / micro_batch_size)
    sizes = [batch_size(part) for part in parts]
    assert sizes == [min(micro_batch_size, n - start) for start in range(0, n, micro_batch_size)]
    assert_rejoins(batch, parts)


@settings(max_examples=60, deadline=None)
@given(nested_batches(), st.integers(1, 12))
def test_the_first_samples_are_the_first_part_of_the_split(drawn: tuple[Any, int], count: int) -> None:
    """The planner's warm-up and fake steps take a batch's first samples alone (slicing a million rows to use one
    cost minutes): the same part, of the same types, as the split's first."""
    batch, _ = drawn
    first, part = first_samples(batch, count), split_batch(batch, count)[0]
    (got, got_spec), (expected, expected_spec) = tree_flatten(first), tree_flatten(part)
    assert got_spec == expected_spec
    for a, b in zip(got, expected, strict=True):
        assert type(a) is type(b)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@st.composite
def batches_with_per_sample_sequences(draw: st.DrawFn) -> tuple[Any, int]:
    """A nested batch with lists and tuples of one non-tensor entry per sample, next to lists that are not."""
    batch, n = draw(nested_batches())
    entries = st.one_of(OTHER_LEAVES, st.dictionaries(KEYS, OTHER_LEAVES, max_size=2))
    per_sample = draw(st.lists(entries, min_size=n, max_size=n))
    as_tuple = draw(st.booleans())
    other_length = draw(st.integers(0, 10).filter(lambda length: length != n))
    return {
        "batch": batch,
        "text": tuple(per_sample) if as_tuple else per_sample,
        "shared": [f"tag{i}" for i in range(other_length)],
    }, n


@settings(max_examples=60, deadline=None)
@given(batches_with_per_sample_sequences(), st.integers(1, 12))
def test_per_sample_sequences_split_then_join_give_the_batch_back(
    drawn: tuple[Any, int], micro_batch_size: int
) -> None:
    batch, n = drawn
    parts = split_batch(batch, micro_batch_size)
    assert sum(len(part["text"]) for part in parts) == n
    for part in parts:
        assert len(part["text"]) == batch_size(part)  # each micro-batch gets its own samples' entries
        assert part["shared"] == batch["shared"]  # a list of another length is given whole
    assert_rejoins(batch, parts)


# -- per-sample sequences ------------------------------------------------------------------------------------


def test_a_per_sample_list_of_strings_is_split_with_the_tensors() -> None:
    texts = ["a", "b", "c", "d", "e"]
    batch: dict[str, Any] = {"input_ids": torch.arange(10).reshape(5, 2), "text": texts}
    parts = split_batch(batch, 2)
    assert [part["text"] for part in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert [part["input_ids"].shape[0] for part in parts] == [2, 2, 1]
    assert all(type(part["text"]) is list for part in parts)
    assert texts == ["a", "b", "c", "d", "e"]  # the caller's list is not modified
    assert_rejoins(batch, parts)


def test_per_sample_tuples_dicts_numbers_and_0d_tensors_are_split_keeping_their_types() -> None:
    class Texts(list):  # type: ignore[type-arg]
        """A user's list subclass: splitting keeps it."""

    records = [{"id": i, "source": "web"} for i in range(4)]
    scores = [torch.tensor(float(i)) for i in range(4)]  # 0-d tensors are per-sample values like numbers
    batch: dict[str, Any] = {
        "x": torch.randn(4, 3),
        "ids": (10, 11, 12, 13),  # what `tuple(zip(*samples))` gives
        "records": records,
        "scores": scores,
        "texts": Texts(["w", "x", "y", "z"]),
        "tokens": [["a", "b"], ["c"], [], ["d"]],  # one ragged list of tokens per sample
    }
    parts = split_batch(batch, 3)
    assert [part["ids"] for part in parts] == [(10, 11, 12), (13,)]
    assert all(type(part["ids"]) is tuple and type(part["texts"]) is Texts for part in parts)
    assert parts[1]["records"][0] is records[3]
    assert parts[1]["scores"][0] is scores[3]
    assert parts[0]["tokens"] == [["a", "b"], ["c"], []]
    assert_rejoins(batch, parts)


def test_sequences_of_another_length_named_tuples_and_shapes_are_given_whole() -> None:
    x = torch.randn(2, 5)
    batch: dict[str, Any] = {
        "x": x,
        "classes": ["cat", "dog", "eel"],  # 3 entries, 2 samples: not per-sample
        "pair": Pair("left", "right"),  # a record with 2 fields, not 2 samples
        "shape": x.shape,  # torch.Size([2, 5]) has 2 entries too: a shape, never samples
    }
    parts = split_batch(batch, 1)
    assert len(parts) == 2
    for part in parts:
        assert part["classes"] == ["cat", "dog", "eel"]
        assert part["pair"] == Pair("left", "right")
        assert part["shape"] == torch.Size([2, 5])
        assert part["x"].shape == (1, 5)


def test_containers_of_batch_tensors_still_split_element_wise() -> None:
    # Lists and tuples of tensors are containers of batch tensors, even when they have one entry per sample:
    # (inputs, targets), three same-shaped tensors, and a list of per-layer states with as many layers as samples.
    pair = (torch.randn(2, 2), torch.randn(2, 2))
    triple = [torch.arange(12).reshape(4, 3) + k for k in range(3)]
    layers: dict[str, Any] = {
        "input_ids": torch.arange(8).reshape(4, 2),
        "past": [torch.randn(4, 2, 3) for _ in range(4)],
    }
    for batch, micro, size in ((pair, 1, 2), (triple, 2, 4), (layers, 2, 4)):
        parts = split_batch(batch, micro)
        assert len(parts) == size // micro
        assert [batch_size(part) for part in parts] == [micro] * (size // micro)
        assert_rejoins(batch, parts)
    assert len(split_batch(layers, 2)[0]["past"]) == 4  # every layer, each with half of the samples


def test_a_guarded_step_after_an_oom_gets_each_micro_batch_s_own_texts() -> None:
    from helpers.models import make_mlp

    from oomguard import oom_guard
    from oomguard.testing import SimulatedGPU

    model = make_mlp()
    seen: list[list[str]] = []

    @oom_guard(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    def step(batch: dict[str, Any]) -> torch.Tensor:
        assert len(batch["text"]) == batch["input_ids"].shape[0], "the texts must travel with their samples"
        seen.append(list(batch["text"]))
        loss: torch.Tensor = model(batch["input_ids"]).square().mean()
        return loss

    texts = [f"sample {i}" for i in range(8)]
    batch = {"input_ids": torch.randn(8, 16), "text": texts}
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        gpu.fail_allocation(1)  # the whole batch's first allocation fails: the guard splits the batch
        result = step(batch)
    assert result.ooms == 1
    assert result.micro_batches >= 2
    done = seen[-result.micro_batches :]  # the successful attempt: every text once, in order
    assert [text for part in done for text in part] == texts


# -- empty batches --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(torch.zeros(0, 16), id="tensor"),
        pytest.param((torch.zeros(0, 16), torch.zeros(0)), id="tuple"),
        pytest.param({"input_ids": torch.zeros(0, 8, dtype=torch.long), "text": []}, id="dict"),
    ],
)
def test_an_empty_batch_is_refused_with_the_fix(batch: Any) -> None:
    for call in (lambda: batch_size(batch), lambda: split_batch(batch, 2)):
        with pytest.raises(BatchSplitError) as caught:
            call()
        message = str(caught.value)
        assert "empty" in message
        assert "0 samples" in message
        assert "drop_last=True" in message


def test_a_guarded_call_on_an_empty_batch_raises_before_anything_runs() -> None:
    from helpers.models import make_mlp
    from helpers.steps import mse_step

    from oomguard import oom_guard

    model = make_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, scheduler=scheduler)
    with pytest.raises(BatchSplitError, match="empty"):
        step((torch.zeros(0, 16), torch.zeros(0)))
    assert optimizer.state == {}  # no AdamW step: no moments, no step count
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # no weight decay
    assert scheduler.last_epoch == 0
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert step.guard.steps == 0


# -- lists of per-sample tensors ------------------------------------------------------------------------------


def test_a_list_of_per_sample_tensors_beside_a_batch_tensor_is_refused_with_the_fix() -> None:
    batch = {"input_ids": torch.zeros(8, 16), "pixel_values": [torch.zeros(3, 4, 4) for _ in range(8)]}
    with pytest.raises(BatchSplitError) as caught:
        batch_size(batch)
    message = str(caught.value)
    assert "batch['pixel_values']" in message
    assert "one tensor per sample" in message
    assert "torch.stack" in message


def test_a_ragged_list_of_per_sample_tensors_is_refused_with_the_fix() -> None:
    with pytest.raises(BatchSplitError) as caught:
        split_batch([torch.zeros(12), torch.zeros(9), torch.zeros(14)], 1)
    message = str(caught.value)
    assert "one tensor per sample" in message
    assert "pad_sequence" in message


def test_a_mismatched_input_target_pair_gets_no_per_sample_hint() -> None:
    # Two tensors that disagree are far more likely a mistake in one of them than two samples.
    with pytest.raises(BatchSplitError) as caught:
        batch_size((torch.zeros(4, 3), torch.zeros(5)))
    assert "one tensor per sample" not in str(caught.value)


def _warnings_for(model: torch.nn.Module, plan_size: int | None, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The guard's warnings over two steps of ``model`` on micro-batches of ``plan_size`` (None: the whole batch)."""
    import logging

    from oomguard import OOMGuard, Plan

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), ladder=[])
    guard.plan = Plan(micro_batch_size=plan_size)
    batch = (torch.randn(8, 4), torch.randn(8, 1))
    with caplog.at_level(logging.WARNING, logger="oomguard"):
        guard(batch)
        guard(batch)
    return [record.getMessage() for record in caplog.records if "BatchNorm" in record.getMessage()]


def test_micro_batches_under_batchnorm_say_once_that_the_step_is_no_longer_the_whole_batchs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """BatchNorm normalises by the samples it is given: split, its statistics are each micro-batch's."""
    normed = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    (warning,) = _warnings_for(normed, 2, caplog)
    assert "micro-batches of 2" in warning and "(1)" in warning and "MicroBatch(min_size=" in warning


@pytest.mark.parametrize("case", ["whole batch", "no BatchNorm", "BatchNorm in eval mode"])
def test_no_batchnorm_warning_where_micro_batches_change_nothing(case: str, caplog: pytest.LogCaptureFixture) -> None:
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1)]
    if case != "no BatchNorm":
        layers[1] = torch.nn.BatchNorm1d(8)
    model = torch.nn.Sequential(*layers)
    if case == "BatchNorm in eval mode":
        model[1].eval()
    assert _warnings_for(model, None if case == "whole batch" else 2, caplog) == []
