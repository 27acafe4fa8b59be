"""Unattended jobs on a simulated GPU: restarts, rare long batches, stepping back up, a corrupt or half-written
state file, predictive sizing, telemetry that degrades quietly, and the bounds on recovery."""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.models import make_llama, make_mlp
from helpers.steps import mse_step

from oomguard import OOMGuard, Plan, RecoveryLimitExceeded, StepResult
from oomguard._backends.telemetry import fragmentation, nvml_snapshot
from oomguard._guard.persist import PlanStore, model_fingerprint
from oomguard._ladder.ladder import resolve_ladder
from oomguard._planner.fakes import preplan
from oomguard._step.batch import batch_bucket
from oomguard.testing import SimulatedGPU

# An MLP (16 -> 256 -> 1) with AdamW on batches of 64 samples. Measured on the simulator: once Adam's state
# exists, a whole batch peaks at ~257 KiB and micro-batches of 32 at ~179 KiB.
WIDTH, N = 256, 64
TIGHT = "160KiB"  # the whole batch does not fit; the guard settles on micro-batches
ROOMY = "1MiB"  # everything fits


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def mlp_guard(model: torch.nn.Module | None = None, **options: Any) -> OOMGuard:
    model = model if model is not None else make_mlp(width=WIDTH)
    return OOMGuard(mse_step(model), model=model, optimizer=adamw(model), **options)


def run_mlp(guard: OOMGuard, capacity: str, seeds: range) -> list[StepResult]:
    with SimulatedGPU(capacity) as gpu:
        gpu.adopt(guard.model)
        return [guard(tuple_batch(n=N, seed=seed)) for seed in seeds]


def warnings_about(caplog: pytest.LogCaptureFixture, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]


def all_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def state_prefix(model: torch.nn.Module, capacity: str) -> str:
    return f"{model_fingerprint(model)}|{SimulatedGPU(capacity).identity()}|"


def lm_batch(length: int, seed: int, n: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


# -- 1. restart with zero OOMs ------------------------------------------------------------------------------


def test_restart_with_the_same_state_file_needs_no_oom(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="oomguard")
    state = tmp_path / "plans.json"
    first = mlp_guard(state_file=state)
    before = run_mlp(first, TIGHT, range(4))
    assert sum(r.ooms for r in before) >= 1, "the scenario must make the first run run out of memory"
    settled = first.plans
    assert len(settled) == 1
    assert all(plan.micro_batch_size is not None and plan.micro_batch_size < N for plan in settled.values())
    assert before[-1].rungs == ("micro_batch",)

    # A restart: a fresh process would build the same architecture (other weights: the fingerprint ignores
    # values) and a fresh optimizer, on the same device size, with the same state file.
    caplog.clear()
    second = mlp_guard(make_mlp(seed=1, width=WIDTH), state_file=state)
    after = run_mlp(second, TIGHT, range(4))
    assert [r.ooms for r in after] == [0, 0, 0, 0]
    assert not [e for e in second.events if e.kind in ("oom", "fallback")]
    assert second.plans == settled
    assert [r.plan for r in after] == [before[-1].plan] * 4
    assert all_warnings(caplog) == [], "a good state file and no OOM: nothing to warn about"


@pytest.mark.parametrize(
    ("model_width", "capacity"),
    [(32, TIGHT), (WIDTH, ROOMY)],
    ids=["other-architecture", "other-capacity"],
)
def test_a_plan_is_not_reused_for_another_model_or_device(
    model_width: int, capacity: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "plans.json"
    saved = mlp_guard(state_file=state)
    run_mlp(saved, TIGHT, range(4))
    assert set(saved.plans.values()) != {Plan()}, "the saved plan must be a degraded one"
    saved_entries = json.loads(state.read_text())["plans"]

    caplog.clear()
    caplog.set_level(logging.WARNING, logger="oomguard")
    other_model = make_mlp(width=model_width)
    assert (model_fingerprint(other_model) == model_fingerprint(saved.model)) == (model_width == WIDTH)
    other = mlp_guard(other_model, state_file=state)
    results = run_mlp(other, capacity, range(3))  # both fit whole here, so a reused plan would show
    assert [(r.rungs, r.micro_batch_size, r.ooms) for r in results] == [((), N, 0)] * 3
    assert set(other.plans.values()) == {Plan()}
    assert len(all_warnings(caplog)) == 1
    assert len(warnings_about(caplog, state)) == 1
    assert "holds no plan for this model and device" in warnings_about(caplog, state)[0]
    entries = json.loads(state.read_text())["plans"]
    assert {key: entries[key] for key in saved_entries} == saved_entries, "the first model's plan stays, untouched"
    others = {key: entry["plan"] for key, entry in entries.items() if key not in saved_entries}
    assert set(others) <= {state_prefix(other_model, capacity) + str(bucket) for bucket in other.plans}
    assert all(plan == Plan().to_dict() for plan in others.values())


# -- 2. a rare long batch escalates only its own bucket ------------------------------------------------------


def test_a_rare_long_batch_escalates_only_its_own_bucket() -> None:
    model = make_llama(layers=2, hidden=32)
    # Halving (not prediction) so that the long batch really runs out of memory and falls back.
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=adamw(model), predictive=False)
    short, long = 16, 64  # same batch size (8), 4x the sequence length
    lengths = [short, short, short, long, short, short, short]
    # Measured: 8 x 16 tokens peak at ~1.0 MB, 8 x 64 at ~3.1 MB whole and ~1.1 MB in micro-batches of 2.
    with SimulatedGPU("1.5MiB") as gpu:
        gpu.adopt(model)
        results = [guard(lm_batch(length, seed)) for seed, length in enumerate(lengths)]
    long_result = results[3]
    assert long_result.ooms >= 1
    assert long_result.rungs == ("chunked_loss", "micro_batch")  # (the walk's first rung, then micro-batches)
    assert long_result.micro_batch_size < 8
    for result in results[:3] + results[4:]:
        assert (result.rungs, result.micro_batch_size, result.ooms) == ((), 8, 0)
    short_bucket, long_bucket = batch_bucket(lm_batch(short, 0)), batch_bucket(lm_batch(long, 0))
    assert short_bucket != long_bucket
    assert guard.plans == {short_bucket: Plan(), long_bucket: long_result.plan}
    assert long_result.plan != Plan()


# -- 3. stepping back up, and backing off ---------------------------------------------------------------------

HOG_CAPACITY = "320KiB"  # whole batches fit (~257 KiB peak) ...
HOG_FLOATS = 25_600  # ... until a 100 KiB hog appears; micro-batches of 32 (~179 KiB) still fit with it
RELAX_AFTER = 3


def hog_guard(gpu: SimulatedGPU) -> OOMGuard:
    # Halving, so the degraded plan is one rung down and one relaxation is exactly the whole batch; no tuning,
    # so the degraded plan stays what it is until a relaxation.
    guard = mlp_guard(relax_after=RELAX_AFTER, predictive=False, tune_after=None)
    gpu.adopt(guard.model)
    return guard


def checked_call(gpu: SimulatedGPU, guard: OOMGuard, seed: int) -> StepResult:
    """One guarded call that must train on every sample exactly once and step the optimizer exactly once."""
    batch = tuple_batch(n=N, seed=seed)
    with torch.no_grad():  # outside the simulator: the reference costs no simulated memory
        expected = mse_step(guard.model)(batch).item()
    steps = guard.steps
    with gpu:
        result = guard(batch)
    assert math.isfinite(result.loss)
    assert result.loss == pytest.approx(expected, rel=1e-5), "the loss of the whole batch, every sample once"
    assert result.micro_batch_size * result.micro_batches >= N
    assert (result.step, guard.steps) == (steps, steps + 1)
    adam_steps = {float(state["step"]) for state in guard.optimizer.state.values()}
    assert adam_steps == {float(guard.steps)}, "exactly one optimizer step per call"
    return result


def relax_events(guard: OOMGuard) -> list[Any]:
    return [event for event in guard.events if event.kind == "relax"]


def test_the_plan_steps_back_up_once_the_memory_is_free() -> None:
    gpu = SimulatedGPU(HOG_CAPACITY)
    guard = hog_guard(gpu)
    for seed in range(2):
        assert checked_call(gpu, guard, seed).rungs == ()
    with gpu:
        hog = torch.empty(HOG_FLOATS)
    degraded = checked_call(gpu, guard, 2)
    assert degraded.ooms >= 1
    assert degraded.rungs == ("micro_batch",)
    assert degraded.micro_batch_size == N // 2
    with_hog = gpu.memory_allocated()
    del hog
    assert gpu.memory_allocated() == with_hog - HOG_FLOATS * 4

    for seed in range(3, 3 + RELAX_AFTER):  # clean steps on the degraded plan: no try yet
        result = checked_call(gpu, guard, seed)
        assert (result.plan, result.ooms) == (degraded.plan, 0)
    assert relax_events(guard) == []

    relaxed = checked_call(gpu, guard, 3 + RELAX_AFTER)
    assert (relaxed.rungs, relaxed.micro_batch_size, relaxed.ooms) == ((), N, 0)
    (event,) = relax_events(guard)
    assert event.outcome == "held"
    assert event.step == relaxed.step
    assert event.rung == "micro_batch"
    assert event.previous_plan == degraded.plan.to_dict()
    assert event.plan == Plan().to_dict()
    assert guard.plans == {batch_bucket(tuple_batch(n=N)): Plan()}
    assert guard.summary().relaxations == (1, 0)
    for seed in range(10, 13):
        assert checked_call(gpu, guard, seed).rungs == ()


def test_a_failed_try_falls_back_in_the_same_call_and_the_next_try_waits_twice_as_long() -> None:
    gpu = SimulatedGPU(HOG_CAPACITY)
    guard = hog_guard(gpu)
    for seed in range(2):
        checked_call(gpu, guard, seed)
    with gpu:
        hog = torch.empty(HOG_FLOATS)  # never freed: every try at the whole batch runs out of memory
    degraded = checked_call(gpu, guard, 2)
    assert degraded.plan == Plan(micro_batch_size=N // 2)

    # The first try comes after RELAX_AFTER clean steps. After a failed try, the next comes after next_try_after
    # more clean steps, that wait doubling each time (the failed try's own call is not a clean step).
    first_try = degraded.step + RELAX_AFTER + 1
    expected_tries = [first_try, first_try + 2 * RELAX_AFTER + 1, first_try + 6 * RELAX_AFTER + 2]
    last = expected_tries[-1] + 2
    results = [checked_call(gpu, guard, seed) for seed in range(3, last + 1)]
    tries = [r.step for r in results if r.ooms]
    assert tries == expected_tries
    events = relax_events(guard)
    assert [e.step for e in events] == expected_tries
    assert [e.outcome for e in events] == ["failed"] * 3
    assert [e.next_try_after for e in events] == [2 * RELAX_AFTER, 4 * RELAX_AFTER, 8 * RELAX_AFTER]
    assert all(e.plan == Plan().to_dict() and e.previous_plan == degraded.plan.to_dict() for e in events)
    for result in results:  # every call, the failed tries included, ends on the plan that fits
        assert result.plan == degraded.plan
        assert result.ooms == (1 if result.step in expected_tries else 0)
    assert not [e for e in guard.events if e.kind == "fallback" and e.step > degraded.step]
    assert guard.summary().relaxations == (0, 3)
    assert guard.plans == {batch_bucket(tuple_batch(n=N)): degraded.plan}
    assert hog.numel() == HOG_FLOATS  # still held


def test_the_ladders_step_back_up_never_runs_more_micro_batches_or_any_rung_deeper() -> None:
    """Issue 45, finding 12: giving a rung back went to micro-batches of 1 (as the ladder had it before the rung
    engaged), from the whole batch with checkpointing: a step "up" that runs slower, grown back in the next period,
    then the next rung given back at micro-batches of 1 again. Each step up is now lighter in every rung."""
    ladder, size = resolve_ladder(None), 16
    deep = Plan(micro_batch_size=4, precision="bf16", checkpointing="full", activation_offload=True)
    plan: Plan | None = deep.with_level("chunked_loss", 1)
    chain = []
    while plan is not None:
        chain.append(plan)
        relaxed = ladder.relax(plan, size)
        plan = None if relaxed is None else relaxed[1]
    assert chain[-1] == Plan() and len(chain) == 8, [p.describe(size) for p in chain]
    for before, after in itertools.pairwise(chain):  # (a level is larger the deeper; the micro-batch's, negated)
        pairs = zip(ladder.levels(after, size), ladder.levels(before, size), strict=True)
        assert all(up <= down for up, down in pairs), f"{before.describe(size)} -> {after.describe(size)}"


# A tiny Llama whose first call runs out of memory beside another tenant's memory, so that the planner's jump
# settles it deep (micro-batches, checkpointing, activations offloaded); after FREED calls the tenant frees its
# memory, and the device is 1.3x the plain step's peak (issue 45, finding 12).
FREED, STEP_UP_AFTER = 1, 5


def peak_of_plain_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    model = copy.deepcopy(model)
    optimizer = adamw(model)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for _ in range(2):  # the second step has Adam's state resident
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return gpu.max_memory_allocated()


def test_stepping_back_up_after_another_tenant_frees_its_memory_is_planned_and_only_ever_faster() -> None:
    """Issue 45, finding 12: after the memory freed, the guard went from the whole batch with checkpointing and
    activations offloaded to micro-batches of 1 and back, a rung each two periods, and after 35 calls still ran
    micro-batches. Now each step up goes where the planner predicts it fits and runs faster: every plan after the
    memory freed is predicted faster than the one before, and the plain plan comes within 3 periods, without an
    OOM."""
    model = make_llama(layers=2, hidden=32)
    capacity = peak_of_plain_step(model, lm_batch(32, 0, n=16)) * 13 // 10
    # (no tuning: the plans after the memory freed are the step ups' alone)
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=adamw(model), relax_after=STEP_UP_AFTER,
                     tune_after=None)  # fmt: skip
    gpu = SimulatedGPU(capacity)
    gpu.adopt(model)
    with gpu:
        tenant = torch.empty((capacity - gpu.memory_allocated()) * 7 // 10 // 4)
    bound = FREED + 3 * (STEP_UP_AFTER + 1)  # the call by which the plain plan must have come
    results: list[StepResult] = []
    while len(results) <= bound and [r.plan for r in results[-2:]] != [Plan(), Plan()]:
        if len(results) == FREED:
            del tenant
        with gpu:
            results.append(guard(lm_batch(32, len(results), n=16)))
    settled = results[0]
    assert settled.ooms == 1 and {"checkpointing", "micro_batch"} <= set(settled.rungs), settled.plan.describe(16)
    after = results[FREED:]
    assert [r.ooms for r in after] == [0] * len(after), "no step up ran out of memory"
    plans = [plan for plan, _ in itertools.groupby(r.plan for r in after)]
    assert len(set(plans)) == len(plans), "no plan left was come back to"
    with gpu:  # (the planner's time model, the one the guard's jump ranks plans by)
        batch, effects = lm_batch(32, 0, n=16), guard.effects  # (the guard's effects step aside while it plans)
        report = preplan(lambda b: model(**b), batch, guard.options, gpu, bf16=True, plans=plans, effects=effects)
    assert report is not None and [c.plan for c in report.candidates] == plans
    predicted = [c.predicted_seconds for c in report.candidates]
    described = [(p.describe(16), round(s, 6)) for p, s in zip(plans, predicted, strict=True)]
    assert all(b < a for a, b in itertools.pairwise(predicted)), f"a step up predicted slower: {described}"
    assert plans[-1] == Plan(), f"not the plain plan by call {bound}: {described}"
    steps_up = [e for e in guard.events if e.kind == "relax"]
    assert [e.outcome for e in steps_up] == ["held"] * (len(plans) - 1)  # type: ignore[attr-defined]


# -- 4. a corrupt state file is survived -----------------------------------------------------------------------


def truncated_state(tmp_path: Path) -> bytes:
    """A real state file, cut in the middle (as a non-atomic writer killed half-way would leave it)."""
    source = tmp_path / "source.json"
    PlanStore(source, "f" * 16, "SimulatedGPU:1").save({128: Plan(micro_batch_size=4), 1024: Plan(precision="bf16")})
    text = source.read_bytes()
    source.unlink()
    return text[: len(text) // 2]


def wrong_entry(tmp_path: Path) -> bytes:
    """A well-formed file whose entry for this very model and device is not a plan."""
    key = state_prefix(make_mlp(width=WIDTH), TIGHT) + str(batch_bucket(tuple_batch(n=N)))
    document = {"format": "oomguard-plans", "version": 1, "plans": {key: {"plan": {"micro_batch_size": -3}}}}
    return json.dumps(document).encode()


CORRUPT = {
    "text-garbage": lambda _: b"}{ this is not json at all",
    "empty": lambda _: b"",
    "truncated": truncated_state,
    "json-list": lambda _: b"[1, 2, 3]",
    "json-null": lambda _: b"null",
    "foreign-format": lambda _: json.dumps({"format": "something-else", "plans": {}}).encode(),
    "plans-not-a-dict": lambda _: json.dumps({"format": "oomguard-plans", "version": 1, "plans": []}).encode(),
    "future-version": lambda _: json.dumps({"format": "oomguard-plans", "version": 99, "plans": {}}).encode(),
    "binary-garbage": lambda _: bytes(range(256)) * 4,
    "entry-not-a-plan": wrong_entry,
}


@pytest.mark.parametrize("kind", list(CORRUPT))  # binary garbage and a bad entry each found a bug, since fixed
def test_a_corrupt_state_file_is_ignored_with_one_warning_and_rewritten(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "plans.json"
    state.write_bytes(CORRUPT[kind](tmp_path))
    caplog.set_level(logging.WARNING, logger="oomguard")
    guard = mlp_guard(state_file=state)
    results = run_mlp(guard, TIGHT, range(3))  # same scenario as a fresh start: OOMs, then micro-batches
    assert sum(r.ooms for r in results) >= 1
    assert results[-1].rungs == ("micro_batch",)
    about = warnings_about(caplog, state)
    assert len(about) == 1, about
    document = json.loads(state.read_text(encoding="utf-8"))
    assert (document["format"], document["version"]) == ("oomguard-plans", 1)
    prefix = state_prefix(guard.model, TIGHT)
    saved = {int(key[len(prefix) :]): Plan.from_dict(entry["plan"]) for key, entry in document["plans"].items()}
    assert saved == guard.plans
    assert all(key.startswith(prefix) for key in document["plans"])


# -- 5. a kill during a state write never leaves a broken file ------------------------------------------------

# Importing oomguard (and torch) takes ~2 s here, too slow to restart 30 times in a 15 s budget. So a zygote
# process imports it once and forks a fresh writer on request; each writer is a whole process, killed with
# SIGKILL at a random moment, exactly as a restarted subprocess would be.
_ZYGOTE = r"""
import os, sys
from oomguard._guard.persist import PlanStore
from oomguard._ladder.plan import Plan

path = sys.argv[1]
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "fork":
        break
    pid = os.fork()
    if pid == 0:  # the writer: save changing plans as fast as it can, until killed
        i = int.from_bytes(os.urandom(2), "big")
        while True:
            i += 1
            size = i % 97 + 1
            PlanStore(path, "fp", "dev").save({b: Plan(micro_batch_size=size) for b in range(5)})  # (each: all five)
    print(pid, flush=True)
    sys.stdin.readline()  # "reap": the parent has killed it
    _, status = os.waitpid(pid, 0)
    print(status, flush=True)
"""


KILLS = 40


@pytest.mark.subprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_kill_during_a_state_write_never_leaves_a_broken_file(tmp_path: Path) -> None:
    state = tmp_path / "plans.json"
    rng = random.Random(1234)
    zygote = subprocess.Popen(
        [sys.executable, "-c", _ZYGOTE, str(state)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    kills, existed, leftovers_after = 0, False, []
    try:
        assert zygote.stdout.readline().strip() == "ready"
        for _ in range(KILLS):
            zygote.stdin.write("fork\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.002, 0.04))
            os.kill(pid, signal.SIGKILL)
            zygote.stdin.write("reap\n")
            zygote.stdin.flush()
            status = int(zygote.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the writer must die mid-loop"
            kills += 1

            if state.exists():
                existed = True
                document = json.loads(state.read_text(encoding="utf-8"))  # never a broken file
                assert (document["format"], document["version"]) == ("oomguard-plans", 1)
                plans = [entry["plan"]["micro_batch_size"] for entry in document["plans"].values()]
                assert len(plans) == 5 and len(set(plans)) == 1, "one save's plans, not a mix of two"
            else:
                assert not existed, "once written, the state file must never disappear"
            temporaries = sorted(p.name for p in tmp_path.iterdir() if p != state)
            assert all(name.startswith(".plans.json.") and name.endswith(".tmp") for name in temporaries)
            new = len(temporaries) - (leftovers_after[-1] if leftovers_after else 0)
            assert new in (0, 1), "at most the one temporary being written at the instant of the kill"
            leftovers_after.append(len(temporaries))
    finally:
        zygote.kill()
        zygote.wait(timeout=10)
    assert existed, "the writers never got a save through: the kills came too early to test anything"
    # What we find: a kill between mkstemp and the rename leaves that save's temporary behind, and nothing ever
    # removes it, so orphans accumulate across crashes (one per unlucky kill; harmless to readers).
    print(f"{kills} kills; orphaned temporaries left: {leftovers_after[-1]}")


# -- 6. predictive sizing needs fewer OOMs than halving ------------------------------------------------------


def llama_stream(predictive: bool) -> list[tuple[bool, StepResult]]:
    model = make_llama(layers=2, hidden=32)
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=adamw(model), predictive=predictive)
    lengths = [16, 16, 16, 64, 16, 16, 64, 16]  # short batches, then a long one (4x the tokens per sample)
    with SimulatedGPU("1.5MiB") as gpu:
        gpu.adopt(model)
        return [(length == 16, guard(lm_batch(length, seed))) for seed, length in enumerate(lengths)]


def mlp_stream(predictive: bool) -> list[tuple[bool, StepResult]]:
    guard = mlp_guard(predictive=predictive)
    sizes = [16, 16, 640, 640, 16]  # after successful steps, a batch 40x as large
    with SimulatedGPU(TIGHT) as gpu:
        gpu.adopt(guard.model)
        return [(n == 16, guard(tuple_batch(n=n, seed=seed))) for seed, n in enumerate(sizes)]


@pytest.mark.parametrize("scenario", [llama_stream, mlp_stream], ids=["llama-short-then-4x-long", "mlp-then-40x"])
def test_predictive_sizing_needs_fewer_ooms_than_halving(scenario: Any) -> None:
    with_prediction, with_halving = scenario(True), scenario(False)
    predicted = sum(result.ooms for _, result in with_prediction)
    halved = sum(result.ooms for _, result in with_halving)
    print(f"{scenario.__name__}: OOM events with predictive sizing {predicted}, with halving {halved}")
    assert predicted < halved
    assert halved >= 2, "the scenario must make halving work for it"
    for results in (with_prediction, with_halving):
        assert all(result.rungs == () and result.ooms == 0 for small, result in results if small)
        # (the walk engages the chunked loss first, where it applies; prediction sizes micro-batches at once)
        walked = ("chunked_loss",) if results is with_halving and scenario is llama_stream else ()
        assert all(result.rungs == (*walked, "micro_batch") for small, result in results if not small)
        large = [result for small, result in results if not small]
        assert all(result.ooms == 0 for result in large[1:]), "the large batches' bucket has learnt its plan"


def test_the_peak_model_measures_an_attempt_from_where_its_plan_left_memory() -> None:
    """Layer offload moves weights and Adam state to the host as a plan is applied, at the start of the attempt:
    measured from before that, the first step on the plan looked cheaper than it is (here 7.9 MB above base
    instead of 10.2), and the peak model would have offered micro-batches that do not fit."""
    model = make_llama(layers=4, hidden=128)
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=adamw(model), ladder=["layer_offload"])
    guard.plan = Plan(offload_layers=4)
    predictor = guard._buckets.predictor
    assert predictor is not None
    excess = []
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for _ in range(2):  # the first step applies the plan, the second runs on it as it stands
            guard(lm_batch(32, 0))
            (fit,) = predictor._fits.values()
            excess.append(fit.successes[-1][1])
    assert excess[0] == excess[1], f"peak above base: {excess[0]} B applying the plan, {excess[1]} B after"


# -- 7. telemetry degrades quietly -------------------------------------------------------------------------------


def fake_pynvml(calls: list[str], fail: str | None = None) -> types.ModuleType:
    module = types.ModuleType("pynvml")

    def record(name: str, value: Any = None) -> Any:
        def call(*args: Any) -> Any:
            calls.append(name)
            if name == fail:
                raise RuntimeError(f"fake NVML failure in {name}")
            return value

        return call

    module.nvmlInit = record("init")  # type: ignore[attr-defined]
    module.nvmlShutdown = record("shutdown")  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = record("handle", object())  # type: ignore[attr-defined]
    memory = types.SimpleNamespace(total=80 << 30, used=30 << 30, free=50 << 30)
    module.nvmlDeviceGetMemoryInfo = record("memory", memory)  # type: ignore[attr-defined]
    processes = [
        types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=10 << 30),
        types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=19 << 30),
        types.SimpleNamespace(pid=os.getpid() + 2, usedGpuMemory=None),  # NVML may not know
    ]
    module.nvmlDeviceGetComputeRunningProcesses = record("processes", processes)  # type: ignore[attr-defined]
    return module


def test_nvml_snapshot_is_none_without_a_driver_or_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    assert nvml_snapshot(0) is None  # pynvml may be installed here, but there is no NVIDIA driver
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed at all: the import itself fails
    assert nvml_snapshot(0) is None


def test_nvml_snapshot_reads_device_and_process_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls))
    snap = nvml_snapshot(0)
    assert snap is not None
    assert (snap["total"], snap["used"], snap["free"]) == (80 << 30, 30 << 30, 50 << 30)
    assert snap["processes"] == [
        {"pid": os.getpid(), "used": 10 << 30},
        {"pid": os.getpid() + 1, "used": 19 << 30},
        {"pid": os.getpid() + 2, "used": None},
    ]
    assert snap["other_processes_used"] == 19 << 30, "other processes only, unknown figures as 0"
    assert calls[0] == "init" and calls[-1] == "shutdown"


@pytest.mark.parametrize("fail", ["init", "handle", "memory", "processes"])
def test_nvml_snapshot_failures_degrade_to_none_and_shut_nvml_down(fail: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls, fail=fail))
    assert nvml_snapshot(0) is None
    assert calls.count("shutdown") == (0 if fail == "init" else 1), "an initialised NVML is always shut down"


def stats(retries: int, reserved: int, allocated: int) -> dict[str, Any]:
    return {
        "num_alloc_retries": retries,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.current": allocated,
    }


def test_fragmentation_flags_climbing_retries_with_figures() -> None:
    found = fragmentation(stats(retries=7, reserved=600, allocated=550), retries_before=4, capacity=1000, requested=10)
    assert found is not None
    assert found["num_alloc_retries"] == 7
    assert found["new_retries"] == 3
    assert (found["reserved"], found["allocated"], found["reserved_not_allocated"]) == (600, 550, 50)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in found["recommendation"]


def test_fragmentation_flags_a_large_reserved_slack() -> None:
    capacity = 80 << 30
    reserved, allocated = 70 << 30, 40 << 30  # 30 GiB reserved but unused: over a quarter of the device
    found = fragmentation(stats(2, reserved, allocated), retries_before=2, capacity=capacity, requested=1 << 30)
    assert found is not None
    assert found["new_retries"] == 0
    assert found["reserved_not_allocated"] == reserved - allocated
    assert "expandable_segments:True" in found["recommendation"]


@pytest.mark.parametrize(
    ("figures", "retries_before", "capacity", "requested"),
    [
        (stats(2, 600, 550), 2, 1000, 10),  # no new retry, small slack
        (stats(2, 600, 100), 2, 1000, 600),  # the slack could not have served the request anyway
        (stats(2, 600, 100), 2, None, 10),  # capacity unknown
        (stats(2, 340, 100), 2, 1000, 10),  # slack under a quarter of the capacity
        ({}, 0, 1000, None),  # no statistics at all
    ],
)
def test_fragmentation_is_none_otherwise(
    figures: dict[str, Any], retries_before: int, capacity: int | None, requested: int | None
) -> None:
    assert fragmentation(figures, retries_before, capacity, requested) is None


# -- 8. bounds on recovery ------------------------------------------------------------------------------------


def test_the_time_bound_stops_recovery_with_a_message_naming_it() -> None:
    model = make_mlp(width=WIDTH)
    before = [p.detach().clone() for p in model.parameters()]
    attempts: list[int] = []

    def slow_when_failing(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        attempts.append(batch[0].shape[0])
        if batch[0].shape[0] >= 128:  # 128 samples' activations alone (128 KiB) exceed the budget: make it slow
            time.sleep(0.06)
        return mse_step(model)(batch)

    guard = OOMGuard(
        slow_when_failing,
        model=model,
        optimizer=adamw(model),
        predictive=False,
        ladder=["micro_batch"],
        max_recovery_seconds=0.2,
    )
    # 1024, 512, 256, 128 samples: each attempt fails after >= 0.06 s, so the 0.2 s bound comes within them.
    batch = tuple_batch(n=1024)
    with SimulatedGPU("48KiB") as gpu:
        gpu.adopt(model)
        started = time.monotonic()
        with pytest.raises(RecoveryLimitExceeded) as caught:
            guard(batch)
        elapsed = time.monotonic() - started
    message = str(caught.value)
    assert "the bound of 0.2 s of recovery was reached" in message
    assert "max_recovery_seconds=" in message
    assert 1 <= len(caught.value.tried) <= 4, "the time bound, not the ladder, ended it"
    assert len(attempts) == len(caught.value.tried), "each attempt failed in its first micro-batch"
    assert all(size >= 128 for size in attempts)
    assert elapsed < 2.0
    exhausted = [e for e in guard.events if e.kind == "exhausted"]
    assert [e.reason for e in exhausted] == ["time"]  # type: ignore[attr-defined]
    assert guard.steps == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_the_attempt_bound_stops_recovery_with_a_message_naming_it() -> None:
    guard = mlp_guard(predictive=False, ladder=["micro_batch"], max_attempts=3)
    batch = tuple_batch(n=1024)  # host memory: only the step's own tensors count against the budget
    with SimulatedGPU("48KiB") as gpu:
        gpu.adopt(guard.model)
        with pytest.raises(RecoveryLimitExceeded) as caught:
            guard(batch)
    message = str(caught.value)
    assert "the bound of 3 attempts was reached" in message
    assert "max_attempts=" in message
    assert len(caught.value.tried) == 3
