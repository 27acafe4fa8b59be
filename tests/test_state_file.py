"""The state file under hostile conditions (issue 14): a file that cannot be written, two jobs sharing one file,
files no parser survives, a log file given as the state file, a file that only grows, and non-finite losses in
the event log."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.models import VOCAB, make_llama, make_mlp
from helpers.steps import mse_step

from oomguard import GuardConfigError, MicroBatch, OOMGuard, Plan
from oomguard._backends.memory import MemorySnapshot
from oomguard._events import JsonlSink, ProgressEvent, log_event
from oomguard._guard.buckets import Buckets
from oomguard._guard.persist import PlanStore, model_fingerprint
from oomguard._ladder.ladder import resolve_ladder
from oomguard._ladder.rungs import RungContext
from oomguard._step.batch import batch_bucket
from oomguard.testing import SimulatedGPU

ROOMY = "1MiB"  # an MLP of width 64 on batches of 8 fits whole: no OOM, one plan per bucket
TIGHT = "160KiB"  # width 256 on batches of 64 does not fit whole: the guard settles on micro-batches (a change)


def warnings_about(caplog: pytest.LogCaptureFixture, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]


def save_warnings(caplog: pytest.LogCaptureFixture, path: Path) -> list[str]:
    """Warnings that saving to ``path`` failed (not those of loading it: a fresh run has no file yet)."""
    return [message for message in warnings_about(caplog, path) if "cannot save" in message]


def sgd_guard(model: torch.nn.Module, **options: Any) -> OOMGuard:
    return OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **options)


def blocked_path(tmp_path: Path) -> Path:
    """A state-file path whose folder is a regular file: every write fails with an OSError."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    return blocker / "plans.json"


def unblock(path: Path) -> None:
    """Make ``path`` (from :func:`blocked_path`) writable again: its folder becomes a folder."""
    path.parent.unlink()
    path.parent.mkdir()


def new_buckets(**kwargs: Any) -> Buckets:
    return Buckets(resolve_ladder(None), relax_after=None, predictive=False, grad_bytes=0, **kwargs)


def run_bucket(buckets: Buckets, bucket: int, plan: Plan | None = None) -> bool:
    """One call in ``bucket`` that finishes on ``plan`` (default: the chosen one), as the guard reports it; whether
    the bucket's plan changed."""
    with SimulatedGPU(ROOMY) as gpu:
        choice = buckets.choose(bucket, 8, gpu, 1.0)
    before = buckets.plans()[bucket]
    buckets.succeeded(choice, plan or choice.plan)
    return buckets.plans()[bucket] != before


# -- 1. a state file that cannot be written ---------------------------------------------------------------


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retry a failed save at the very next chance (the guard backs off for a second, doubling, in real jobs)."""
    monkeypatch.setattr("oomguard._guard.buckets._FIRST_BACKOFF", 0.0)


@pytest.mark.usefixtures("no_backoff")
def test_a_failed_save_is_one_warning_and_is_retried_until_it_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="oomguard")
    path = blocked_path(tmp_path)
    buckets = new_buckets()
    buckets.load(PlanStore(path, "f" * 16, "dev", writable=True))
    caplog.clear()
    run_bucket(buckets, 128)  # a new bucket's first plan: saved after the step, and the save fails
    run_bucket(buckets, 128, Plan(micro_batch_size=4))  # a plan change: saved, fails again
    run_bucket(buckets, 256)
    assert len(save_warnings(caplog, path)) == 1, "one warning until a save succeeds again, not one per call"
    assert save_warnings(caplog, path) == warnings_about(caplog, path)
    assert not path.parent.is_dir()

    unblock(path)
    run_bucket(buckets, 128)  # no change, but the bucket is unsaved: this call's save goes through
    saved = json.loads(path.read_text(encoding="utf-8"))["plans"]
    assert {key: Plan.from_dict(entry["plan"]) for key, entry in saved.items()} == {
        f"{'f' * 16}|dev|128": Plan(micro_batch_size=4),
        f"{'f' * 16}|dev|256": Plan(micro_batch_size=4),  # a new bucket starts on the nearest smaller one's plan
    }
    assert len(warnings_about(caplog, path)) == 1, "saving works again: nothing more to warn about"

    path.unlink()
    path.mkdir()  # broken again (a folder where the file should be): warned about once more
    run_bucket(buckets, 512)
    run_bucket(buckets, 512)
    assert len(warnings_about(caplog, path)) == 2


@pytest.mark.usefixtures("no_backoff")
def test_on_save_hears_of_the_first_failure_and_of_the_recovery_only(tmp_path: Path) -> None:
    heard: list[OSError | None] = []
    path = blocked_path(tmp_path)
    buckets = new_buckets(on_save=heard.append)
    buckets.load(PlanStore(path, "f" * 16, "dev", writable=True))
    for _ in range(3):
        assert run_bucket(buckets, 128) is False
    assert len(heard) == 1 and isinstance(heard[0], OSError)
    unblock(path)
    run_bucket(buckets, 128)
    run_bucket(buckets, 128, Plan(micro_batch_size=2))
    assert len(heard) == 2 and heard[1] is None, "one call on recovery, none for saves that simply work"
    assert "|128" in next(iter(json.loads(path.read_text(encoding="utf-8"))["plans"]))


def test_after_a_failed_save_the_next_tries_back_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: with another job stuck holding the lock, every call waited the whole lock timeout."""
    tries: list[float] = []

    def stuck(self: PlanStore, plans: Any) -> None:
        tries.append(time.monotonic())
        raise TimeoutError("another process has held the lock on the state file for over 5 s")

    monkeypatch.setattr(PlanStore, "save", stuck)
    buckets = new_buckets(on_save=lambda error: None)
    buckets.load(PlanStore(tmp_path / "plans.json", "f" * 16, "dev", writable=True))
    for size in (4, 2, 1):  # three plan changes within a second: one try, the others wait for the back-off
        run_bucket(buckets, 128, Plan(micro_batch_size=size))
    assert len(tries) == 1


def full_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    return tmp_path / "plans.json"


def read_only_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    if os.name != "posix" or os.geteuid() == 0:
        pytest.skip("permissions do not stop root (or non-POSIX systems) from writing")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)  # pytest's clean-up of tmp_path gives the permission back
    return folder / "plans.json"


UNWRITABLE = {
    "folder-is-a-file": lambda _, tmp_path: blocked_path(tmp_path),
    "disk-full": full_disk,
    "read-only-folder": read_only_folder,
}


@pytest.mark.parametrize("kind", list(UNWRITABLE))
def test_a_guarded_call_commits_and_returns_when_the_state_file_cannot_be_written(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="oomguard")
    path = UNWRITABLE[kind](monkeypatch, tmp_path)
    model = make_mlp(width=256)
    before = [p.detach().clone() for p in model.parameters()]
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), state_file=path,
                     log_every=None)  # fmt: skip
    with SimulatedGPU(TIGHT) as gpu:  # the first call runs out of memory: its plan changes, and is saved
        gpu.adopt(model)
        results = [guard(tuple_batch(n=64, seed=seed)) for seed in range(3)]
    assert guard.steps == 3
    assert results[0].ooms >= 1 and results[-1].rungs == ("micro_batch",)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "steps committed"
    assert len(save_warnings(caplog, path)) == 1, [r.getMessage() for r in caplog.records]
    assert len(warnings_about(caplog, path)) == 2, "and the one of loading: there is no state file to read"
    assert not path.exists()


# -- 2. several jobs sharing one state file ----------------------------------------------------------------

_WRITER = r"""
import sys
from oomguard._guard.persist import PlanStore
from oomguard._ladder.plan import Plan

path, name, saves = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = PlanStore(path, name, "dev")
print("ready", flush=True)
sys.stdin.readline()  # "go": every writer starts at once
for i in range(1, saves + 1):
    store.save({bucket: Plan(micro_batch_size=i) for bucket in range(4)})
print("done", flush=True)
"""

WRITERS, SAVES = 6, 60


def run_writers(script: str, path: Path) -> None:
    """``WRITERS`` processes of ``script`` (given ``path``, its name, ``SAVES``), saving all at once."""
    command = [sys.executable, "-c", script, str(path)]
    writers = [
        subprocess.Popen([*command, f"writer{k}", str(SAVES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for k in range(WRITERS)
    ]
    try:
        for writer in writers:
            assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        for writer in writers:
            assert writer.stdin is not None
            writer.stdin.write("go\n")
            writer.stdin.flush()
        for writer in writers:
            assert writer.wait(timeout=120) == 0
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()


@pytest.mark.subprocess
def test_jobs_sharing_a_state_file_keep_each_others_plans(tmp_path: Path) -> None:
    path = tmp_path / "plans.json"
    run_writers(_WRITER, path)
    entries = json.loads(path.read_text(encoding="utf-8"))["plans"]
    expected = {f"writer{k}|dev|{bucket}" for k in range(WRITERS) for bucket in range(4)}
    assert set(entries) == expected, f"lost: {sorted(expected - set(entries))}"
    assert {entry["plan"]["micro_batch_size"] for entry in entries.values()} == {SAVES}, "each writer's last save"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.json"], "nothing left beside the state file"


def an_answer(need: int) -> dict[str, Any]:
    return {"plan": Plan(micro_batch_size=need).to_dict(), "need": need, "ceiling": None, "host_need": 0,
            "host_ceiling": None, "fake_steps": 1}  # fmt: skip


def saved(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plans and the answers in the state file at ``path``, by key, without their stamps."""
    document = json.loads(path.read_text(encoding="utf-8"))
    return tuple(  # type: ignore[return-value]
        {key: {k: v for k, v in entry.items() if k != "updated"} for key, entry in document[part].items()}
        for part in ("plans", "answers")
    )


def test_two_jobs_of_one_model_saving_alternately_keep_each_others_plans_and_answers(tmp_path: Path) -> None:
    """Issue 45, finding 14: a save replaced the model's entries with the saver's own view, so each of two jobs
    of one model dropped the plans and answers the other saved since it loaded. A save now writes what this job
    changed and keeps the rest; a plan another job changed since this one read it survives this one's save, and
    a plan this one changes is written."""
    path = tmp_path / "plans.json"
    one, two = PlanStore(path, "model", "dev"), PlanStore(path, "model", "dev")
    assert one.load() == {} and two.load() == {}  # (both started before either saved)
    one.answers["model|dev|a"] = an_answer(1)
    one.save({1: Plan(micro_batch_size=1)})
    two.answers["model|dev|b"] = an_answer(2)
    two.save({2: Plan(micro_batch_size=2)})
    one.save({1: Plan(micro_batch_size=1), 3: Plan(micro_batch_size=3)})
    plans, answers = saved(path)
    assert set(plans) == {"model|dev|1", "model|dev|2", "model|dev|3"}, "the other job's bucket 2 is kept"
    assert set(answers) == {"model|dev|a", "model|dev|b"}, "and its answer"
    third = PlanStore(path, "model", "dev")  # a job that read bucket 2 as the second job saved it
    assert third.load()[2] == Plan(micro_batch_size=2)
    two.save({2: Plan(micro_batch_size=4)})  # the second job changes bucket 2 ...
    third.save({2: Plan(micro_batch_size=2), 5: Plan(micro_batch_size=5)})  # ... the third never touched it
    plans, _ = saved(path)
    assert plans["model|dev|2"]["plan"]["micro_batch_size"] == 4, "the change stays: the third job's view is older"
    assert set(plans) == {f"model|dev|{bucket}" for bucket in (1, 2, 3, 5)}
    one.answers["model|dev|b"] = an_answer(6)  # the first job plans bucket 2 anew, and records its answer
    one.save({1: Plan(micro_batch_size=1), 2: Plan(micro_batch_size=6), 3: Plan(micro_batch_size=3)})
    plans, answers = saved(path)
    assert plans["model|dev|2"]["plan"]["micro_batch_size"] == 6 and answers["model|dev|b"]["need"] == 6, "written"
    assert set(plans) == {f"model|dev|{bucket}" for bucket in (1, 2, 3, 5)} and len(answers) == 2


def test_a_plan_this_job_holds_that_the_file_lost_is_put_back_with_its_stamp(tmp_path: Path) -> None:
    """A file rewritten without this job's entries (deleted, or corrupt and rewritten by another job) gets them
    back at this job's next save, with the stamps they had: the bounds still rank them by their age."""
    path = tmp_path / "plans.json"
    store = PlanStore(path, "model", "dev")
    store.save({1: Plan(micro_batch_size=1)})
    stamp = json.loads(path.read_text(encoding="utf-8"))["plans"]["model|dev|1"]["updated"]
    path.unlink()
    PlanStore(path, "model", "dev").save({2: Plan(micro_batch_size=2)})  # another job's save, over no file
    store.save({1: Plan(micro_batch_size=1)})
    entries = json.loads(path.read_text(encoding="utf-8"))["plans"]
    assert set(entries) == {"model|dev|1", "model|dev|2"} and entries["model|dev|1"]["updated"] == stamp


_SAME_MODEL_WRITER = r"""
import sys
from oomguard._guard.persist import PlanStore
from oomguard._ladder.plan import Plan

path, name, saves = sys.argv[1], sys.argv[2], int(sys.argv[3])
writer = int(name.removeprefix("writer"))
store = PlanStore(path, "model", "dev")  # every writer: the same model and device, its own buckets
store.load()
print("ready", flush=True)
sys.stdin.readline()  # "go": every writer starts at once
for i in range(1, saves + 1):
    for b in range(4):
        store.answers[f"model|dev|{name}-{b}"] = {"plan": None, "need": 0, "ceiling": i, "host_need": 0,
                                                 "host_ceiling": None, "fake_steps": 1}
    store.save({10 * writer + b: Plan(micro_batch_size=i) for b in range(4)})
print("done", flush=True)
"""


@pytest.mark.subprocess
def test_processes_of_one_model_saving_at_once_keep_each_others_plans_and_answers(tmp_path: Path) -> None:
    """Issue 45, finding 14, as it happens: several processes of one model on one device, each with buckets of its
    own, all saving at once. Before, only the last saver's four buckets and answers were left."""
    path = tmp_path / "plans.json"
    run_writers(_SAME_MODEL_WRITER, path)
    plans, answers = saved(path)
    expected = {f"model|dev|{10 * k + bucket}" for k in range(WRITERS) for bucket in range(4)}
    assert set(plans) == expected, f"lost: {sorted(expected - set(plans))}"
    assert set(answers) == {f"model|dev|writer{k}-{bucket}" for k in range(WRITERS) for bucket in range(4)}
    assert {entry["plan"]["micro_batch_size"] for entry in plans.values()} == {SAVES}, "each writer's last save"
    assert {entry["ceiling"] for entry in answers.values()} == {SAVES}


# -- 3. files no parser survives ---------------------------------------------------------------------------

WIDTH, N = 256, 64


def our_key() -> str:
    capacity = SimulatedGPU(TIGHT).identity()
    return f"{model_fingerprint(make_mlp(width=WIDTH))}|{capacity}|{batch_bucket(tuple_batch(n=N))}"


def document(plans: Any) -> bytes:
    return json.dumps({"format": "oomguard-plans", "version": 1, "plans": plans}).encode()


HOSTILE = {
    "deep-array": lambda: b"[" * 100_000,
    "deep-in-plans": lambda: b'{"format":"oomguard-plans","version":1,"plans":{"k":' + b"[" * 100_000,
    "deep-object": lambda: b'{"a":' * 100_000,
    "plan-a-list": lambda: document({our_key(): {"plan": []}}),
    "plan-a-string": lambda: document({our_key(): {"plan": "micro_batch_size"}}),
    "plan-pairs": lambda: document({our_key(): {"plan": [["micro_batch_size", 4]]}}),
    "entry-a-number": lambda: document({our_key(): 5}),
    "entry-a-list": lambda: document({our_key(): ["plan"]}),
    "extras-not-a-mapping": lambda: document({our_key(): {"plan": {"extras": [["toy"]]}}}),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_state_file_no_parser_survives_is_ignored_with_one_warning_and_replaced(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "plans.json"
    path.write_bytes(HOSTILE[kind]())
    caplog.set_level(logging.WARNING, logger="oomguard")
    model = make_mlp(width=WIDTH)
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), state_file=path)
    with SimulatedGPU(TIGHT) as gpu:
        gpu.adopt(model)
        results = [guard(tuple_batch(n=N, seed=seed)) for seed in range(3)]
    assert results[0].ooms >= 1, "the broken file gave no plan: the first call starts whole and runs out of memory"
    assert len(warnings_about(caplog, path)) == 1, warnings_about(caplog, path)
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert (saved["format"], saved["version"]) == ("oomguard-plans", 1)
    assert {key: Plan.from_dict(entry["plan"]) for key, entry in saved["plans"].items()} == {
        our_key(): guard.plans[batch_bucket(tuple_batch(n=N))]
    }


# -- 4. the log file given as the state file ---------------------------------------------------------------


def test_the_same_file_as_log_file_and_state_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = make_mlp()
    with pytest.raises(GuardConfigError) as refused:
        sgd_guard(model, log_file="run/oomguard.json", state_file=tmp_path / "run" / ".." / "run" / "oomguard.json")
    message = str(refused.value)
    assert "log_file" in message and "state_file" in message
    assert str((tmp_path / "run" / "oomguard.json").resolve()) in message
    assert "different" in message
    sgd_guard(model, log_file="run/oomguard.jsonl", state_file="run/oomguard.json")  # distinct files are fine


# -- 5. a state file that only grows -----------------------------------------------------------------------


def foreign_document(models: int, buckets: int) -> dict[str, Any]:
    """Entries of ``models`` other models with ``buckets`` buckets each, all updated at distinct times."""
    plans = {}
    for m in range(models):
        for b in range(buckets):
            second = m * buckets + b  # later models, and later buckets, were updated later
            stamp = f"2024-01-{1 + second // 86400:02d}T{second // 3600 % 24:02d}:{second // 60 % 60:02d}:" \
                    f"{second % 60:02d}+0000"  # fmt: skip
            plans[f"model{m:04d}|GPU:80GB|{b}"] = {"plan": Plan(micro_batch_size=1 + b).to_dict(), "updated": stamp}
    return {"format": "oomguard-plans", "version": 1, "plans": plans}


def test_the_state_file_keeps_the_most_recent_entries_per_model_and_overall(tmp_path: Path) -> None:
    path = tmp_path / "plans.json"
    models, buckets = 50, 100  # 5,000 entries: 100 buckets a model (over the 64 kept), 50 models
    path.write_text(json.dumps(foreign_document(models, buckets)), encoding="utf-8")
    PlanStore(path, "ours", "dev").save({128: Plan(micro_batch_size=2)})
    entries = json.loads(path.read_text(encoding="utf-8"))["plans"]
    assert entries["ours|dev|128"]["plan"] == Plan(micro_batch_size=2).to_dict(), "the plan just saved is kept"
    assert len(entries) == 1024
    per_model: dict[str, list[int]] = {}
    for key in entries:
        model, _, bucket = key.rpartition("|")
        per_model.setdefault(model, []).append(int(bucket))
    assert max(len(kept) for kept in per_model.values()) == 64
    # Each model keeps its 64 most recently updated buckets (36 to 99); of those, the 1,023 most recently updated
    # entries stay beside the one just saved.
    recent = [(m * buckets + b, f"model{m:04d}|GPU:80GB|{b}") for m in range(models) for b in range(36, buckets)]
    assert set(entries) - {"ours|dev|128"} == {key for _, key in sorted(recent)[-1023:]}


def test_a_save_over_a_large_foreign_file_is_cheap_once_the_file_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(foreign_document(2000, 10)), encoding="utf-8")  # 20,000 entries
    store = PlanStore(path, "ours", "dev")
    store.save({128: Plan(micro_batch_size=2)})  # the first save reads everything once, and prunes
    size = path.stat().st_size
    for size_now in range(2, 6):
        store.save({128: Plan(micro_batch_size=size_now)})
    assert len(json.loads(path.read_text(encoding="utf-8"))["plans"]) == 1024
    assert path.stat().st_size <= size * 1.01, "later saves do not grow the file"


# -- 6. non-finite numbers in the event log ----------------------------------------------------------------


def strict_json(line: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"non-standard JSON constant {constant} in {line[:80]!r}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize(("factor", "flag"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_a_non_finite_loss_is_logged_as_null_with_a_flag(factor: float, flag: str, tmp_path: Path) -> None:
    log = tmp_path / "oomguard.jsonl"
    model = make_mlp()
    step = mse_step(model)
    guard = OOMGuard(lambda batch: step(batch) * factor, model=model, optimizer=torch.optim.SGD(model.parameters()),
                     log_file=log, log_every=1)  # fmt: skip
    # Only under fp16 does a non-finite loss make a committed step (its gradient scaler skips the update); on any
    # other plan the call raises NonFiniteLoss and nothing is stepped (tests/test_dry_run.py).
    guard.plan = Plan(precision="fp16")
    with SimulatedGPU(ROOMY) as gpu:
        gpu.adopt(model)
        guard(tuple_batch())
        guard(tuple_batch(seed=2))
    lines = log.read_text(encoding="utf-8").splitlines()
    events = [strict_json(line) for line in lines]
    progress = [event for event in events if event["event"] == "progress"]
    assert [event["loss"] for event in progress] == [None, None]
    assert [event["non_finite"] for event in progress] == [{"loss": flag}, {"loss": flag}]
    assert progress[0]["memory"]["capacity"] == SimulatedGPU(ROOMY).capacity


def test_non_finite_values_are_flagged_by_their_dotted_path_and_finite_events_carry_no_flag(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "log.jsonl")
    memory = MemorySnapshot(backend="simulated", allocated=1, reserved=2, peak=3, capacity=4)
    sink(ProgressEvent(0, {"micro_batch_size": None}, memory, 0.5, 8, {"micro_batch": 0}))
    sink(ProgressEvent(1, {"weights": [1.0, math.nan]}, memory, -math.inf, 8, {}))
    finite, broken = (strict_json(line) for line in (tmp_path / "log.jsonl").read_text().splitlines())
    assert "non_finite" not in finite and finite["loss"] == 0.5
    assert broken["non_finite"] == {"plan.weights.1": "nan", "loss": "-inf"}
    assert (broken["plan"]["weights"], broken["loss"]) == ([1.0, None], None)


# -- the event the guard turns on_save into ----------------------------------------------------------------


def test_the_state_file_event_is_a_warning_while_saving_fails_and_info_once_it_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from oomguard import StateFileEvent  # here, not above: the other tests run (and fail) on their own without it

    caplog.set_level(logging.INFO, logger="oomguard")
    memory = MemorySnapshot(backend="simulated", allocated=1, reserved=2, peak=3, capacity=4)
    failed = StateFileEvent(3, {}, memory, path="/x/plans.json", error="[Errno 28] No space left on device",
                            description="the plans are kept in memory")  # fmt: skip
    works = StateFileEvent(9, {}, memory, path="/x/plans.json", error=None, description="saved again")
    log_event(failed)
    log_event(works)
    assert [(r.levelno, "/x/plans.json" in r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, True),
        (logging.INFO, True),
    ]
    assert "No space left on device" in caplog.records[0].getMessage()
    assert failed.to_dict()["event"] == "state_file"
    assert failed.to_dict()["error"] == "[Errno 28] No space left on device"


def test_the_guard_says_so_in_its_event_log_once_when_the_state_file_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "plans"
    blocker.write_text("a file where the state file's folder should be")
    model = make_mlp(width=256)
    log = tmp_path / "events.jsonl"
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                     state_file=blocker / "plans.json", log_file=log, log_every=None)  # fmt: skip
    with SimulatedGPU(TIGHT) as gpu:
        gpu.adopt(model)
        for seed in range(3):
            guard(tuple_batch(n=64, seed=seed))
    events = [e for e in guard.events if e.kind == "state_file"]
    assert len(events) == 1, "once when saving starts failing, not per call"
    assert events[0].error is not None and str(blocker) in events[0].path  # type: ignore[attr-defined]
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in logged].count("state_file") == 1
    assert guard.steps == 3


# -- 7. remembered plans this job cannot run (issue 23) ----------------------------------------------------------

DEFAULT_LADDER = ["micro_batch", "amp", "checkpointing", "activation_offload", "optimizer_offload", "layer_offload"]


class SubclassedAdamW(torch.optim.AdamW):
    """An AdamW of the user's own (a subclass): its step may do anything, so its state is not kept in 8 bits."""


def lora_llama() -> torch.nn.Module:
    """A PEFT LoRA Llama (hidden 128) with adapters on the attention projections that move from the first step."""
    peft = pytest.importorskip("peft")
    model = make_llama(layers=2, hidden=128)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM",
                             lora_dropout=0.0)  # fmt: skip
    torch.manual_seed(3)
    lora: torch.nn.Module = peft.get_peft_model(model, config)
    for name, param in lora.named_parameters():
        if "lora_B" in name:  # (B starts at zero: nudged, so the adapters' update depends on the frozen weights)
            torch.nn.init.normal_(param, std=0.02)
    return lora


def lora_job(state: Path | None, ladder: list[Any] | None, plan: Plan | None = None, steps: int = 3) -> Any:
    """A LoRA job trained with AdamW for ``steps`` steps under a roomy SimulatedGPU; the model, guard, results."""
    model = lora_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer, state_file=state,
                     ladder=ladder, tune_after=None)  # fmt: skip
    if plan is not None:
        guard.plan = plan
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        results = [guard({"input_ids": ids, "labels": ids.clone()}) for _ in range(steps)]
    return model, guard, results


def test_an_exact_job_does_not_train_on_the_4bit_plan_an_opted_in_job_saved_in_its_state_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in issue 23: both jobs fine-tune the same model on the same device, so their plans share a key; the
    exact job (the default ladder) trained on the opted-in job's 4-bit frozen weights, adapters 0.044 off after
    3 steps, and said nothing."""
    state = tmp_path / "plans.json"
    lora_job(state, [*DEFAULT_LADDER, "quantized_weights"], Plan(quantized_weights="4bit"), steps=1)
    assert '"quantized_weights": "4bit"' in state.read_text(), "the opted-in job saved its plan"
    caplog.set_level(logging.WARNING, logger="oomguard")
    caplog.clear()  # (the first job's warning: it found no state file yet)
    exact, guard, results = lora_job(state, None)
    reference, _, _ = lora_job(None, None)
    assert [r.plan for r in results] == [Plan()] * 3 and guard.steps == 3
    trained = {n: p for n, p in exact.named_parameters() if p.requires_grad}
    assert all(torch.equal(trained[n], p) for n, p in reference.named_parameters() if p.requires_grad)
    (warning,) = warnings_about(caplog, state)
    assert "quantized_weights" in warning and "not on this guard's ladder" in warning, warning


def saved_by(state: Path, plan: Plan, **options: Any) -> None:
    """One step of an AdamW job on ``plan``, which saves it in ``state``."""
    model = make_mlp()
    guard = OOMGuard(mse_step(model), model=model, optimizer=adamw(model), state_file=state, **options)
    guard.plan = plan
    with SimulatedGPU(ROOMY) as gpu:
        gpu.adopt(model)
        guard(tuple_batch())


def tampered(state: Path, **fields: Any) -> None:
    """Change plan fields of every entry in ``state``, as a hand edit (or another version's writer) would."""
    document = json.loads(state.read_text(encoding="utf-8"))
    for entry in document["plans"].values():
        entry["plan"].update(fields)
    state.write_text(json.dumps(document), encoding="utf-8")


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters())


def llama_step(model: torch.nn.Module) -> Any:
    return lambda batch: model(**batch)


#: Plans a job saved that another job sharing the file cannot run: how the first saves it, the second's options,
#: and what the warning must name.
UNRUNNABLE: dict[str, tuple[Any, dict[str, Any], str]] = {
    "8-bit state loaded by an SGD job": (
        lambda state: saved_by(state, Plan(quantized_optimizer=True), ladder=[*DEFAULT_LADDER, "quantized_optimizer"]),
        {"optimizer": torch.optim.SGD, "ladder": [*DEFAULT_LADDER, "quantized_optimizer"]},
        "quantized_optimizer",
    ),
    "8-bit state loaded by a subclass of AdamW": (
        lambda state: saved_by(state, Plan(quantized_optimizer=True), ladder=[*DEFAULT_LADDER, "quantized_optimizer"]),
        {"optimizer": SubclassedAdamW, "ladder": [*DEFAULT_LADDER, "quantized_optimizer"]},
        "quantized_optimizer",
    ),
    "8-bit state loaded by a job that did not opt in": (
        lambda state: saved_by(state, Plan(quantized_optimizer=True), ladder=[*DEFAULT_LADDER, "quantized_optimizer"]),
        {"optimizer": torch.optim.AdamW, "ladder": None},
        "quantized_optimizer",
    ),
    "bf16 loaded by a job whose ladder has no amp": (
        lambda state: saved_by(state, Plan(precision="bf16")),
        {"optimizer": torch.optim.AdamW, "ladder": ["micro_batch"]},
        "amp",
    ),
    "micro-batches below the ladder's smallest": (
        lambda state: saved_by(state, Plan(micro_batch_size=1)),
        {"optimizer": torch.optim.AdamW, "ladder": [MicroBatch(min_size=4), "amp"]},
        "micro_batch",
    ),
}


@pytest.mark.parametrize("case", list(UNRUNNABLE))
def test_a_saved_plan_this_job_cannot_run_is_ignored_with_one_warning(
    case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in issue 23: such a plan was taken as it was, and either trained in silence on what this job never
    allowed, or failed every call with advice about a ladder the user never set."""
    state = tmp_path / "plans.json"
    save, options, named = UNRUNNABLE[case]
    save(state)
    caplog.set_level(logging.WARNING, logger="oomguard")
    caplog.clear()  # (the first job's warning: it found no state file yet)
    model = make_mlp()
    guard = OOMGuard(mse_step(model), model=model, optimizer=options["optimizer"](model.parameters()),
                     ladder=options["ladder"], state_file=state)  # fmt: skip
    with SimulatedGPU(ROOMY) as gpu:
        gpu.adopt(model)
        results = [guard(tuple_batch(seed=seed)) for seed in range(2)]
    assert [(r.plan, r.ooms) for r in results] == [(Plan(), 0)] * 2, "a fresh start: the batch fits whole"
    (warning,) = warnings_about(caplog, state)
    assert "ignoring 1 saved plan" in warning and named in warning, warning


def test_a_tampered_plan_offloading_more_layers_than_the_model_has_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "plans.json"
    batch = {"input_ids": torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]

    def job() -> tuple[torch.nn.Module, OOMGuard]:
        model = make_llama(layers=2)
        return model, OOMGuard(llama_step(model), model=model, optimizer=adamw(model), state_file=state)

    model, guard = job()
    guard.plan = Plan(offload_layers=2)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        guard(batch)
    tampered(state, offload_layers=5)
    caplog.set_level(logging.WARNING, logger="oomguard")
    caplog.clear()  # (the first job's warning: it found no state file yet)
    model, guard = job()
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        result = guard(batch)
    assert (result.plan, guard.steps) == (Plan(), 1)
    (warning,) = warnings_about(caplog, state)
    assert "layer_offload" in warning and "5" in warning, warning


def test_one_warning_names_every_plan_ignored_and_the_plans_this_job_can_run_are_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_mlp()
    prefix = f"{model_fingerprint(model)}|{SimulatedGPU(ROOMY).identity()}|"
    small, large = batch_bucket(tuple_batch(n=8)), batch_bucket(tuple_batch(n=16))
    state = tmp_path / "plans.json"
    state.write_bytes(document({
        f"{prefix}{small}": {"plan": Plan(micro_batch_size=4).to_dict()},
        f"{prefix}{large}": {"plan": Plan(quantized_optimizer=True).to_dict()},  # SGD: no 8-bit state
        f"{prefix}{4 * large}": {"plan": {"micro_batch_size": "four"}},
    }))  # fmt: skip
    caplog.set_level(logging.WARNING, logger="oomguard")
    guard = sgd_guard(model, state_file=state, relax_after=None)
    assert set(guard.plans) == set()
    with SimulatedGPU(ROOMY) as gpu:
        gpu.adopt(model)
        assert guard(tuple_batch(n=8)).plan == Plan(micro_batch_size=4), "the plan it can run: taken"
    assert set(guard.plans) == {small}
    (warning,) = warnings_about(caplog, state)
    assert "ignoring 2 saved plan" in warning and "quantized_optimizer" in warning and "'four'" in warning, warning


#: What this job is (its context) against plans another job could have saved: the rung each is out of reach of.
OUT_OF_REACH: dict[str, tuple[Plan, dict[str, Any], str]] = {
    "state on the host, capturable optimizer": (
        Plan(optimizer_offload=True),
        {"optimizer_offloadable": False},
        "optimizer_offload",
    ),
    "master weights, no bf16 on this device": (
        Plan(precision="bf16", optimizer_offload="master"),
        {"bf16_supported": False},
        "amp",
    ),
    "checkpointing a model the user checkpoints": (Plan(checkpointing="full"), {"checkpointed": True}, "checkpointing"),
    "partial checkpointing of one block": (Plan(checkpointing="partial"), {"num_blocks": 1}, "checkpointing"),
    "activations offloaded on a CPU-only run": (
        Plan(activation_offload=True),
        {"can_offload": False},
        "activation_offload",
    ),
    "8-bit frozen weights, none frozen": (Plan(quantized_weights=True), {"frozen_linears": False}, "quantized_weights"),
    "8-bit state beside state on the host": (
        Plan(optimizer_offload=True, quantized_optimizer=True),
        {},
        "quantized_optimizer",
    ),
}
EVERY_RUNG = [*DEFAULT_LADDER, "quantized_optimizer", "quantized_weights"]


@pytest.mark.parametrize("case", list(OUT_OF_REACH))
def test_a_plan_is_out_of_reach_where_a_rung_it_engages_cannot_go_there_in_this_context(case: str) -> None:
    """What "can run" means, rung by rung: each rung's own preconditions (its escalate), for the whole plan."""
    plan, facts, rung = OUT_OF_REACH[case]
    ladder = resolve_ladder(EVERY_RUNG)
    able = RungContext(batch_size=8, num_blocks=4, frozen_linears=True)
    if facts:  # (the last plan is out of every ladder's reach: 8-bit state ends where the state goes to the host)
        assert ladder.beyond(plan, able) == [], "where this job can run it, it is taken"
    (reason,) = ladder.beyond(plan, dataclasses.replace(able, **facts))
    assert f"out of reach of this guard's {rung} rung" in reason, reason
