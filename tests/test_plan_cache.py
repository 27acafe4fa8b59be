"""Issue 28, item 3: a restarted job plans nothing, and planning is counted in the events. The jump's fallback
event and preplan's ``planned`` event say how many fake steps their dry run took; a restart with the state file
takes the plans it remembers (no jump, no preplan), and a batch shape planned before, in this process or in the
state file, takes the recorded answer where it holds for the room there is (:mod:`oomguard._guard.answers`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import MAPPING_LEAVES, as_mapping_leaf, lm_batch, tuple_batch
from helpers.models import make_mlp
from helpers.steps import mse_step
from torch._subclasses.fake_tensor import is_fake

from oomguard import MicroBatch, OOMGuard, Plan, PlannedEvent
from oomguard._cli.main import main
from oomguard._guard.answers import batch_signature
from oomguard._guard.persist import PER_MODEL, PlanStore
from oomguard.testing import SimulatedGPU

WIDTH, SAMPLES, BUDGET = 256, 256, "200KiB"  # the whole batch runs out of memory; micro-batches of 32 fit


def counting(step: Callable[[Any], Any]) -> Any:
    """``step``, counting its calls on fake tensors (a dry run's), in an attribute no dry run puts back."""

    def counted(batch: Any) -> Any:
        counted.fake_calls += any(is_fake(leaf) for leaf in batch)  # type: ignore[attr-defined]
        return step(batch)

    counted.fake_calls = 0  # type: ignore[attr-defined]
    return counted


def job(
    state: Path | None,
    log: Path,
    steps: int = 3,
    hold: int = 0,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.SGD,
    **options: Any,
) -> tuple[list[Any], Any]:
    """A fresh job (a restart: a new model of the same seed, a new optimizer and guard) of ``steps`` calls on
    batches of the same shape; ``hold`` bytes of the device are held by something else meanwhile. Its results,
    and its step (whose ``fake_calls`` count the dry runs' calls)."""
    model = make_mlp(width=WIDTH)
    step = counting(mse_step(model))
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    guard = OOMGuard(step, model=model, optimizer=optimizer, tune_after=None, state_file=state, log_file=log,
                     **options)  # fmt: skip
    with SimulatedGPU(BUDGET) as gpu:
        gpu.adopt(model)
        held = torch.empty(hold // 4, dtype=torch.float32)  # (counted: a tensor made under the simulator)
        results = [guard(tuple_batch(n=SAMPLES, seed=seed)) for seed in range(steps)]
        del held
    guard.close()
    step.guard = guard
    return results, step


def events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [event for line in log.read_text().splitlines() if (event := json.loads(line))["event"] == kind]


def planned_fake_steps(log: Path) -> int:
    """Fake steps the log's events say were run (jumps and preplan)."""
    return sum(event.get("fake_steps", 0) for kind in ("fallback", "planned") for event in events(log, kind))


def test_a_restarted_job_with_a_state_file_neither_jumps_nor_plans(tmp_path: Path) -> None:
    """Before: the fallback event had no fake_steps (the jump's dry run was uncounted)."""
    state = tmp_path / "plans.json"
    first, step = job(state, tmp_path / "first.jsonl")
    (jump,) = events(tmp_path / "first.jsonl", "fallback")
    assert first[0].ooms == 1 and jump["engaged"] and "dry-run planner" in jump["description"]
    assert jump["fake_steps"] > 0 and jump["planning_seconds"] > 0 and step.fake_calls >= jump["fake_steps"] > 0
    again, restarted = job(state, tmp_path / "again.jsonl")
    assert [r.ooms for r in again] == [0, 0, 0] and again[0].plan == first[0].plan, "the remembered plan, at once"
    assert restarted.fake_calls == 0 and planned_fake_steps(tmp_path / "again.jsonl") == 0


def test_preplan_says_what_it_chose_and_what_it_cost_and_a_restart_skips_it(tmp_path: Path) -> None:
    """Before: preplan had no event at all."""
    state, log = tmp_path / "plans.json", tmp_path / "first.jsonl"
    first, step = job(state, log, preplan=True)
    (planned,) = events(log, "planned")
    assert [r.ooms for r in first] == [0, 0, 0], "preplan started on a plan that fits"
    assert Plan.from_dict(planned["plan"]) == first[0].plan and planned["plan"]["micro_batch_size"] is not None
    assert planned["recommended"] is True and planned["skipped"] is None
    assert planned["fake_steps"] > 0 and planned["planning_seconds"] > 0 and step.fake_calls >= planned["fake_steps"]
    assert "starting on micro-batches of" in planned["description"] and "fake steps" in planned["description"]
    event = step.guard.events[0]
    assert isinstance(event, PlannedEvent) and event.describe().startswith("step 0: preplan: starting on")
    assert main(["report", str(log)]) == 0, "the report reads a log with the new event"
    again, restarted = job(state, tmp_path / "again.jsonl", preplan=True)
    (skipped,) = events(tmp_path / "again.jsonl", "planned")
    assert skipped["skipped"] == "state_file" and skipped["fake_steps"] == 0 and restarted.fake_calls == 0
    assert Plan.from_dict(skipped["plan"]) == first[0].plan == again[0].plan and again[0].ooms == 0


def test_a_shape_planned_before_in_the_same_process_takes_the_recorded_answer(tmp_path: Path) -> None:
    """A bucket planned anew (here: the plans forgotten, ``guard.plan = Plan()``) whose batch has a shape the jump
    planned before jumps to the same plan with no dry run. Before: every such jump ran the planner again."""
    log = tmp_path / "log.jsonl"
    results, step = job(None, log, steps=1)
    guard, calls = step.guard, step.fake_calls
    guard.plan = Plan()
    with SimulatedGPU(BUDGET) as gpu:
        gpu.adopt(guard.model)
        again = guard(tuple_batch(n=SAMPLES, seed=7))
    guard.close()
    first, second = events(log, "fallback")
    assert again.ooms == 1 and again.plan == results[0].plan and step.fake_calls == calls > 0
    assert first["fake_steps"] > 0 and second["fake_steps"] == 0 and second["planning_seconds"] == 0
    assert "recorded for a batch of this shape" in second["description"]


def test_a_restart_takes_the_answer_the_state_file_recorded_where_no_plan_is_remembered(tmp_path: Path) -> None:
    """The state file keeps the planner's answers beside the plans: a restart whose bucket has no plan (dropped
    here; in practice evicted by other jobs' plans, or a bucket whose plan was never saved) jumps with no dry run."""
    state = tmp_path / "plans.json"
    first, _ = job(state, tmp_path / "first.jsonl")
    document = json.loads(state.read_text())
    assert len(document["answers"]) == 1 and document["version"] == 1
    document["plans"] = {}
    state.write_text(json.dumps(document))
    again, restarted = job(state, tmp_path / "again.jsonl")
    (jump,) = events(tmp_path / "again.jsonl", "fallback")
    assert again[0].ooms == 1 and again[0].plan == first[0].plan and restarted.fake_calls == 0
    assert jump["fake_steps"] == 0 and "recorded" in jump["description"]


def test_an_answer_is_not_taken_where_the_room_differs_from_what_it_was_planned_for(tmp_path: Path) -> None:
    """With 40 KiB of the device held by something else, the recorded plan's predicted need no longer fits: the
    jump plans again (and finds a plan for the room there is)."""
    state = tmp_path / "plans.json"
    first, _ = job(state, tmp_path / "first.jsonl")
    document = json.loads(state.read_text())
    document["plans"] = {}
    state.write_text(json.dumps(document))
    again, restarted = job(state, tmp_path / "again.jsonl", hold=40 * 1024)
    (jump,) = events(tmp_path / "again.jsonl", "fallback")
    assert jump["fake_steps"] > 0 and restarted.fake_calls > 0, "planned again"
    assert again[0].plan.effective_micro_batch_size(SAMPLES) < first[0].plan.effective_micro_batch_size(SAMPLES)


@pytest.mark.parametrize(
    "answers",
    [None, [1, 2], {"x": {"plan": "micro_batch_size"}}, "damaged-ours"],
    ids=["older-file", "a-list", "foreign-garbage", "ours-unreadable"],
)
def test_a_file_without_answers_or_with_damaged_ones_loads_its_plans_and_is_rewritten(
    answers: Any, tmp_path: Path
) -> None:
    """An older state file (no ``answers``) still loads, as does one whose answers no reader can use: its plans
    are taken, the damaged answers are ignored (the job plans that shape again), and the next save writes the
    answers it has."""
    state = tmp_path / "plans.json"
    first, _ = job(state, tmp_path / "first.jsonl")
    document = json.loads(state.read_text())
    (key,) = document["answers"]
    if answers is None:
        del document["answers"]
    elif answers == "damaged-ours":
        document["answers"] = {key: {"plan": {"micro_batch_size": 32}, "need": "lots"}}
    else:
        document["answers"] = answers
    state.write_text(json.dumps(document))
    again, restarted = job(state, tmp_path / "again.jsonl")
    assert [r.ooms for r in again] == [0, 0, 0] and again[0].plan == first[0].plan and restarted.fake_calls == 0
    restarted.guard.plan = Plan()  # (the plans forgotten: the next call's OOM jumps, with no answer to take)
    with SimulatedGPU(BUDGET) as gpu:
        gpu.adopt(restarted.guard.model)
        assert restarted.guard(tuple_batch(n=SAMPLES)).ooms == 1
    assert restarted.fake_calls > 0, "planned: no readable answer was recorded"
    assert set(json.loads(state.read_text())["answers"]) == {key}, "rewritten with the answer it has"


def test_the_answers_in_the_state_file_are_bounded_per_model_and_device(tmp_path: Path) -> None:
    state = tmp_path / "plans.json"
    store = PlanStore(state, "fingerprint", "device")
    answer = {"plan": None, "need": 0, "ceiling": 10, "host_need": 0, "host_ceiling": None, "fake_steps": 1}
    store.answers = {f"fingerprint|device|{n}": answer for n in range(PER_MODEL + 10)}
    store.save({8: Plan(micro_batch_size=2)})
    saved = json.loads(state.read_text())
    assert len(saved["answers"]) == PER_MODEL and len(saved["plans"]) == 1
    reader = PlanStore(state, "fingerprint", "device")
    assert reader.load() == {8: Plan(micro_batch_size=2)} and len(reader.answers) == PER_MODEL


# -- issue 45, finding 7: recorded answers are filtered as remembered plans are ------------------------------

DEFAULT_LADDER = ["chunked_loss", "micro_batch", "amp", "checkpointing", "activation_offload", "optimizer_offload",
                  "layer_offload"]  # fmt: skip


def recorded_answer_only(state: Path, **fields: Any) -> None:
    """Keep only the answers in ``state`` (its plans dropped: the restart's bucket has no plan and jumps), each
    answer's plan changed by ``fields`` (a hand edit)."""
    document = json.loads(state.read_text())
    document["plans"] = {}
    for entry in document["answers"].values():
        entry["plan"].update(fields)
    state.write_text(json.dumps(document))


#: A job's answer that another job sharing its state file cannot take: how the second job differs, how the
#: answer was edited, the optimizer both run, and what the warning names.
UNREACHABLE_ANSWERS: dict[str, tuple[dict[str, Any], dict[str, Any], type[torch.optim.Optimizer], str]] = {
    "micro-batches below the ladder's smallest": (
        {"ladder": [MicroBatch(min_size=64) if name == "micro_batch" else name for name in DEFAULT_LADDER]},
        {},
        torch.optim.SGD,
        "micro_batch",
    ),
    "8-bit moments on a ladder without them": (
        {},
        {"quantized_optimizer": True},
        torch.optim.AdamW,
        "quantized_optimizer",
    ),
    "more layers offloaded than the model has": ({}, {"offload_layers": 99}, torch.optim.SGD, "layer_offload"),
}


@pytest.mark.parametrize("case", list(UNREACHABLE_ANSWERS))
def test_a_recorded_answer_this_job_could_not_reach_is_ignored_with_one_warning_and_planned_again(
    case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 45, finding 7: the answers were taken as they were: a job whose micro-batches stop at 64 samples ran
    another job's micro-batches of 32, an edited answer engaged 8-bit moments on a job that never opted in, and
    one naming 99 offloaded layers raised GuardConfigError in the call. A plan remembered under the same key was
    already refused for the same reasons (Ladder.beyond): the answers now are too, and the batch is planned again."""
    options, edit, optimizer_class, named = UNREACHABLE_ANSWERS[case]
    state = tmp_path / "plans.json"
    first, _ = job(state, tmp_path / "first.jsonl", optimizer_class=optimizer_class)
    size = first[0].plan.micro_batch_size
    assert first[0].ooms == 1 and size is not None and size < 64, "the first job's answer: micro-batches below 64"
    recorded_answer_only(state, **edit)
    caplog.set_level(logging.WARNING, logger="oomguard")
    caplog.clear()
    again, restarted = job(state, tmp_path / "again.jsonl", optimizer_class=optimizer_class, **options)
    (jump,) = events(tmp_path / "again.jsonl", "fallback")
    assert restarted.fake_calls > 0 and jump["fake_steps"] > 0, "planned again, not the recorded answer"
    floor = 64 if "ladder" in options else 1
    plans = [result.plan for result in again]
    assert all(plan.effective_micro_batch_size(SAMPLES) >= floor for plan in plans), plans
    assert not any(plan.quantized_optimizer or plan.offload_layers for plan in plans), plans
    assert restarted.guard.steps == 3
    (warning,) = [r.getMessage() for r in caplog.records if str(state) in r.getMessage()]
    assert "1 recorded answer" in warning and named in warning and "planned again" in warning, warning


# -- issue 45, finding 14: two jobs of one model share a state file ---------------------------------------


def test_two_guards_of_one_model_saving_alternately_keep_each_others_plans(tmp_path: Path) -> None:
    """Two jobs of one model on one device (one key), each on batches of its own shapes, calling in turn: each
    save replaced the model's entries with the saver's view, so the state file lost the plans the other job saved
    since this one loaded it (a restart then ran out of memory, or planned, again). Now a restart takes every
    plan, and the answer the first job's jump recorded."""
    state, shapes = tmp_path / "plans.json", {"one": (SAMPLES, SAMPLES // 2), "two": (2 * SAMPLES, SAMPLES // 4)}
    guards = {}
    for name in shapes:
        model = make_mlp(width=WIDTH)
        guards[name] = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters()),
                                tune_after=None, state_file=state, log_file=tmp_path / f"{name}.jsonl")  # fmt: skip
    plans: dict[int, Plan] = {}
    for turn in range(2):  # one, two, one, two: each saves after the other did
        for name, guard in guards.items():
            batch = tuple_batch(n=shapes[name][turn])
            with SimulatedGPU(BUDGET) as gpu:
                gpu.adopt(guard.model)
                plans[guard.options.bucket(batch)] = guard(batch).plan
    (jump,) = events(tmp_path / "one.jsonl", "fallback")  # (the others start on the peak model's sizes: no OOM)
    document = json.loads(state.read_text())
    assert len(plans) == 4 and len(document["plans"]) == 4 and len(document["answers"]) == 1 and jump["fake_steps"]
    model = make_mlp(width=WIDTH)
    step = counting(mse_step(model))
    restarted = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters()), state_file=state)
    with SimulatedGPU(BUDGET) as gpu:
        gpu.adopt(model)
        batches = [tuple_batch(n=n) for both in shapes.values() for n in both]
        results = {restarted.options.bucket(batch): restarted(batch) for batch in batches}
    assert {bucket: r.plan for bucket, r in results.items()} == plans, "every plan remembered"
    assert all(r.ooms == 0 for r in results.values()) and step.fake_calls == 0


# -- issue 45, finding 13: the answers of mapping batches torch's pytree takes for leaves ---------------------


@pytest.mark.parametrize("kind", MAPPING_LEAVES)
def test_a_mapping_batch_torch_pytree_takes_for_a_leaf_is_recorded_by_its_shapes(kind: str) -> None:
    """Issue 45, finding 13: a ``BatchEncoding`` or a ``UserDict`` was one leaf to the signature, so batches of 8 x 64
    and 8 x 2048 tokens shared one recorded answer (the long batch took the short one's plan). Its keys and its
    tensors' shapes and dtypes are in the signature now, as a dict's are; its values are not."""
    short, long = (as_mapping_leaf(kind, lm_batch(8, length)) for length in (64, 2048))
    assert batch_signature(short) != batch_signature(long)
    same_shape = as_mapping_leaf(kind, {key: torch.ones_like(value) for key, value in lm_batch(8, 64).items()})
    assert batch_signature(same_shape) == batch_signature(short), "values are not part of it"
    assert batch_signature(as_mapping_leaf(kind, {**lm_batch(8, 64), "mask": None})) != batch_signature(short)
    narrower = as_mapping_leaf(kind, {key: value.to(torch.int32) for key, value in lm_batch(8, 64).items()})
    assert batch_signature(narrower) != batch_signature(short), "dtypes are"
