"""Two gloo ranks whose failures differ in one attempt, and parameter groups added during a distributed job (issue
45: findings 5 and 9). See tests/dist_mixed_worker.py for what each rank does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_mixed_worker import STEPS, mlp
from helpers.batches import tuple_batch
from helpers.launch import RANKS, WORLD, launch

WORKER = Path(__file__).resolve().parent / "dist_mixed_worker.py"

pytestmark = [pytest.mark.integration, pytest.mark.subprocess, RANKS]  # two gloo ranks, each a process


def run(tmp_path: Path, mode: str) -> list[dict[str, Any]]:
    codes, hung = launch(WORKER, tmp_path, mode, timeout=180)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
    assert not hung, f"a rank hung and was killed:\n{logs}"
    assert codes == [0, 0], logs
    return [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("mode", ["ddp-forward", "ddp-optimizer", "fsdp-forward"])
def test_one_ranks_own_error_beside_anothers_oom_stops_both_ranks_none_retries_alone(tmp_path: Path, mode: str) -> None:
    """Before: rank 1 retried its OOM alone after the agreement said fatal; DDP's next agreement was garbled
    ("micro_batch_size ... got 0", then "Connection closed by peer") and FSDP2 hung on both ranks."""
    rank0, rank1 = run(tmp_path, mode)
    assert rank0["fired"] and rank1["fired"]
    assert rank0["error"]["step"] == rank1["error"]["step"] == 1
    assert rank0["error"]["type"] == "ValueError"
    assert rank1["error"]["type"] == "PeerFailure", rank1["error"]
    assert "ran out of memory in the same attempt" in rank1["error"]["message"]
    assert rank0["steps"] == rank1["steps"] == 1


def test_a_parameter_group_added_during_training_is_averaged_over_the_ranks_and_clipped(tmp_path: Path) -> None:
    """Progressive unfreezing under DDP: the new group's gradients are all-reduced and clipped with the rest, so the
    replicas stay equal and equal one process on both ranks' data. Before: the ranks drifted apart."""
    rank0, rank1 = run(tmp_path, "groups")
    weights = [torch.load(tmp_path / f"weights{rank}.pt") for rank in range(WORLD)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "the replicas are equal"
    assert rank0["norms"] == rank1["norms"]
    model = mlp()
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    norms = []
    for step in range(STEPS):
        if step == 2:
            model[0].requires_grad_(True)
            optimizer.add_param_group({"params": list(model[0].parameters()), "lr": 1e-2})
        parts = [tuple_batch(n=8, seed=10 * step + rank) for rank in range(WORLD)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        torch.nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    assert rank0["norms"] == pytest.approx(norms, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(weights[0][key], value, rtol=1e-5, atol=1e-6)
