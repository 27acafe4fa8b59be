"""PyTorch Lightning through ``oomguard.integrations.lightning``: manual optimization with ``guarded_step`` trains
as automatic optimization trains the same module unguarded, through a recovered OOM; the plan goes into Lightning's
checkpoints and comes back with them; fallbacks reach the Trainer's loggers; what the guard cannot run is refused."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import make_mlp

from oomguard import GuardConfigError, Plan
from oomguard.testing import SimulatedGPU

L = pytest.importorskip("lightning.pytorch")

pytestmark = pytest.mark.integration  # Lightning's Trainer end to end

from lightning.pytorch.loggers import Logger  # noqa: E402

from oomguard.integrations.lightning import OOMGuardCallback, guarded_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BATCH, STEPS = 64, 3
TIGHT = "192KiB"  # the MLP's whole batch of 64 does not fit with AdamW's state; micro-batches of 16 do
ROOMY = "64MiB"
EXACT = ["micro_batch"]  # (the default ladder's first plan here is bf16: a different sum, by design)


class Regression(L.LightningModule):  # type: ignore[misc,name-defined]
    """An MLP on a regression, with AdamW and a warmup stepped per batch: trained by Lightning's automatic
    optimization (``guarded=False``, no guard anywhere) or through ``guarded_step``."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.automatic_optimization = not guarded
        self.net = make_mlp(width=256)
        self.results: list[Any] = []

    def loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> Any:
        if self.automatic_optimization:
            return self.loss(batch)
        self.results.append(guarded_step(self, batch, self.loss))
        return None

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
        return [optimizer], [{"scheduler": warmup, "interval": "step"}]


class Recorded(Logger):  # type: ignore[misc]
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorded"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step, dict(metrics)))


def loader(samples: int = BATCH * STEPS) -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 16, generator=generator), torch.randn(samples))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def trainer(steps: int = STEPS, **kwargs: Any) -> Any:
    kwargs.setdefault("logger", False)
    options = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, **options, **kwargs)


def fit_guarded(budget: str, module: Regression, callback: OOMGuardCallback, **kwargs: Any) -> Any:
    ckpt_path = kwargs.pop("ckpt_path", None)
    fitting = trainer(callbacks=[callback], **kwargs)
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(module)
        fitting.fit(module, loader(), ckpt_path=ckpt_path)
    return fitting


def fit_automatic(**kwargs: Any) -> tuple[Regression, Any]:
    module = Regression(guarded=False)
    fitting = trainer(**kwargs)
    fitting.fit(module, loader())
    return module, fitting


def oom_once_in_the_optimizer_step(module: Regression) -> None:
    """The optimizer's first step runs out of memory once, before it changes anything (as a device would)."""
    fired = [False]

    def oom(*args: Any) -> None:
        if not fired[0]:
            fired[0] = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")

    def hook() -> None:
        module.trainer.optimizers[0].register_step_pre_hook(oom)

    module.on_fit_start = hook  # type: ignore[method-assign]


@pytest.mark.parametrize("where", ["forward", "optimizer step"])
def test_guarded_training_equals_automatic_optimization_after_a_recovered_oom(where: str) -> None:
    """The whole batch runs out of memory in its forward (under a tight SimulatedGPU) and is split, or the
    optimizer step runs out once and the batch's gradients are recomputed: either way the weights, the global step
    and the scheduler's learning rate equal Lightning's automatic optimization unguarded (fp32, within 1e-5), with
    Lightning's clipping against the callback's."""
    reference, plain = fit_automatic(gradient_clip_val=0.5)
    module = Regression(guarded=True)
    callback = OOMGuardCallback(max_grad_norm=0.5, ladder=EXACT)
    if where == "optimizer step":
        oom_once_in_the_optimizer_step(module)
    fitted = fit_guarded(TIGHT if where == "forward" else ROOMY, module, callback)

    first = module.results[0]
    assert first.ooms == 1 and callback.guard is not None and callback.guard.summary().recovered_steps == 1
    assert first.micro_batches > 1  # (after an OOM in the optimizer step too: the ladder here has that rung alone)
    assert [r.ooms for r in module.results[1:]] == [0] * (STEPS - 1)
    assert fitted.global_step == plain.global_step == STEPS
    assert fitted.lr_scheduler_configs[0].scheduler.last_epoch == STEPS
    assert fitted.optimizers[0].param_groups[0]["lr"] == plain.optimizers[0].param_groups[0]["lr"]
    for (name, value), trained in zip(reference.state_dict().items(), module.state_dict().values(), strict=True):
        torch.testing.assert_close(trained, value, rtol=1e-5, atol=1e-5, msg=name)


def test_a_scheduler_stepped_each_epoch_is_stepped_as_automatic_optimization_steps_it() -> None:
    """``configure_optimizers`` returning bare schedulers (Lightning's default: ``"epoch"``, every epoch): stepped
    after each epoch's last batch, as the automatic loop steps it; manual optimization alone would never step it."""

    class Epochly(Regression):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    reference, plain = Epochly(guarded=False), trainer(steps=-1, max_epochs=2)
    plain.fit(reference, loader())
    module = Epochly(guarded=True)
    fitted = fit_guarded(ROOMY, module, OOMGuardCallback(), steps=-1, max_epochs=2)
    assert fitted.global_step == plain.global_step == 2 * STEPS
    assert fitted.lr_scheduler_configs[0].scheduler.last_epoch == 2
    assert fitted.optimizers[0].param_groups[0]["lr"] == plain.optimizers[0].param_groups[0]["lr"] == 0.025
    for trained, value in zip(module.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(trained, value, rtol=1e-6, atol=1e-6)


def test_fallbacks_reach_the_trainers_loggers_at_the_step_they_happened() -> None:
    module, recorded = Regression(guarded=True), Recorded()
    fit_guarded(TIGHT, module, OOMGuardCallback(ladder=EXACT), logger=recorded)
    ours = [(step, metrics) for step, metrics in recorded.metrics if "oomguard/ooms" in metrics]
    assert len(ours) == 1, recorded.metrics  # the step that changed the plan, not every step
    step, metrics = ours[0]
    assert step == 0  # the first batch's: where Lightning logs that batch's self.log values
    assert metrics["oomguard/ooms"] == 1.0
    assert metrics["oomguard/micro_batches"] == module.results[0].micro_batches > 1
    assert metrics["oomguard/rung/micro_batch"] == 1.0


def test_the_checkpoint_holds_the_plan_and_a_resumed_trainer_starts_on_it(tmp_path: Path) -> None:
    module, callback = Regression(guarded=True), OOMGuardCallback(ladder=EXACT)
    fitted = fit_guarded(TIGHT, module, callback)
    settled = module.results[-1].plan
    assert settled.micro_batch_size is not None and settled.micro_batch_size < BATCH
    path = tmp_path / "last.ckpt"
    fitted.save_checkpoint(path)

    saved = torch.load(path, weights_only=True)["callbacks"]["OOMGuardCallback"]
    assert [Plan.from_dict(plan) for plan in saved["plans"].values()] == [settled]  # (one batch size: one bucket)

    resumed, again = Regression(guarded=True), OOMGuardCallback(ladder=EXACT)
    fit_guarded(TIGHT, resumed, again, steps=STEPS + 1, ckpt_path=str(path))
    assert len(resumed.results) == 1, "the resumed fit runs the one step past the checkpoint"
    assert resumed.results[0].ooms == 0 and resumed.results[0].plan == settled


def test_automatic_optimization_is_refused_naming_the_manual_shape() -> None:
    fitting = trainer(callbacks=[OOMGuardCallback()])
    with pytest.raises(GuardConfigError) as refused:
        fitting.fit(Regression(guarded=False), loader())
    message = str(refused.value)
    assert "automatic optimization" in message and "self.automatic_optimization = False" in message
    assert "guarded_step(self, batch" in message and "no manual_backward" in message


def test_guarded_step_without_the_callback_names_it() -> None:
    with pytest.raises(GuardConfigError, match=r"needs one OOMGuardCallback.*callbacks=\[OOMGuardCallback"):
        trainer().fit(Regression(guarded=True), loader())


def test_a_scheduler_stepped_in_training_step_as_well_is_refused() -> None:
    """Lightning's manual optimization teaches ``scheduler.step()`` in ``training_step``; the guard steps it
    already, and a second step would go unseen."""

    class SteppingItself(Regression):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> Any:
            super().training_step(batch, batch_idx)
            self.lr_schedulers().step()  # type: ignore[union-attr]

    with pytest.raises(GuardConfigError, match=r"stepped outside guarded_step.*Remove your scheduler\.step"):
        fit_guarded(ROOMY, SteppingItself(guarded=True), OOMGuardCallback())


def test_lightnings_fp16_loss_scaling_is_refused_naming_bf16() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    fp16 = MixedPrecision("16-mixed", "cpu")  # (precision="16-mixed" on a CPU is bf16: the plugin itself, then)
    with pytest.raises(GuardConfigError, match=r"16-mixed.*scales the loss.*bf16-mixed"):
        trainer(callbacks=[OOMGuardCallback()], plugins=[fp16]).fit(Regression(guarded=True), loader())


def test_amp_on_the_ladder_beside_lightnings_bf16_autocast_is_refused() -> None:
    fitting = trainer(callbacks=[OOMGuardCallback(ladder=["micro_batch", "amp"])], precision="bf16-mixed")
    with pytest.raises(GuardConfigError, match=r"bf16-mixed.*remove 'amp'"):
        fitting.fit(Regression(guarded=True), loader())


def test_the_callbacks_options_leave_lightnings_parts_to_lightning() -> None:
    with pytest.raises(GuardConfigError, match="optimizer"):
        OOMGuardCallback(optimizer=torch.optim.SGD(make_mlp().parameters(), lr=0.1))


def test_the_lightning_extra_installs_lightning_and_ci_has_it() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = config["options.extras_require"]
    names = {extra: {line.split(">")[0].strip() for line in extras[extra].splitlines()} for extra in extras}
    assert "lightning" in names["lightning"]
    assert "lightning" in names["test"], "CI installs the test extra: these tests run there"


@pytest.mark.subprocess
def test_without_lightning_the_import_names_the_extra_in_one_line() -> None:
    code = (
        "import sys; sys.modules.update(dict.fromkeys(('lightning', 'pytorch_lightning')))\n"
        "import oomguard.integrations.lightning\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: oomguard.integrations.lightning (guarded_step, OOMGuardCallback) needs lightning, which is not "
        "installed: pip install 'oomguard[lightning]'"
    )
