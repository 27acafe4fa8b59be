"""The Hugging Face Trainer and Accelerate with the guard: recovery without changing what is trained."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.hf_trainer import RaggedText, train_plain, training_args
from helpers.models import make_llama, make_mlp
from helpers.steps import mse_step

from oomguard import GuardConfigError, Plan, oom_guard
from oomguard._effects.quantized import Quantized
from oomguard.testing import SimulatedGPU

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.integration  # the HF Trainer and Accelerate end to end

EPS = 1e-6  # Adam's eps where the Trainer's runs are compared (see the first test)


def test_the_trainer_recovers_and_trains_exactly_what_the_plain_trainer_trains(tmp_path: Path) -> None:
    from oomguard.integrations.transformers import OOMGuardTrainer

    # Adam's first update is lr * g / (|g| + eps): an element whose gradient is near eps (1e-8 by default) moves by
    # a fraction of lr that the summation order (micro-batches, this CPU's BLAS) decides. A larger eps, for both runs
    # alike, keeps the comparison one of what is trained, not of the rounding of a gradient of 1e-8.
    reference, plain = train_plain(tmp_path / "plain", adam_epsilon=EPS)
    model = make_llama(layers=2, hidden=64)
    armed: list[bool] = []

    class FaultInTheOptimizerStep(transformers.TrainerCallback):  # type: ignore[misc]
        """Once, right before the third optimizer step (Adam's state exists by then): its next allocation fails."""

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2 and not armed:
                armed.append(True)
                gpu.fail_allocation(1)

    trainer = OOMGuardTrainer(
        model=model,
        args=training_args(tmp_path / "guarded", adam_epsilon=EPS),
        train_dataset=RaggedText(),
        callbacks=[FaultInTheOptimizerStep()],
    )
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(model)
        trainer.train()
    summary = trainer.oomguard.summary()
    assert summary.ooms >= 2 and "micro_batch" in summary.fallbacks, "the batch did not fit: micro-batches"
    assert armed, "the optimizer step ran out of memory once"
    assert any(e.kind == "oom" and e.error.phase == "optimizer" for e in trainer.oomguard.events)  # type: ignore[attr-defined]
    assert trainer.state.global_step == plain.state.global_step == 4, "no step lost, none repeated"
    steps = {int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s}
    assert steps == {4}, "Adam stepped exactly once per global step"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    reference_losses = [entry["loss"] for entry in plain.state.log_history if "loss" in entry]
    assert losses == pytest.approx(reference_losses, rel=1e-5), "token-weighted losses stay exact"
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):  # (Adam amplifies rounding a little)
        torch.testing.assert_close(p, q, rtol=1e-3, atol=5e-5)


def test_the_trainer_refuses_its_own_gradient_accumulation(tmp_path: Path) -> None:
    from oomguard.integrations.transformers import OOMGuardTrainer

    with pytest.raises(GuardConfigError, match="gradient_accumulation_steps=1"):
        OOMGuardTrainer(
            model=make_llama(), args=training_args(tmp_path, gradient_accumulation_steps=2), train_dataset=RaggedText()
        )


def test_accelerate_backward_is_used_and_training_matches_a_plain_loop() -> None:
    from accelerate import Accelerator

    def run(guarded: bool) -> tuple[torch.nn.Module, int]:
        accelerator = Accelerator(cpu=True)
        model = make_mlp(width=256)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        batches = [tuple_batch(n=128, seed=s) for s in range(3)]
        if not guarded:
            for batch in batches:
                loss = mse_step(model)(batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            return model, 0
        calls: list[torch.Tensor] = []
        real_backward = accelerator.backward
        accelerator.backward = lambda loss, **kw: (calls.append(loss), real_backward(loss, **kw))[1]  # type: ignore[method-assign]
        step = oom_guard(mse_step(model), model=model, optimizer=optimizer, accelerator=accelerator)
        with SimulatedGPU("256KiB") as gpu:
            gpu.adopt(model)
            results = [step(batch) for batch in batches]
        # Every micro-batch of every successful attempt (and those of failed attempts) went through Accelerate.
        assert len(calls) >= sum(r.micro_batches for r in results) > len(results)
        return model, sum(r.ooms for r in results)

    reference, _ = run(guarded=False)
    model, ooms = run(guarded=True)
    assert ooms >= 1
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_accelerates_own_gradient_accumulation_is_refused_naming_the_guards_own() -> None:
    """``Accelerator(gradient_accumulation_steps=2)`` with ``accelerator.accumulate(model)``, as Accelerate's docs
    teach: before, every call returned a committed step while AdamW stepped every other call, on the last micro-batch's
    half-scaled gradient alone (the guard's zero_grad dropped the one before). Now refused before anything runs, at
    construction and at a call (the accumulation switched on after the guard was made), naming the fix."""
    from accelerate import Accelerator
    from accelerate.state import GradientState

    try:
        assert_refused_at_construction_and_at_a_call(Accelerator(cpu=True, gradient_accumulation_steps=2))
    finally:  # (Accelerate keeps its accumulation in a state every Accelerator of the process shares)
        GradientState._reset_state()


def assert_refused_at_construction_and_at_a_call(accelerator: Any) -> None:
    model = make_mlp(width=64)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(
        GuardConfigError, match=r"gradient_accumulation_steps=2.*Accelerator\(gradient_accumulation_steps=1\)"
    ):
        oom_guard(mse_step(model), model=model, optimizer=optimizer, accelerator=accelerator)
    accelerator.gradient_accumulation_steps = 1
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, accelerator=accelerator)
    accelerator.gradient_accumulation_steps = 2
    before = [p.detach().clone() for p in model.parameters()]
    with SimulatedGPU("1GiB") as gpu, accelerator.accumulate(model):
        gpu.adopt(model)
        with pytest.raises(GuardConfigError, match="whole effective batch"):
            step(tuple_batch(n=8))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state


def test_the_jump_plans_a_job_accelerate_prepared(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the dry run rebuilt Accelerate's optimizer wrapper over the fakes (it takes an optimizer, not
    parameter groups) and failed: the guard walked the ladder instead."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_mlp(width=256)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, accelerator=accelerator)
    with SimulatedGPU("256KiB") as gpu:
        gpu.adopt(model)
        result = step(tuple_batch(n=128))
    assert result.ooms == 1 and "dry run of this step failed" not in caplog.text
    assert any(e.kind == "fallback" and "dry-run planner" in e.description for e in step.guard.events)


@pytest.mark.parametrize("rung", ["optimizer_offload", "quantized_optimizer"])
def test_the_optimizer_rungs_take_accelerates_optimizer_wrapper(rung: str) -> None:
    """Before: both rungs hooked load_state_dict (and state_dict) on Accelerate's ``AcceleratedOptimizer``, which
    never ran ``Optimizer.__init__`` and has no hook tables: an AttributeError where an OOM in the step engaged
    them. Now they hook the torch optimizer inside, which the wrapper's state_dict and load_state_dict call."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_mlp(width=256)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, accelerator=accelerator, ladder=[rung])
    fired: list[bool] = []

    def fault(*_: Any) -> None:
        if not fired:
            fired.append(True)
            gpu.fail_allocation(1)

    optimizer.optimizer.register_step_pre_hook(fault)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        result = step(tuple_batch(n=32))
        state = optimizer.state_dict()  # (through the rung's hooks on the inner optimizer)
        optimizer.load_state_dict(state)
        again = step(tuple_batch(n=32, seed=1))
    assert fired and result.ooms == 1 and again.ooms == 0
    assert result.rungs == (rung,) and again.rungs == (rung,)
    assert all(int(s["step"]) == 2 for s in optimizer.state.values())
    if rung == "quantized_optimizer":  # (the moments of the two weight matrices, in 8 bits)
        assert any(isinstance(v, Quantized) for s in optimizer.state.values() for v in s.values())
    step.guard.close()


def test_the_trainer_integration_needs_no_change_to_the_model(tmp_path: Path) -> None:
    from oomguard.integrations.transformers import OOMGuardTrainer

    model = make_llama(layers=2, hidden=64)
    before = copy.deepcopy(model.state_dict())
    trainer = OOMGuardTrainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=RaggedText())
    trainer.train()
    assert trainer.state.global_step == 1
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "it trained"
    with pytest.raises(GuardConfigError, match="sets"):
        OOMGuardTrainer(model=model, args=training_args(tmp_path), oomguard={"model": model})


def test_when_training_ends_the_model_is_as_it_was_given_and_a_second_trainer_takes_it(tmp_path: Path) -> None:
    """Before: the guard's plan stayed applied after ``train()`` until the trainer was garbage-collected (a Trainer
    lives in reference cycles): Adam's state on the host, and a second trainer on the same model refused with
    "another guard has changed this model" (or, in the suite, the undo ran later inside another test's device)."""
    from oomguard.integrations.transformers import OOMGuardTrainer

    model = make_llama(layers=2, hidden=64)
    first = OOMGuardTrainer(model=model, args=training_args(tmp_path / "first"), train_dataset=RaggedText(),
                            oomguard={"ladder": ["optimizer_offload"]})  # fmt: skip
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        first.train()  # (roomy: the plan is set by hand below, for a second run)
        first.oomguard.plan = Plan(optimizer_offload=True)
        first.train()
        assert first.oomguard.plan == Plan(optimizer_offload=True), "the plan is kept"
        assert not first.oomguard.effects.holds
        states = [v for s in first.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert states and all(gpu.is_device(v) for v in states), "Adam's state back on the device"
        second = OOMGuardTrainer(model=model, args=training_args(tmp_path / "second"), train_dataset=RaggedText())
        second.train()
    assert second.state.global_step == 4


def test_label_smoothing_keeps_the_chunked_loss_off_and_trains_as_the_plain_trainer(tmp_path: Path) -> None:
    """With ``label_smoothing_factor`` the Trainer computes its loss from ``outputs.logits`` (its LabelSmoother):
    the chunked loss would save nothing there, so it does not engage (an OOM goes to micro-batches), and the
    losses are the plain Trainer's."""
    from oomguard._effects.chunked_loss import ChunkedLoss
    from oomguard.integrations.transformers import OOMGuardTrainer

    args = {"max_steps": 2, "label_smoothing_factor": 0.1}
    reference = make_llama(layers=2, hidden=64)
    plain = transformers.Trainer(
        model=reference, args=training_args(tmp_path / "plain", **args), train_dataset=RaggedText()
    )
    plain.train()
    model = make_llama(layers=2, hidden=64)

    class FaultInTheFirstForward(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 0:
                gpu.fail_allocation(1)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append(ChunkedLoss.applies(model))  # (what the guard was told when it asked)

    seen: list[str | None] = []
    trainer = OOMGuardTrainer(
        model=model,
        args=training_args(tmp_path / "guarded", **args),
        train_dataset=RaggedText(),
        callbacks=[FaultInTheFirstForward()],
        oomguard={"ladder": ["chunked_loss", "micro_batch"]},
    )
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        trainer.train()
    summary = trainer.oomguard.summary()
    assert summary.ooms == 1 and "chunked_loss" not in summary.fallbacks and "micro_batch" in summary.fallbacks
    assert seen[0] is not None and "label_smoothing_factor=0.1" in seen[0], seen
    assert ChunkedLoss.applies(model) is None, "once training ends, the model is the rung's again"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    reference_losses = [entry["loss"] for entry in plain.state.log_history if "loss" in entry]
    assert len(losses) == 2 and losses == pytest.approx(reference_losses, rel=1e-5)


def test_a_compute_loss_func_keeps_the_chunked_loss_off_while_the_trainer_trains(tmp_path: Path) -> None:
    """A ``compute_loss_func`` computes the loss from the model's outputs too (the labels are taken out)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from oomguard._effects.chunked_loss import ChunkedLoss
    from oomguard.integrations.transformers import OOMGuardTrainer

    model = make_llama(layers=2, hidden=64)
    seen: list[str | None] = []

    class Seen(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append(ChunkedLoss.applies(model))

    def loss_from_outputs(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        loss: torch.Tensor = ForCausalLMLoss(outputs.logits, labels, 64, num_items_in_batch=num_items_in_batch)
        return loss

    trainer = OOMGuardTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=1),
        train_dataset=RaggedText(),
        compute_loss_func=loss_from_outputs,
        callbacks=[Seen()],
    )
    assert ChunkedLoss.applies(model) is None  # (the trainer refuses the rung while it trains, not before)
    trainer.train()
    assert seen and seen[0] is not None and "compute_loss_func" in seen[0], seen
    assert ChunkedLoss.applies(model) is None
