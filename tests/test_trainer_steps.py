"""Every allocation of a Trainer step is protected: the loss checks, the clipping, the optimizer step; a replay of
the step counts once; the trainer's own records keep no trace of a failed attempt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_llama
from test_integrations import RaggedText, train_plain, training_args

from oomguard.testing import SimulatedGPU

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from oomguard.integrations.transformers import OOMGuardTrainer  # noqa: E402

ROOMY = "64MiB"  # the whole batch fits: the only OOMs are the ones a test injects


def train_guarded(
    folder: Path, trainer_class: type, oomguard: dict[str, Any] | None = None, **overrides: Any
) -> tuple[torch.nn.Module, Any]:
    model = make_llama(layers=2, hidden=64)
    args = training_args(folder, **overrides)
    trainer = trainer_class(model=model, args=args, train_dataset=RaggedText(), oomguard=oomguard)
    with SimulatedGPU(ROOMY) as gpu:
        gpu.adopt(model)
        trainer.gpu = gpu
        trainer.train()
    return model, trainer


def assert_same_training(model: torch.nn.Module, trainer: Any, reference: torch.nn.Module, plain: Any) -> None:
    assert trainer.state.global_step == plain.state.global_step == 4, "no step lost, none repeated"
    steps = {int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s}
    assert steps == {4}, "Adam stepped exactly once per global step"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses == pytest.approx([e["loss"] for e in plain.state.log_history if "loss" in e], rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=5e-5)


def oom_events(trainer: Any) -> list[Any]:
    return [e for e in trainer.oomguard.events if e.kind == "oom"]


class FaultInClipping(OOMGuardTrainer):
    """The issue's reproduction: the clipping's first allocation of the third step fails, once."""

    armed = False

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self.state.global_step == 2 and not self.armed:
            type(self).armed = True
            self.gpu.fail_allocation(1)
        return super()._clip_grad_norm(model)


def test_an_oom_in_the_trainers_clipping_is_recovered_as_one_step(tmp_path: Path) -> None:
    reference, plain = train_plain(tmp_path / "plain")
    FaultInClipping.armed = False
    model, trainer = train_guarded(tmp_path / "guarded", FaultInClipping)
    assert FaultInClipping.armed
    (oom,) = oom_events(trainer)
    assert oom.error.phase == "clip" and oom.step == 2, "named as the Trainer numbers the step"
    assert_same_training(model, trainer, reference, plain)
    summary = trainer.oomguard.summary()
    assert (summary.steps, summary.ooms, summary.recovered_steps) == (4, 1, 1)


class FaultAfterTheLoss(OOMGuardTrainer):
    """Arms a fault as the training step returns: the Trainer's NaN/Inf check and running loss come next."""

    armed = False

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(*args, **kwargs)
        if self.state.global_step == 1 and not self.armed:
            type(self).armed = True
            self.gpu.fail_allocation(1)
        assert not self.gpu.is_device(loss) and not self.gpu.is_device(self._tr_loss)
        return loss


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clipping", "norm-only"])
def test_the_loss_checks_allocate_no_device_memory_and_the_next_allocation_is_protected(
    tmp_path: Path, max_grad_norm: float
) -> None:
    """The NaN/Inf check and the running loss work on a host tensor, so the fault armed before them strikes the
    next device allocation: the clipping (or, without clipping, the gradient norm the Trainer logs), recovered."""
    reference, plain = train_plain(tmp_path / "plain")
    FaultAfterTheLoss.armed = False
    if max_grad_norm == 0.0:
        reference, plain = _plain_without_clipping(tmp_path / "plain0")
    model, trainer = train_guarded(tmp_path / "guarded", FaultAfterTheLoss, max_grad_norm=max_grad_norm)
    (oom,) = oom_events(trainer)
    assert oom.error.phase == "clip" and oom.step == 1
    assert_same_training(model, trainer, reference, plain)
    assert trainer.oomguard.summary().recovered_steps == 1


def _plain_without_clipping(folder: Path) -> tuple[torch.nn.Module, Any]:
    model = make_llama(layers=2, hidden=64)
    trainer = transformers.Trainer(
        model=model, args=training_args(folder, max_grad_norm=0.0), train_dataset=RaggedText()
    )
    trainer.train()
    return model, trainer


class FaultInTheOptimizer(OOMGuardTrainer):
    armed = False

    def create_optimizer(self) -> Any:
        optimizer = super().create_optimizer()

        def arm(*_: Any) -> None:
            if self.state.global_step == 2 and not self.armed:
                type(self).armed = True
                self.gpu.fail_allocation(1)

        optimizer.register_step_pre_hook(arm)
        return optimizer


def test_a_replayed_optimizer_step_counts_as_one_recovered_step(tmp_path: Path) -> None:
    """4 steps, one OOM in the optimizer step: 4 steps, 1 OOM, 1 recovered (not 5 steps and 0 recovered), and
    every event of the replay names the Trainer's step."""
    reference, plain = train_plain(tmp_path / "plain")
    FaultInTheOptimizer.armed = False
    # (A fault injected into a step the guard judged safe to run without its journal could not be undone: the
    # journal is forced, as a real OOM in the step is only possible where it was judged unsafe.)
    model, trainer = train_guarded(tmp_path / "guarded", FaultInTheOptimizer, oomguard={"step_journal": "always"})
    assert FaultInTheOptimizer.armed
    summary = trainer.oomguard.summary()
    assert (summary.steps, summary.ooms, summary.recovered_steps) == (4, 1, 1), summary.describe()
    assert {e.step for e in trainer.oomguard.events if e.kind in ("oom", "fallback", "recovered")} == {2}
    assert_same_training(model, trainer, reference, plain)


def test_a_subclass_listed_before_the_guard_is_refused_with_the_fix() -> None:
    class Other(transformers.Trainer):  # type: ignore[misc]
        pass

    with pytest.raises(TypeError, match=r"class Wrong\(OOMGuardTrainer, Other\)"):

        class Wrong(Other, OOMGuardTrainer):
            pass

    class Right(OOMGuardTrainer, Other):  # the order a user writes: accepted
        pass
