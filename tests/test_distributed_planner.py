"""The planner's features under DDP, on two gloo ranks (see tests/dist_planner_worker.py): the jump on the first
OOM, tuning's trials and the state file, with the guard's default options, every job under a hard timeout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_planner_worker import GLOBAL_BATCH, JOBS, global_batch, share
from helpers.launch import RANKS, WORLD, launch
from helpers.models import make_llama
from helpers.once import once

from oomguard import OOMGuard, Plan
from oomguard.testing import SimulatedGPU

WORKER = Path(__file__).resolve().parent / "dist_planner_worker.py"

pytestmark = [pytest.mark.integration, pytest.mark.subprocess, RANKS]


def run(out: Path, mode: str) -> list[dict[str, Any]]:
    """Run both ranks of ``mode`` into ``out``; their reports."""
    out.mkdir()
    codes, hung = launch(WORKER, out, mode, timeout=420)
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
    assert not hung, f"a rank hung and was killed:\n{logs}"
    assert codes == [0, 0], logs
    return reports_of(out)


@pytest.fixture(scope="module", params=["quick", pytest.param("default", marks=pytest.mark.slow)])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job's output folder (its name is its mode); the state file beside it."""
    mode: str = request.param
    return once(f"planner {mode}", lambda: _ran(tmp_path_factory.mktemp("planner") / mode, mode))


def _ran(out: Path, mode: str) -> Path:
    run(out, mode)
    return out


def reports_of(out: Path) -> list[dict[str, Any]]:
    """Both ranks' reports, each with its events."""
    reports = []
    for rank in range(WORLD):
        report = json.loads((out / f"report{rank}.json").read_text())
        log = out / ("events.jsonl" if rank == 0 else f"events.rank{rank}.jsonl")
        report["events"] = [json.loads(line) for line in log.read_text().splitlines()]
        reports.append(report)
    return reports


def of_kind(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [event for event in report["events"] if event["event"] == kind]


def test_every_rank_jumps_on_its_first_oom_and_the_ranks_agree(job: Path) -> None:
    reports = reports_of(job)
    for report in reports:
        assert 1 <= report["steps"][0]["ooms"] <= 2, "the jump settles the first step in one or two OOMs"
        (jump,) = of_kind(report, "fallback")[:1]
        assert "dry-run planner" in jump["description"] and jump["fake_steps"] > 0, jump
        assert report["adam_steps"] == [len(report["steps"])], "one optimizer step per call"
    plans = [[step["plan"] for step in report["steps"]] for report in reports]
    assert plans[0] == plans[1], "every call ran on the same plan on both ranks"
    if job.name == "quick":  # (its jump takes the master level: fp32 master weights on the host, under DDP)
        assert {plan["optimizer_offload"] for plan in plans[0]} == {"master"}
    assert [s["ooms"] for s in reports[0]["steps"]] == [s["ooms"] for s in reports[1]["steps"]]


def test_tuning_times_the_same_trials_on_every_rank_and_keeps_the_same_plan(job: Path) -> None:
    if JOBS[job.name].tune_after is None:
        pytest.skip("this job does not tune")
    tuned = [of_kind(report, "tuned") for report in reports_of(job)]
    assert tuned[0] and tuned[1], "tuning ran to its end on both ranks"
    first = [events[0] for events in tuned]
    assert first[0]["plan"] == first[1]["plan"], "both ranks keep the same plan"
    # the slowest rank's times decide: both ranks saw the very same medians
    assert first[0]["timings"] == first[1]["timings"] and len(first[0]["timings"]) >= 2
    assert first[0]["fake_steps"] > 0 and first[1]["fake_steps"] == 0, "rank 0 searched; rank 1 took its trials"


def test_the_replicas_are_identical_and_equal_a_single_process_on_the_same_plans(job: Path) -> None:
    assert_replicas_equal_a_single_process(job)


def test_layer_offload_under_ddp_keeps_the_replicas_equal_to_a_single_process(tmp_path: Path) -> None:
    reports = run(tmp_path / "layers", "layers")
    assert {step["plan"]["offload_layers"] for step in reports[0]["steps"]} == {2}, "both blocks streamed"
    assert [s["plan"] for s in reports[0]["steps"]] == [s["plan"] for s in reports[1]["steps"]]
    assert_replicas_equal_a_single_process(tmp_path / "layers")


def assert_replicas_equal_a_single_process(job: Path) -> None:
    """Both ranks' weights are the same, and those of a single process on the whole batch, on the same plans."""
    weights = [torch.load(job / f"weights{rank}.pt") for rank in range(WORLD)]
    for key, value in weights[0].items():
        assert torch.equal(value, weights[1][key]), f"the replicas differ at {key}"
    # The single-process reference: each step's global batch, rank 0's rows then rank 1's (so that its micro-batches
    # are the ranks': bf16 rounds each micro-batch's gradient as a whole), on the plan the ranks agreed for the step.
    config = JOBS[job.name]
    model = make_llama(layers=config.layers, hidden=config.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer, predictive=False,
                     tune_after=None, relax_after=None)  # fmt: skip
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for step, record in enumerate(reports_of(job)[0]["steps"]):
            shares = [share(global_batch(step, config.seq), rank, WORLD) for rank in range(WORLD)]
            guard.plan = Plan.from_dict(record["plan"])
            result = guard({key: torch.cat([part[key] for part in shares]) for key in shares[0]})
            assert result.ooms == 0 and result.batch_size == GLOBAL_BATCH
    guard.close()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(weights[0][key], value, rtol=0, atol=1e-5, msg=f"{key} differs")


def test_a_restarted_job_on_the_state_file_plans_nothing_and_runs_out_of_memory_no_more(job: Path) -> None:
    if job.name != "quick":
        pytest.skip("the restart is the quick job's")
    restarted = run(job.parent / "restart", "state")
    for report in restarted:
        assert [step["ooms"] for step in report["steps"]] == [0, 0]
        assert not of_kind(report, "fallback") and not of_kind(report, "oom")
    assert restarted[0]["steps"][0]["plan"] == restarted[1]["steps"][0]["plan"]
