"""The planner predicts each plan's step time from what its fake run counts, and recommends the fastest fitting
plan by that model."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from helpers.batches import lm_batch
from helpers.models import make_llama
from helpers.steps import model_step
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import Plan
from oomguard._cli.main import main
from oomguard._planner.engine import dry_run
from oomguard._planner.speed import DeviceSpeed, measure_speed

PLANS = [
    Plan(),
    Plan(checkpointing="full"),
    Plan(precision="bf16"),
    Plan(micro_batch_size=1),
    Plan(offload_layers=2),
    Plan(optimizer_offload=True),
]


def candidates(speed: DeviceSpeed | None = None, capacity: int = 2**40) -> Any:
    with FakeTensorMode():
        model = make_llama(layers=2, hidden=64)
        return dry_run(
            model_step(model), lm_batch(8, 64), model=model, optimizer=torch.optim.AdamW(model.parameters()),
            capacity=capacity, target="simulated", label="llama", plans=PLANS, speed=speed,
        )  # fmt: skip


def test_each_term_of_the_model_moves_the_prediction_the_right_way() -> None:
    plain, full, bf16, split, layers, optimizer = (c.predicted_seconds for c in candidates().candidates)
    assert full > plain, "checkpointing's recompute is counted"
    assert bf16 < plain, "half precision runs at twice fp32's throughput"
    assert split > plain, "eight micro-batches cost eight fixed costs, the same FLOPs"
    assert layers > plain and optimizer > plain, "copies and the host optimizer take time"
    slow_link = candidates(DeviceSpeed(link_gbps=1.0)).candidates
    assert slow_link[4].predicted_seconds > layers and slow_link[0].predicted_seconds == pytest.approx(plain)


def _llama_candidates(plans: list[Plan], speed: DeviceSpeed, target: str) -> list[Any]:
    """The dry run's candidates for ``plans`` on a 2-layer Llama, batches of 2 x 32, timed by ``speed``."""
    with FakeTensorMode():
        model = make_llama(layers=2, hidden=64)
        return list(dry_run(
            model_step(model), lm_batch(2, 32), model=model, optimizer=torch.optim.AdamW(model.parameters()),
            capacity=2**40, target=target, label="llama", plans=plans, speed=speed,
        ).candidates)  # fmt: skip


def test_on_cuda_the_copies_down_beside_forward_and_backward_cost_only_what_the_compute_does_not_hide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 27: the model added every copy to the compute, though activation offload's saved tensors and the
    master level's gradients go down on the copy stream while forward and backward run on."""
    plans = [Plan(activation_offload=True), Plan(precision="bf16", optimizer_offload="master")]
    slow = DeviceSpeed(link_gbps=0.05)  # (a link slow enough that the copies outlast the compute)

    def predicted(target: str) -> list[Any]:
        return _llama_candidates(plans, slow, target)

    overlapped = predicted("cuda")
    monkeypatch.setattr("oomguard._planner.probe.Probe.overlapped", lambda self, run, parts: 0)
    added, simulated_added = predicted("cuda"), predicted("simulated")
    for beside, summed in zip(overlapped, added, strict=True):
        assert beside.transfer_bytes == summed.transfer_bytes, "the same copies"
        assert beside.predicted_seconds < summed.predicted_seconds, f"{beside.plan}: nothing hidden"
        saved = summed.predicted_seconds - beside.predicted_seconds
        assert saved <= beside.transfer_bytes / (slow.link_gbps * 1e9), "no more hidden than was copied"
    monkeypatch.undo()
    simulated = predicted("simulated")  # (a memcpy on the same thread hides nothing)
    assert [c.predicted_seconds for c in simulated] == [c.predicted_seconds for c in simulated_added]


def test_on_cuda_the_master_levels_weights_going_up_beside_the_host_step_cost_only_what_it_does_not_hide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 27: each bucket of the master level's stepped weights goes up while the host steps the next
    (oomguard/_effects/ascent.py); the model added the copies to the host step."""
    monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", 4096)  # (a tiny model's host step in buckets)
    # The step after backward, whose buckets this is about (not begun during backward: the test below).
    monkeypatch.setattr("oomguard._step.runner.StepRunner._steps_alone", lambda self, job: False)
    plans = [Plan(precision="bf16", optimizer_offload="master"), Plan(optimizer_offload=True)]
    slow = DeviceSpeed(link_gbps=0.05, host_params_per_second=1e6)  # (copies and host step both count)

    def predicted(target: str) -> list[Any]:
        return _llama_candidates(plans, slow, target)

    beside, simulated = predicted("cuda"), predicted("simulated")
    monkeypatch.setattr("oomguard._effects.effects.Effects.uploaded_beside", property(lambda self: 0))
    added, simulated_added = predicted("cuda"), predicted("simulated")
    master, level1 = zip(beside, added, strict=True)
    assert master[0].transfer_bytes == master[1].transfer_bytes, "the same copies"
    saved = master[1].predicted_seconds - master[0].predicted_seconds
    params = sum(p.numel() for p in make_llama(layers=2, hidden=64).parameters())
    weights_up = 2 * params / (slow.link_gbps * 1e9)  # (the bf16 weights over the link)
    assert 0.5 * weights_up < saved < weights_up, "all but the last bucket's copies hidden behind the host step"
    assert level1[0].predicted_seconds == level1[1].predicted_seconds, "level 1's weights go up after the step"
    assert [c.predicted_seconds for c in simulated] == [c.predicted_seconds for c in simulated_added], "a memcpy"


def test_on_cuda_the_master_levels_host_step_begun_during_backward_costs_only_what_backward_does_not_hide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 27: each bucket whose gradients backward has finished steps on the host while backward goes on
    (oomguard/_effects/early.py); the model added the whole host step after backward."""
    monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", 4096)
    plans = [Plan(precision="bf16", optimizer_offload="master")]
    speed = DeviceSpeed(gpu_tflops=1e-4, host_params_per_second=1e6)  # (a backward long enough to hide it all)
    params = sum(p.numel() for p in make_llama(layers=2, hidden=64).parameters())
    (early,), (early_simulated,) = _llama_candidates(plans, speed, "cuda"), _llama_candidates(plans, speed, "simulated")
    monkeypatch.setattr("oomguard._step.runner.StepRunner._steps_alone", lambda self, job: False)
    (after,), (after_simulated,) = _llama_candidates(plans, speed, "cuda"), _llama_candidates(plans, speed, "simulated")
    saved = after.predicted_seconds - early.predicted_seconds
    host = params / speed.host_params_per_second
    assert 0.5 * host < saved <= host, f"all but the buckets finished last hidden behind backward: {saved} s"
    assert early.transfer_bytes == after.transfer_bytes, "the same copies"
    assert early_simulated.predicted_seconds == after_simulated.predicted_seconds, "nothing beside, simulated"


def test_the_recommendation_is_the_fastest_fitting_plan() -> None:
    report = candidates()
    fitting = [c for c in report.candidates if c.fits]
    assert len(fitting) == len(PLANS)
    assert report.recommended == min(fitting, key=lambda c: c.predicted_seconds).plan == Plan(precision="bf16")
    data = report.to_dict()
    assert data["predicted_seconds"] == min(c["predicted_seconds"] for c in data["candidates"])


def test_the_cli_takes_the_device_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "gpt2", "--gpu-memory", "6GiB", "--batch-size", "2", "--seq-len", "64", "--json"]
    main(args)
    default = json.loads(capsys.readouterr().out)["predicted_seconds"]
    main([*args, "--gpu-tflops", "1"])
    slower = json.loads(capsys.readouterr().out)["predicted_seconds"]
    assert slower > default > 0
    with pytest.raises(SystemExit) as bad:
        main([*args, "--link-gbps", "0"])
    assert bad.value.code == 2 and "positive" in capsys.readouterr().err


def test_measuring_the_device_leaves_the_jobs_random_stream_where_it_was() -> None:
    """The measure's draws are seeded and its own (torch's, not numpy's, which ``pip install oomguard`` lacks):
    tuning measures the device inside a training call, whose dropout and shuffling must not shift."""
    state = torch.get_rng_state()
    speed = measure_speed(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    assert speed.fp32_tflops > 0 and speed.link_gbps > 0 and speed.host_params_per_second > 0
