"""Tuning: once a bucket settled after an OOM, the guard times the fitting plans the planner ranks fastest on real
steps and keeps the fastest it measured, without losing, doubling or changing the maths of a single step."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import clone_model, make_llama

from oomguard import OOMGuard, Plan, TunedEvent
from oomguard._cli.main import main
from oomguard._guard import foresight as foresight_module
from oomguard._guard.buckets import Choice
from oomguard._guard.foresight import TIMED, Foresight, _Search
from oomguard._planner.search import SearchBudget, search
from oomguard._planner.speed import DeviceSpeed
from oomguard.testing import SimulatedGPU

BATCH, SEQ, STEPS = 16, 32, 15


def lm_batches(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(count):
        ids = torch.randint(1, 64, (BATCH, SEQ), generator=generator)
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def reference(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> torch.nn.Module:
    model = clone_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def peak_of_plain_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    model = clone_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for _ in range(2):  # the second step has Adam's state resident
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return gpu.max_memory_allocated()


def test_a_settled_fp32_job_runs_on_the_fastest_plan_measured_and_stays_exact(tmp_path: Path) -> None:
    """An exact (fp32) job is tuned among exact plans only: every step is one optimizer step on every sample,
    the weights equal an unguarded run's, and the plan kept is the fastest the event reports."""
    model = make_llama(layers=2, hidden=64)
    batches = lm_batches(STEPS)
    expected = reference(model, batches)
    budget = peak_of_plain_step(model, batches[0]) * 2 // 5
    log = tmp_path / "events.jsonl"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps: list[int] = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    remembered = tmp_path / "plans.json"
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=optimizer, log_file=log, tune_after=2,
                     state_file=remembered)  # fmt: skip
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        results = [guard(batch) for batch in batches]
    assert results[0].ooms >= 1 and sum(r.ooms for r in results[1:]) == 0
    assert len(steps) == STEPS and [r.step for r in results] == list(range(STEPS))
    tuned = [e for e in guard.events if isinstance(e, TunedEvent)]
    assert len(tuned) == 1, "tuned once, after the fallback"
    (event,) = tuned
    plans = [Plan.from_dict(plan) for plan, _ in event.timings]
    assert plans[0] == results[0].plan and 2 <= len(plans) <= 4, "the settled plan and up to 3 alternatives"
    assert all(plan.precision is None for plan in plans), "no mixed precision where memory did not force it"
    fastest = min(event.timings, key=lambda item: item[1] if item[1] is not None else float("inf"))
    assert Plan.from_dict(event.plan) == Plan.from_dict(fastest[0]) == results[-1].plan == guard.plan
    assert len({r.plan for r in results}) >= 2, "the alternatives ran"
    for got, want in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in logged].count("tuned") == 1
    assert main(["report", str(log)]) == 0
    restarted = OOMGuard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                         tune_after=2, state_file=remembered)  # fmt: skip
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        again = [restarted(batch) for batch in batches[:5]]
    assert {r.plan for r in again} == {guard.plan} and not any(r.ooms for r in again), "the tuned plan, remembered"
    assert not [e for e in restarted.events if isinstance(e, TunedEvent)], "and not tuned again"


def test_a_trial_that_runs_out_of_memory_is_dropped_and_its_step_retried_on_the_settled_plan() -> None:
    model = make_llama(layers=2, hidden=64)
    batches = lm_batches(STEPS)
    expected = reference(model, batches)
    budget = peak_of_plain_step(model, batches[0]) * 2 // 5
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                     tune_after=2)  # fmt: skip
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        results = []
        for batch in batches:
            tuning = guard._foresight._tuning  # (an OOM injected into the first trial's first step)
            trial = next(iter(tuning.values()), None)
            if trial is not None and trial.index == 1 and trial.calls == 0:
                gpu.fail_allocation(3)
            results.append(guard(batch))
    settled = results[0].plan
    failed = [r for r in results if r.ooms and r.step > 0]
    assert len(failed) == 1 and failed[0].plan == settled, "the trial's step was retried on the settled plan"
    (event,) = [e for e in guard.events if isinstance(e, TunedEvent)]
    assert event.timings[1][1] is None, "the trial that ran out of memory has no time"
    for got, want in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_no_tuning_without_a_fallback_or_when_turned_off() -> None:
    model = make_llama(layers=2, hidden=64)
    batches = lm_batches(8)
    budget = peak_of_plain_step(model, batches[0]) * 2 // 5
    for options, gpu_budget in (({}, 2**30), ({"tune_after": None}, budget)):
        guard = OOMGuard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                         **options)  # fmt: skip
        with SimulatedGPU(gpu_budget) as gpu:
            gpu.adopt(model)
            plans = {guard(batch).plan for batch in batches}
        assert len(plans) == 1 and not [e for e in guard.events if isinstance(e, TunedEvent)]


def test_the_fastest_median_is_kept_and_warm_up_steps_are_not_timed() -> None:
    """The bookkeeping alone, with made-up times: the settled plan is timed at once, each alternative after one
    warm-up step, and the plan with the lowest median wins."""
    settled, fast, slow = (
        Plan(micro_batch_size=1),
        Plan(micro_batch_size=4, activation_offload=True),
        Plan(checkpointing="full"),
    )
    foresight = Foresight.__new__(Foresight)
    foresight._due, foresight._tuning, foresight._steady, foresight._searches = {}, {}, {}, {}
    foresight.options = type("Options", (), {"tune_after": 1})()  # type: ignore[assignment]
    foresight.agreement = None  # (a single process)
    searched = _Search(settled, 8, DeviceSpeed())
    foresight._alternatives = lambda *args: (searched, [fast, slow])  # type: ignore[method-assign]
    foresight.settled(7)
    assert foresight.timed(Choice(7, settled), settled, True, 1.0) is None  # a clean step: due now
    times = {settled: [1.0, 1.2], fast: [9.0, 0.5, 0.6], slow: [9.0, 2.0, 2.0]}  # (9.0: warm-up steps)
    outcome = None
    for _ in range(8):
        choice = foresight.choose(Choice(7, settled), None, 8, None)  # type: ignore[arg-type]
        outcome = foresight.timed(choice, choice.plan, True, times[choice.plan].pop(0))
        if outcome is not None:
            break
    assert outcome is not None and outcome.plan == fast and outcome.settled == settled
    assert dict(outcome.timings) == pytest.approx({settled: 1.1, fast: 0.55, slow: 2.0})
    assert all(not left for left in times.values()), f"{TIMED} timed steps each, one warm-up per alternative"


def test_the_search_measures_the_largest_fitting_micro_batch_and_skips_dominated_configurations() -> None:
    """Configurations as (precision level, checkpointing level); each fits micro-batches up to a limit of its own.
    bf16 with checkpointing is not measured: bf16 alone already runs the whole batch, and checkpointing would
    only add work. fp32 with checkpointing starts its bisection above fp32's limit (it saves more memory)."""
    limits = {(0, 0): 2, (0, 1): 4, (1, 0): 8, (1, 1): 8}
    plans = {levels: Plan(checkpointing="full" if levels[1] else None, precision="bf16" if levels[0] else None)
             for levels in limits}  # fmt: skip
    by_plan = {plan: levels for levels, plan in plans.items()}
    measured: list[tuple[tuple[int, int], int]] = []

    def fits(plan: Plan) -> bool:
        levels, size = by_plan[plan.replace(micro_batch_size=None)], plan.effective_micro_batch_size(8)
        measured.append((levels, size))
        return size <= limits[levels]

    configs = sorted(plans.items(), key=lambda item: sum(item[0]))
    found = search(configs, 8, 1, fits)
    assert found == {plans[0, 0]: 2, plans[1, 0]: 8, plans[0, 1]: 4}
    assert (1, 1) not in {levels for levels, _ in measured}
    assert [size for levels, size in measured if levels == (0, 1)] == [8, 4], "sizes above 2 only"


def test_a_search_whose_lightest_configuration_fits_nothing_goes_deepest_first_and_reaches_what_fits() -> None:
    """A large model's case: three rungs, only the third's configurations fit, and only with another rung as well.
    Lightest first, 12 measurements went to configurations that cannot fit (4 of them, 3 bisections each); deepest
    first, a configuration that fits nothing rules out the lighter ones, and the same 12 find every fitting one,
    each at its largest micro-batch."""
    limits = {(1, 1, 1): 8, (0, 1, 1): 4, (1, 0, 1): 2}  # every other configuration fits no micro-batch
    plans = {levels: Plan(precision="bf16" if levels[0] else None, checkpointing="full" if levels[1] else None,
                          activation_offload=bool(levels[2]))
             for levels in itertools.product((0, 1), repeat=3)}  # fmt: skip
    by_plan = {plan: levels for levels, plan in plans.items()}
    measured: list[tuple[int, ...]] = []

    def fits(plan: Plan) -> bool:
        levels = by_plan[plan.replace(micro_batch_size=None)]
        measured.append(levels)
        return plan.effective_micro_batch_size(8) <= limits.get(levels, 0)

    configs = sorted(plans.items(), key=lambda item: sum(item[0]))
    found = search(configs, 8, 1, fits, limit=12, fixed=0)
    assert {by_plan[plan]: size for plan, size in found.items() if size is not None} == limits
    assert len(measured) == 12
    measured.clear()
    whole = search(configs, 8, 1, fits, fixed=0)
    assert whole == {plan: limits.get(levels) for levels, plan in plans.items()}, "every one answered, and right"
    assert {(1, 0, 0), (0, 1, 0)}.isdisjoint(measured), "lighter than (1, 1, 0), which fits nothing: not measured"
    assert len(measured) == 14, "lightest first measures 20"


def test_a_search_out_of_time_goes_on_where_it_stopped_and_finds_what_one_search_finds() -> None:
    """A budget of no time lets each run of the search measure one plan: run again with what it measured, it
    replays its choices from those and measures the next, and the last run's answer is the whole search's, with
    no plan measured twice."""
    limits = {(0, 0): 2, (0, 1): 4, (1, 0): 8, (1, 1): 8}
    plans = {levels: Plan(checkpointing="full" if levels[1] else None, precision="bf16" if levels[0] else None)
             for levels in limits}  # fmt: skip
    by_plan = {plan: levels for levels, plan in plans.items()}
    configs = sorted(plans.items(), key=lambda item: sum(item[0]))
    measured: list[Plan] = []

    def measure(plan: Plan) -> Any:
        measured.append(plan)
        fits = plan.effective_micro_batch_size(8) <= limits[by_plan[plan.replace(micro_batch_size=None)]]
        return type("Measured", (), {"fits": fits})()

    whole = search(configs, 8, 1, lambda plan: bool(measure(plan).fits))
    once, measured[:] = list(measured), []
    known: dict[Plan, Any] = {}
    runs = []
    while not runs or not runs[-1][1].complete:
        budget = SearchBudget(0.0, known)
        found = search(configs, 8, 1, budget.fits(measure, lambda _: None), more=budget.more)
        runs.append((found, budget))
    assert runs[-1][0] == whole
    assert measured == once, "the same plans, in the same order, each measured once"
    assert len(runs) == len(once) and all(budget.new == 1 for _, budget in runs)
    assert not any(budget.complete for _, budget in runs[:-1])


def test_a_search_starts_no_measurement_it_expects_to_end_past_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each measurement takes 0.3 s on a clock the test moves; with 1 s for the search, a third would start at
    0.6 s and end at 0.9 s, a fourth at 1.2 s: past the time, so it is not started (the call that searches takes
    its step and about the time given, not one more measurement past it)."""
    clock = [100.0]
    monkeypatch.setattr("oomguard._planner.search.time.monotonic", lambda: clock[0])

    def measure(plan: Plan) -> Any:
        clock[0] += 0.3
        return type("Measured", (), {"fits": False})()

    budget = SearchBudget(1.0)
    fits = budget.fits(measure, lambda _: None)
    started = 0
    while budget.more():
        fits(Plan(micro_batch_size=started + 1))
        started += 1
    assert started == 3 and not budget.complete


def bookkeeping(monkeypatch: pytest.MonkeyPatch) -> Foresight:
    """Tuning's bookkeeping alone: a Foresight of no guard, whose buckets tune after 1 clean step, on a device whose
    speed is the default model's (set its ``_dry_run`` for the searches)."""
    foresight = Foresight.__new__(Foresight)
    foresight._due, foresight._tuning, foresight._steady, foresight._searches = {}, {}, {}, {}
    foresight.options = type("Options", (), {"tune_after": 1})()  # type: ignore[assignment]
    foresight.agreement, foresight.device = None, torch.device("cpu")
    monkeypatch.setattr(foresight_module, "measure_speed", lambda *args: DeviceSpeed())
    return foresight


def test_a_search_over_several_calls_takes_at_most_its_share_of_the_steps_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bookkeeping alone, with made-up times: each call's search takes 1 s and is not done; the steps take
    0.1 s. The first call searches; a later one only once the steps since the search began took twice what it
    spent (SEARCH_SHARE 0.5): 20 steps between the first two searches, not a search in every call."""
    settled = Plan(micro_batch_size=1)
    foresight = bookkeeping(monkeypatch)
    searched: list[int] = []

    def dry_run(*args: Any, **planning: Any) -> Any:
        searched.append(call)
        return type("Report", (), {"complete": False, "seconds": 1.0, "fake_steps": 1, "candidates": []})()

    foresight._dry_run = dry_run  # type: ignore[method-assign]
    foresight.settled(7)
    foresight.timed(Choice(7, settled), settled, True, 0.1)  # a clean step: due now
    for call in range(45):  # noqa: B007 (dry_run reads it)
        choice = foresight.choose(Choice(7, settled), None, 8, None)  # type: ignore[arg-type]
        assert choice.plan == settled, "the search is not done: every call trains on the settled plan"
        foresight.timed(choice, choice.plan, True, 0.1)
    # (after the search at call k, with s seconds spent: the steps from the first search's call on must add up
    # to 2 s: 20 steps of 0.1 s (calls 0-19) before the second, 40 before the third)
    assert searched == [0, 20, 40]


def test_a_search_over_batches_of_other_shapes_composes_no_plan_from_two_shapes_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bucket's batches may differ in shape (it rounds the size up to a power of two): the shallow steps a search
    keeps from one call to the next are of one batch shape, and a call on a batch of another shape starts them
    afresh (a plan composed of steps of two shapes would be neither's); the plans it measured are kept."""
    settled = Plan(micro_batch_size=1)
    foresight = bookkeeping(monkeypatch)
    monkeypatch.setattr(foresight_module, "SEARCH_SHARE", float("inf"))  # (a search in every call)
    given: list[tuple[Any, Any]] = []

    def dry_run(batch: Any, backend: Any, **planning: Any) -> Any:
        given.append((planning["traces"], planning["known"]))
        planning["traces"][batch["input_ids"].shape] = "a shallow step"
        return type("Report", (), {"complete": False, "seconds": 0.1, "fake_steps": 1, "candidates": []})()

    foresight._dry_run = dry_run  # type: ignore[method-assign]
    foresight.settled(7)
    foresight.timed(Choice(7, settled), settled, True, 0.1)
    for length in (60, 60, 64, 64, 60):  # (16 x 60 and 16 x 64: one bucket)
        batch = {"input_ids": torch.zeros(16, length, dtype=torch.long)}
        foresight.choose(Choice(7, settled), batch, 16, None)  # type: ignore[arg-type]
        foresight.timed(Choice(7, settled), settled, True, 0.1)
    traces = [id(t) for t, _ in given]
    assert traces[0] == traces[1] != traces[2] == traces[3] != traces[4], "kept while the shape stays"
    assert all(len(t) == 1 for t, _ in given), "each call's steps: of its own shape alone"
    assert len({id(k) for _, k in given}) == 1, "the plans measured are the search's, whatever the shape"


@pytest.mark.slow  # (53 s, and its search's calls end on a clock: a loaded machine changes how many)
def test_tuning_whose_search_takes_several_calls_trials_the_same_plans_and_stays_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With little time for the search in a call (each call measures a few plans on fake tensors, the step itself
    runs on the settled plan), tuning takes more calls and ends where a search in one call ends: the same plans timed,
    its event says what the search cost, and every step is one optimizer step on every sample."""
    model = make_llama(layers=2, hidden=64)
    budget = peak_of_plain_step(model, lm_batches(1)[0]) * 2 // 5

    def tuned(steps: int) -> tuple[TunedEvent, torch.nn.Module, list[int]]:
        copy = clone_model(model)
        optimizer = torch.optim.AdamW(copy.parameters(), lr=1e-3)
        counted: list[int] = []
        optimizer.register_step_post_hook(lambda *_: counted.append(1))
        guard = OOMGuard(lambda b: copy(**b), model=copy, optimizer=optimizer, tune_after=2)
        batches = lm_batches(steps)  # (made before the simulated device: they are not its to hold)
        with SimulatedGPU(budget) as gpu:
            gpu.adopt(copy)
            for batch in batches:
                guard(batch)
        events = [e for e in guard.events if isinstance(e, TunedEvent)]
        assert len(events) == 1, f"tuned once in {steps} steps: {[e.describe() for e in guard.events]}"
        return events[0], copy, counted

    in_one, _, _ = tuned(STEPS)
    # 2 s a call (this search of 19 fake steps takes 10-30 s here); each call measures at least one plan, so
    # 36 steps leave room for its 19 calls at worst, the 3 trials' 9 steps and the settled plan's.
    monkeypatch.setattr(foresight_module, "MIN_SEARCH_SECONDS", 2.0)
    monkeypatch.setattr(foresight_module, "SEARCH_STEPS", 0)
    monkeypatch.setattr(foresight_module, "SEARCH_SHARE", float("inf"))  # (a search in every call: see below)
    steps = 36
    spread, trained, counted = tuned(steps)
    assert in_one.search_calls == 1 and spread.search_calls > 1
    assert [plan for plan, _ in spread.timings] == [plan for plan, _ in in_one.timings], "the same plans timed"
    assert spread.fake_steps > spread.search_calls and spread.planning_seconds > 0
    assert f"over {spread.search_calls} call(s)" in spread.describe()
    assert len(counted) == steps, "one optimizer step per call"
    expected = reference(model, lm_batches(steps))
    for got, want in zip(trained.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
