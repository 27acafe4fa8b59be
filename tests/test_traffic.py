"""Host<->device traffic is counted: every copy the guard makes goes through the memory backend, a call reports
the bytes it moved, and the planner predicts the same figure for each plan from its fake run."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers.batches import lm_batch
from helpers.models import make_llama
from helpers.steps import model_step
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import OOMGuard, Plan
from oomguard._planner.engine import dry_run
from oomguard.testing import SimulatedGPU

LAYERS, HIDDEN = 2, 32
PLANS = [Plan(), Plan(offload_layers=1), Plan(micro_batch_size=2, offload_layers=2), Plan(activation_offload=True)]


def steady_transfers(plan: Plan, log: Path | None = None) -> int:
    """What the guard reports for a second step on ``plan`` (the offloading set up, the optimizer's journal off:
    the step's own traffic only)."""
    model = make_llama(layers=LAYERS, hidden=HIDDEN)
    guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[],
                     step_journal="never", log_file=log)  # fmt: skip
    guard.plan = plan
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(lm_batch(8, 16))
        result = guard(lm_batch(8, 16))
    guard.close()
    return result.transfer_bytes


def block_bytes(blocks: int) -> int:
    model = make_llama(layers=LAYERS, hidden=HIDDEN)
    return sum(p.numel() * 4 for layer in list(model.model.layers)[-blocks:] for p in layer.parameters())


def test_a_call_reports_the_bytes_its_plan_moved() -> None:
    plain, one_layer, two_layers_four_parts, activations = (steady_transfers(plan) for plan in PLANS)
    assert plain == 0, "nothing offloaded, no journal: nothing moves"
    # A streamed block goes to the device for its forward and again for its backward; its gradient comes back.
    assert one_layer == 3 * block_bytes(1)
    assert two_layers_four_parts == 4 * 3 * block_bytes(2), "per micro-batch (8 samples in parts of 2)"
    assert activations > 0


def test_the_progress_event_carries_the_steps_traffic(tmp_path: Path) -> None:
    moved = steady_transfers(Plan(offload_layers=1), tmp_path / "log.jsonl")
    progress = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["transfer_bytes"] for e in progress if e["event"] == "progress"][-1] == moved


def test_the_planner_predicts_each_plans_traffic_from_its_fake_run() -> None:
    with FakeTensorMode():
        model = make_llama(layers=LAYERS, hidden=HIDDEN)
        report = dry_run(
            model_step(model), lm_batch(8, 16), model=model, optimizer=torch.optim.AdamW(model.parameters()),
            capacity=2**40, target="simulated", label="llama", plans=PLANS,
        )  # fmt: skip
    predicted = [c.transfer_bytes for c in report.candidates]
    measured = [steady_transfers(plan) for plan in PLANS]
    assert predicted == measured
    assert report.to_dict()["candidates"][1]["transfer_bytes"] == measured[1]
    assert report.to_dict()["transfer_bytes_per_step"] == report.chosen.transfer_bytes
