"""OOMGuardTrainer under torchrun: two gloo ranks, the Trainer's DDP through Accelerate, rank 1 alone out of memory.

One job (tests/ddp_trainer_worker.py) of four Trainer steps in which rank 1 runs out of memory once in each part of
a step: the optimizer step of step 0 (Adam's lazy first step) and then the clipping of the replay it starts, the
forward of step 1, the backward of step 2, the clipping of step 3. Before, an OOM in the clipping or the optimizer
step hung both ranks (rank 1 replayed the batch, with its agreement and gradient all-reduce, while rank 0 had
stepped and gone on to the next batch); the forward and backward were agreed already.

The reference is one process on the whole batch of 16 (plain Trainer): the Trainer's data sharding makes it exact.
Accelerate gives rank r the batches r, r + 2, ... of the single process's sampler with half its batch size, the
same permutation, and the Trainer counts the tokens across ranks (``average_tokens_across_devices``) and scales
each rank's loss by the world size: the average of the ranks' gradients is the whole batch's. Without faults the
two-rank run and the single process agree within 3e-8.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.launch import RANKS, WORLD, torchrun
from helpers.once import once

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).resolve().parent / "ddp_trainer_worker.py"
FAULTS = ["optimizer@0", "replay-clip@0", "forward@1", "backward@2", "clip@3"]

pytestmark = [pytest.mark.integration, pytest.mark.subprocess, RANKS]  # two gloo ranks under torchrun


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return once("trainer under ddp", lambda: _faulty_run(tmp_path_factory.mktemp("trainer_ddp")))


def _faulty_run(out: Path) -> tuple[Path, list[dict[str, Any]]]:
    returncode, output = torchrun(WORKER, str(out), *FAULTS, done="done: global_step", timeout=240)
    assert returncode is not None, f"the ranks hung:\n{output[-6000:]}"
    assert returncode == 0, output[-4000:]
    return out, [json.loads((out / f"report{rank}.json").read_text()) for rank in range(WORLD)]


def test_both_ranks_recover_every_fault_on_rank_1_as_the_same_steps(
    faulty_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, (rank0, rank1) = faulty_run
    assert all(rank1["fired"].values()) and not any(rank0["fired"].values()), "only rank 1 ran out of memory"
    assert rank0["global_step"] == rank1["global_step"] == 4, "no step lost or repeated on either rank"
    assert rank0["adam_steps"] == rank1["adam_steps"] == [4], "one optimizer step per Trainer step, on each rank"
    phases = [(e["step"], e["phase"]) for e in rank1["ooms"]]
    assert phases == [(0, "optimizer"), (0, "clip"), (1, "forward"), (2, "backward"), (3, "clip")]
    assert [e["step"] for e in rank0["ooms"]] == [0, 0, 1, 2, 3], "rank 0 retried every time rank 1 failed"
    assert {e["type"] for e in rank0["ooms"]} == {"PeerOutOfMemory"}
    assert rank0["plan"] == rank1["plan"], "the ranks ended on the same plan"
    assert rank0["losses"] == rank1["losses"]


def test_the_replicas_are_equal_and_equal_one_process_on_the_whole_batch(
    faulty_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    import transformers
    from helpers.hf_trainer import RaggedText, training_args
    from helpers.models import make_llama

    out, (rank0, _) = faulty_run
    weights = [torch.load(out / f"weights{rank}.pt") for rank in range(WORLD)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), f"{name} differs between the ranks"
    reference = make_llama(layers=2, hidden=64)
    args = training_args(tmp_path, per_device_train_batch_size=16, max_steps=4)
    plain = transformers.Trainer(model=reference, args=args, train_dataset=RaggedText())
    plain.train()
    assert rank0["losses"] == pytest.approx([e["loss"] for e in plain.state.log_history if "loss" in e], rel=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[0][name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("every", [25, 1], ids=["sampled", "every-allocation"])
def test_an_oom_at_allocations_of_a_trainer_step_on_rank_1_loses_nothing_on_either(tmp_path: Path, every: int) -> None:
    """The fault sweep of the Trainer under DDP: rank 1's n-th device allocation of the second step fails, once,
    from the guard's forward to the step's end (forward, backward, agreement A, the gradient all-reduce, the
    Trainer's clipping, its optimizer step and agreement B), for every ``every``-th n. Each run ends on both ranks
    with two steps, equal replicas, and weights within 1e-6 of the run without faults. (Sampled: about a minute;
    every allocation, 334 runs: 14.4 minutes on two shared cores.)

    Not swept: the Trainer's own input preparation before its compute_loss (``_prepare_inputs``), which copies the
    batch to the device outside the guard: an OOM there ends train() on that rank, as it does on one process."""
    returncode, output = torchrun(
        WORKER, str(tmp_path), "sweep", str(every), done="done: global_step", timeout=240 if every > 1 else 3000
    )
    assert returncode is not None, f"the ranks hung:\n{output[-6000:]}"
    assert returncode == 0, output[-4000:]
    swept = [json.loads((tmp_path / f"sweep{rank}.json").read_text()) for rank in range(WORLD)]
    assert swept[0]["allocations"] == swept[1]["allocations"] > 100
    for report in swept:
        for result in report["results"]:
            assert "error" not in result, result
            assert result["global_step"] == 2 and result["replicas_equal"], result
            assert result["gap"] < 1e-6, result
            assert len(result["ooms"]) >= 1, result
    expected = len(range(1, swept[1]["allocations"] + 1, every))
    assert [len(report["results"]) for report in swept] == [expected, expected]
