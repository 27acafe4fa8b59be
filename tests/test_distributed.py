"""Two gloo ranks on CPU, each on its own SimulatedGPU, where only one rank runs out of memory.

Every scenario runs under a hard timeout: a rank that hangs is killed with its whole process group, and the test
fails rather than wait. See tests/dist_worker.py for what each rank does.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.launch import RANKS, WORLD, launch
from helpers.models import make_mlp
from helpers.once import once

WORKER = Path(__file__).resolve().parent / "dist_worker.py"

pytestmark = [pytest.mark.integration, pytest.mark.subprocess, RANKS]  # two gloo ranks, each a process


def reports(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"report{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def agreed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return once("ddp run", lambda: _agreed_run(tmp_path_factory.mktemp("dist")))


def _agreed_run(out: Path) -> Path:
    codes, hung = launch(WORKER, out, "run", timeout=180)
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
    assert not hung, f"a rank hung and was killed:\n{logs}"
    assert codes == [0, 0], logs
    return out


def test_every_rank_recovers_and_both_report_the_same_plans(agreed_run: Path) -> None:
    rank0, rank1 = reports(agreed_run)
    assert rank1["faults_fired"] == {"forward": True, "backward": True, "optimizer0": True, "optimizer3": True}
    assert not any(rank0["faults_fired"].values()), "only rank 1 ran out of memory"
    assert [s["plan"] for s in rank0["steps"]] == [s["plan"] for s in rank1["steps"]]
    assert [s["ooms"] for s in rank0["steps"]] == [s["ooms"] for s in rank1["steps"]]
    assert all(s["ooms"] >= 1 for s in rank0["steps"][:4]), "rank 0 retried every time rank 1 failed"
    assert rank0["adam_steps"] == rank1["adam_steps"] == [5, 5, 5, 5], "one optimizer step per call, no more"
    # Rank 1's lines say it ran out of memory; rank 0's say a peer did.
    rank0_events = [json.loads(line) for line in (agreed_run / "events.jsonl").read_text().splitlines()]
    rank1_events = [json.loads(line) for line in (agreed_run / "events.rank1.jsonl").read_text().splitlines()]
    assert {e["error"]["error_type"] for e in rank0_events if e["event"] == "oom"} == {"PeerOutOfMemory"}
    assert "OutOfMemoryError" in {e["error"]["error_type"] for e in rank1_events if e["event"] == "oom"}


def test_replicas_are_identical_and_equal_a_single_process_run(agreed_run: Path) -> None:
    assert_replicas_equal_a_single_process_run(agreed_run)


def test_every_rank_offloads_the_optimizer_when_one_rank_runs_out_in_its_step(tmp_path: Path) -> None:
    assert_every_rank_engaged(tmp_path, "offload", "optimizer_offload")
    assert_replicas_equal_a_single_process_run(tmp_path)


def test_every_rank_quantizes_the_optimizer_state_when_one_rank_runs_out_in_its_step(tmp_path: Path) -> None:
    assert_every_rank_engaged(tmp_path, "quantized", "quantized_optimizer")
    weights = [torch.load(tmp_path / f"weights{rank}.pt") for rank in range(WORLD)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0]), "the replicas are equal"


def assert_every_rank_engaged(out: Path, mode: str, field: str) -> None:
    """The worker in ``mode``: one OOM in rank 1's first optimizer step, and every rank on a plan with ``field``
    set from then on, one optimizer step per call."""
    codes, hung = launch(WORKER, out, mode, timeout=180)
    assert not hung and codes == [0, 0], "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    rank0, rank1 = reports(out)
    assert rank1["faults_fired"]["optimizer0"] and not any(rank0["faults_fired"].values())
    plans = [[s["plan"] for s in report["steps"]] for report in (rank0, rank1)]
    assert plans[0] == plans[1] and all(plan[field] for plan in plans[0]), "the ranks agreed"
    assert [s["ooms"] for s in rank0["steps"]] == [s["ooms"] for s in rank1["steps"]] == [1, 0, 0, 0, 0]
    assert rank0["adam_steps"] == rank1["adam_steps"] == [5, 5, 5, 5], "one optimizer step per call, no more"


def assert_replicas_equal_a_single_process_run(out: Path) -> None:
    weights = [torch.load(out / f"weights{rank}.pt") for rank in range(WORLD)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), f"{name} differs between the ranks"
    reference = make_mlp(width=512)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-3)
    for step in range(5):  # the same global batches, whole: DDP's average of equal halves is their mean
        x, y = tuple_batch(n=32, seed=100 + step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x).squeeze(-1), y).backward()
        optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[0][name], value, rtol=1e-4, atol=1e-5)


def test_two_ranks_on_the_chunked_loss_agree_and_equal_a_single_process_run(tmp_path: Path) -> None:
    """A Qwen2 under DDP, the chunked_loss rung on: the rung finds the head and loss inside the wrapper, and the
    head's (tied) weight gradient it makes in the forward reaches DDP's all-reduce (else the replicas would part).
    Rank 1 runs out of memory inside the chunked loss of step 1: both ranks retry on micro-batches, chunked."""
    from dist_worker import chunked_batches
    from helpers.models import make_qwen2

    codes, hung = launch(WORKER, tmp_path, "chunked", timeout=180)
    assert not hung and codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    rank0, rank1 = reports(tmp_path)
    assert rank1["fault_fired"] and not rank0["fault_fired"]
    assert rank0["steps"] == rank1["steps"], "the ranks agreed on every plan"
    assert [s["ooms"] for s in rank0["steps"]] == [0, 1, 0]
    assert all("chunked loss" in s["plan"] for s in rank0["steps"]), rank0["steps"]
    assert rank0["patched"] and rank1["patched"]
    weights = [torch.load(tmp_path / f"weights{rank}.pt") for rank in range(WORLD)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), f"{name} differs between the ranks"
    reference = make_qwen2()  # one process, the whole global batch, the model's own (unchunked) loss
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-3)
    for batch in chunked_batches():
        optimizer.zero_grad()
        reference(**batch).loss.backward()
        optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[0][name], value, rtol=1e-4, atol=1e-5)


def test_two_ranks_on_the_tiled_mlp_agree_on_one_shard_count_and_equal_a_single_process_run(tmp_path: Path) -> None:
    """A Llama under DDP, its ladder tiled_mlp alone: rank 1 runs out of memory in block 0's MLP in step 1 and both
    ranks tile every MLP in the same number of chunks from there; the chunks' weight gradients, handed to autograd
    once per parameter, reach DDP's all-reduce (else the replicas would part) and train as one process does."""
    from dist_worker import chunked_batches
    from helpers.models import make_llama

    codes, hung = launch(WORKER, tmp_path, "tiled", timeout=180)
    assert not hung and codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    rank0, rank1 = reports(tmp_path)
    assert rank1["fault_fired"] and rank0["steps"] == rank1["steps"], "the ranks agreed on every plan"
    assert [s["ooms"] for s in rank0["steps"]] == [0, 1, 0]
    assert [s["rungs"] for s in rank0["steps"]] == [[], ["tiled_mlp"], ["tiled_mlp"]], rank0["steps"]
    assert all("MLP tiled x2" in s["plan"] for s in rank0["steps"][1:]), "the first level: 2 chunks"
    weights = [torch.load(tmp_path / f"weights{rank}.pt") for rank in range(WORLD)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), f"{name} differs between the ranks"
    reference = make_llama()  # one process, the whole global batch, untiled
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in chunked_batches():
        optimizer.zero_grad()
        reference(**batch).loss.backward()
        optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[0][name], value, rtol=1e-4, atol=1e-5)


def test_the_agreement_allocates_no_device_memory(agreed_run: Path) -> None:
    assert [r["agreement_allocations"] for r in reports(agreed_run)] == [0, 0]


def test_an_unforeseeable_fault_in_an_unjournaled_step_stops_every_rank_alike(tmp_path: Path) -> None:
    codes, hung = launch(WORKER, tmp_path, "fast", timeout=180)
    assert not hung and codes == [0, 0]
    errors = [r["error"] for r in reports(tmp_path)]
    assert errors == [{"step": 3, "type": "StepRollbackError"}] * 2


def test_a_rank_whose_host_memory_runs_out_stops_every_rank_and_the_others_say_it_was_host_memory(
    tmp_path: Path,
) -> None:
    """Before: rank 0 said rank 1 failed "with an error that is not an out-of-memory error"."""
    codes, hung = launch(WORKER, tmp_path, "host", timeout=180)
    assert not hung and codes == [0, 0]
    found = reports(tmp_path)
    assert [r["error"] for r in found] == [{"step": 1, "type": "PeerFailure"}, {"step": 1, "type": "HostMemoryError"}]
    assert "another rank ran out of host memory (RAM) in the forward phase" in found[0]["message"]
    assert "not an out-of-memory error" not in found[0]["message"]
    assert [len(r["steps"]) for r in found] == [1, 1], "step 0 committed on both, step 1 on neither"


def test_a_hung_rank_is_killed_not_left_behind(tmp_path: Path) -> None:
    started = time.monotonic()
    codes, hung = launch(WORKER, tmp_path, "hang", timeout=15)
    assert hung, "rank 0 waits in a barrier rank 1 never joins"
    assert time.monotonic() - started < 60
    assert codes == [-signal.SIGABRT, -signal.SIGABRT], "both ranks were stopped by the harness"
    # Each wrote where it hung before it went: rank 0 in the barrier, rank 1 in its sleep.
    rank0, rank1 = ((tmp_path / f"rank{rank}.log").read_text() for rank in range(WORLD))
    assert "in barrier" in rank0 and "in main" in rank0, rank0
    assert "in main" in rank1 and "in barrier" not in rank1, rank1
