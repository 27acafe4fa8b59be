"""Settling in a few OOMs: after the first OOM of a batch bucket the guard jumps to the plan the dry-run planner
predicts fits, instead of walking the ladder attempt by attempt. Tried on client code the project did not write:
a GPT-2 with two parameter groups and a warmup schedule, a PEFT LoRA Llama, a nanoGPT-style GPT with tied weights,
each under a quarter of its plain step's peak."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.scenarios import SCENARIOS, STEPS, nanogpt, scenario_batches
from torch.overrides import TorchFunctionMode

from oomguard import oom_guard
from oomguard._ladder.ladder import resolve_ladder
from oomguard.testing import SimulatedGPU

transformers = pytest.importorskip("transformers")


def _train(model: torch.nn.Module, forward: Any, make: Any, budget: int | None, **options: Any) -> list[Any]:
    optimizer, scheduler = make(model)
    step = oom_guard(forward(model), model=model, optimizer=optimizer, scheduler=scheduler, **options)
    with SimulatedGPU(budget or "4GiB") as gpu:
        gpu.adopt(model)
        results = [step(batch) for batch in scenario_batches()]
        peak = gpu.max_memory_allocated()
    step.guard.close()
    return [results, peak, step.guard]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_deep_scenario_settles_in_at_most_three_ooms_on_its_first_step(name: str, tmp_path: Path) -> None:
    model, forward, make = SCENARIOS[name]()
    plain = copy.deepcopy(model)
    _, peak, _ = _train(plain, forward, make, None, ladder=[])  # the plain step's peak, unguarded in effect
    budget = peak // 4
    results, _, guard = _train(model, forward, make, budget, log_file=tmp_path / "log.jsonl")
    first, *rest = results
    assert 1 <= first.ooms <= 3, f"{name}: {first.ooms} OOMs on the first step under {budget} bytes"
    assert all(r.ooms == 0 for r in rest), "none after"
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    jumps = [e for e in events if e["event"] == "fallback" and e.get("engaged")]
    assert jumps and len(jumps[0]["engaged"]) >= 1 and jumps[0]["rung"] == jumps[0]["engaged"][-1]
    assert "dry-run planner" in jumps[0]["description"]
    # Weights equal those of a job run on the settled plan from the start (the rungs' own maths, no OOM).
    reference, _, _ = SCENARIOS[name]()
    settled = first.plan
    optimizer, scheduler = make(reference)
    check = oom_guard(forward(reference), model=reference, optimizer=optimizer, scheduler=scheduler, ladder=[])
    check.guard.plan = settled
    with SimulatedGPU("4GiB") as gpu:
        gpu.adopt(reference)
        for batch in scenario_batches():
            check(batch)
    check.guard.close()
    amp = settled.precision is not None
    for (key, p), q in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        tolerance = {"rtol": 1e-2, "atol": 1e-3} if amp else {"rtol": 1e-4, "atol": 1e-5}
        torch.testing.assert_close(p, q, **tolerance, msg=lambda detail, key=key: f"{key}: {detail}")
    assert all(math.isfinite(r.loss) for r in results)
    assert guard.summary().ooms == first.ooms


def test_without_prediction_the_guard_walks_the_ladder_one_attempt_at_a_time() -> None:
    model, forward, make = nanogpt()
    plain = copy.deepcopy(model)
    _, peak, _ = _train(plain, forward, make, None, ladder=[])
    walked, _, _ = _train(model, forward, make, peak // 4, predictive=False)
    assert walked[0].ooms > 3, "the walk tries every rung in turn: what the jump saves"


def test_a_step_that_reads_values_for_its_logs_jumps_as_one_that_does_not(caplog: pytest.LogCaptureFixture) -> None:
    """Trainers read values in their loss for their logs (TRL's SFT, DPO, KTO and GRPO trainers: ``.item()``,
    boolean masks), which fake tensors cannot give; every one of those steps used to fall back to walking the
    ladder (TRL's SFT example: 3 OOMs; DPO 7). The planner now answers reads with placeholders and takes a
    boolean mask's every element: the same jump, the same OOMs."""
    model, forward, make = nanogpt()
    twin, plain = copy.deepcopy(model), copy.deepcopy(model)
    _, peak, _ = _train(plain, forward, make, None, ladder=[])
    logged: list[tuple[float, int]] = []

    def reading(model: torch.nn.Module) -> Callable[[Any], Any]:
        loss_of = forward(model)

        def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = loss_of(batch)
            ids = batch["input_ids"]
            logged.append((loss.item(), ids[ids > 0].numel()))  # a metric, a masked count
            return loss

        return step

    quiet, _, _ = _train(twin, forward, make, peak // 4)
    results, _, _ = _train(model, reading, make, peak // 4)
    assert "dry run of this step failed" not in caplog.text
    assert [r.ooms for r in results] == [r.ooms for r in quiet] and results[0].ooms >= 1
    assert len(logged) >= STEPS and all(math.isfinite(loss) and count > 0 for loss, count in logged)


@pytest.mark.parametrize(
    ("ladder", "measured"),
    [(None, False), (["micro_batch", "checkpointing", "activation_offload"], True)],
    ids=["default", "split-first"],
)
def test_the_jump_does_not_measure_again_the_plan_that_ran_out_of_memory(
    ladder: list[str] | None, measured: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first OOM already said the plain plan does not fit: the jump's walk starts past it, from the rung the
    guard's own walk takes in the phase it failed in (a Llama's loss in chunks), and lands on a plan that fits. Only
    where that rung splits the batch is the plain plan measured: its peak is what sizes the micro-batches."""
    from helpers.batches import lm_batch
    from helpers.models import make_llama

    from oomguard import Plan
    from oomguard._planner.bench import StepBench

    traced: list[Plan] = []
    trace = StepBench.trace
    monkeypatch.setattr(StepBench, "trace", lambda bench, plan: traced.append(plan) or trace(bench, plan))
    batches = [lm_batch(8, 64) for _ in range(3)]
    budget: int | str = "1GiB"  # (the plain step's peak, measured first; then 2/5 of it)
    for options in ({"ladder": []}, {} if ladder is None else {"ladder": ladder}):
        model = make_llama(layers=2, hidden=64)
        step = oom_guard(lambda b, model=model: model(**b), model=model,
                         optimizer=torch.optim.AdamW(model.parameters()), **options)  # fmt: skip
        traced.clear()
        with SimulatedGPU(budget) as gpu:
            gpu.adopt(model)
            results = [step(batch) for batch in batches]
            budget = gpu.max_memory_allocated() * 2 // 5
        step.guard.close()
    jumped = [e.to_dict() for e in step.guard.events if getattr(e, "fake_steps", None)]
    assert results[0].ooms == 1 and all(r.ooms == 0 for r in results[1:]), "one OOM, then the jump's plan fits"
    assert jumped and jumped[0]["event"] == "fallback" and "dry-run planner" in jumped[0]["description"]
    assert traced and (Plan() in traced) is measured


class _BatchSlices(TorchFunctionMode):
    """Counts the slices taken of the batch's own tensors (those of ``rows`` samples) while ``counting``."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows, self.counting, self.slices = rows, False, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counting and func is torch.Tensor.__getitem__ and args[0].dim() and args[0].shape[0] == self.rows:
            self.slices += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [10, 100_000])
def test_the_jump_on_a_batch_of_many_rows_slices_only_the_samples_it_runs(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dry run's warm-up runs one sample and each fake step two micro-batches: it used to split the whole
    batch to take its first part, a fake slice per row (100,000 rows: 106 s and 1.6 GB on the first call; a
    million past 10 minutes and 7 GB). Now each fake step slices each of the batch's tensors once at most."""
    from helpers.models import make_mlp
    from helpers.steps import mse_step

    from oomguard._guard.foresight import Foresight

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        return torch.randn(rows, 16), torch.randn(rows)

    counter = _BatchSlices(rows)
    planned = Foresight.planned

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.counting = True
        try:
            return planned(*args, **kwargs)
        finally:
            counter.counting = False

    monkeypatch.setattr(Foresight, "planned", counted)
    budget: int | str = "4GiB"  # (the plain step's peak, measured first; then 9/10 of it)
    for ladder in ([], None):
        model = make_mlp()
        step = oom_guard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                         **({} if ladder is None else {"ladder": ladder}))  # fmt: skip
        with SimulatedGPU(budget) as gpu, counter:
            gpu.adopt(model)
            result = step(batch())
            budget = gpu.max_memory_allocated() * 9 // 10
        step.guard.close()
    jumped = [e.to_dict() for e in step.guard.events if getattr(e, "fake_steps", None)]
    assert result.ooms >= 1 and jumped, "the first OOM ran the jump's dry run"
    fake_steps = jumped[0]["fake_steps"]
    assert 0 < counter.slices <= 2 * fake_steps, f"{counter.slices} slices of the 2 batch tensors in {fake_steps} steps"


def test_an_oom_whose_rounded_figures_read_equal_still_jumps() -> None:
    """The jump is for a shortage, not fragmentation: it compares what the message says was asked for with what it
    says was free. Rounded as messages write them, the two read equal where the request passed what was free by a
    little ("Tried to allocate 1.0 MiB ... of which 1024.0 KiB is free"): the jump was skipped (0 fake steps) where
    the allocation had failed, so the request was the larger."""
    from helpers.models import make_mlp
    from helpers.steps import mse_step

    from oomguard._backends.units import available_bytes, requested_bytes

    torch.manual_seed(1)
    batch = (torch.randn(4096, 16), torch.randn(4096))
    budget: int | str = "4GiB"  # (the plain step's peak, measured first; then a byte short of it)
    for options in ({"ladder": []}, {}):
        model = make_mlp()
        step = oom_guard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), **options)
        with SimulatedGPU(budget) as gpu:
            gpu.adopt(model)
            result = step(batch)
            budget = gpu.max_memory_allocated() - 1
        step.guard.close()
    events = [e.to_dict() for e in step.guard.events]
    message = next(e["error"]["message"] for e in events if e["event"] == "oom")
    assert requested_bytes(message) == available_bytes(message), f"the figures read equal: {message}"
    fallback = next(e for e in events if e["event"] == "fallback")
    assert fallback["fake_steps"] > 0 and "dry-run planner" in fallback["description"], fallback["description"]
    assert result.ooms == 1


@pytest.mark.parametrize(
    ("message", "short"),
    [
        ("Tried to allocate 4.0 MiB. GPU 0 ... of which 4.0 MiB is free.", True),
        ("Tried to allocate 1.00 GiB. GPU 0 ... of which 1024.00 MiB is free.", True),
        ("Tried to allocate 2.00 MiB. GPU 0 ... of which 1.99 MiB is free.", True),
        ("Tried to allocate 512 B. GPU 0 ... of which 512 B is free.", True),
        ("Tried to allocate 2.00 MiB. GPU 0 ... of which 3.00 MiB is free.", False),  # fragmentation
        ("Tried to allocate 4.0 MiB. GPU 0 ... of which 4.2 MiB is free.", False),
        ("Tried to allocate 511 B. GPU 0 ... of which 512 B is free.", False),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", True),  # (nothing said of what was free)
    ],
)
def test_memory_was_short_unless_the_figures_say_the_request_was_below_what_was_free(message: str, short: bool) -> None:
    from oomguard._planner.fakes import memory_was_short

    assert memory_was_short(message, torch.device("cpu")) is short


#: The default ladder without mixed precision (a job that must keep fp32): the deep budgets' case.
WITHOUT_AMP = [rung for rung in resolve_ladder(None).names if rung != "amp"]


def test_the_jump_finds_a_plan_wherever_a_ladder_of_fewer_rungs_or_the_guards_own_walk_does() -> None:
    """The planner's walk measured the whole batch with its activations checkpointed and offloaded before splitting
    it (a small model's candidate), and when the walk came back to that plan rung by rung (after micro-batches of
    one with full checkpointing ran out in backward) it stopped there: "no plan on the ladder fits", and the guard
    walked the ladder rung by rung (nanoGPT at 35 % of its plain step's peak: 7 OOMs over 3 steps). The same rungs
    with micro_batch last, or the guard's own walk, found a plan that fits. Now the jump does, from the first OOM."""
    model, forward, make = nanogpt()
    plain, walked, fewer = (copy.deepcopy(model) for _ in range(3))
    _, peak, _ = _train(plain, forward, make, None, ladder=[])
    budget = peak * 35 // 100
    walk, _, walker = _train(walked, forward, make, budget, ladder=WITHOUT_AMP, predictive=False)
    assert len(walk) == STEPS and walker.summary().ooms > 3, "the guard's own walk finds plans that fit, rung by rung"
    for job, ladder in ((fewer, ["checkpointing", "activation_offload", "micro_batch"]), (model, WITHOUT_AMP)):
        results, _, guard = _train(job, forward, make, budget, ladder=ladder)
        jumped = next(e.to_dict() for e in guard.events if getattr(e, "fake_steps", None))
        assert "dry-run planner" in jumped["description"], f"{ladder}: the jump planned ({jumped['description']})"
        assert [r.ooms for r in results] == [1] + [0] * (STEPS - 1), f"{ladder}: {[r.ooms for r in results]}"
