"""What Lightning's automatic optimization does around a training step, done by :func:`guarded_step` under manual
optimization: the optimizer step through the ``LightningOptimizer``, the schedulers ``configure_optimizers``
returned, stepped as automatic optimization steps them, and the plan reported to the Trainer's loggers.

Under manual optimization Lightning steps no scheduler (its ``_update_learning_rates`` returns at once): the user is
to call ``scheduler.step()`` in ``training_step``. The guard steps them instead, as the automatic loop would, so that
a module converted from automatic optimization changes its ``training_step`` and nothing else: a ``"step"``
scheduler after each optimizer step, every ``frequency``-th batch of the epoch; an ``"epoch"`` one after the epoch's
last batch, every ``frequency``-th epoch; each through the module's ``lr_scheduler_step`` hook. ``ReduceLROnPlateau``
waits on a metric the loop collects after validation and is left to the user, as in manual optimization.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["check_schedulers_untouched", "log_plan", "optimizer_step", "step_epoch_schedulers", "step_schedulers"]

#: Each scheduler the guard stepped (by identity), with its ``last_epoch`` after that step.
Stepped = dict[int, Any]


def optimizer_step(module: pl.LightningModule) -> Callable[[], None]:
    """The optimizer step as manual optimization takes it, through the ``LightningOptimizer``: its hooks
    (``on_before_optimizer_step``), the strategy's and precision's step, the profiler, and the count behind
    ``trainer.global_step``. A step that raises (the guard undoes it) is not counted, and its profiler action is
    closed, so that the retry counts and times one step."""
    optimizer = module.optimizers()
    progress = module.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    profiler = module.trainer.profiler  # type: ignore[attr-defined]  # (set in Trainer.__init__, not declared)

    def run() -> None:
        before, stepped = progress.state_dict(), False
        try:
            optimizer.step()  # type: ignore[union-attr]  # (one optimizer: _check refused more)
            stepped = True
        finally:
            if not stepped:
                progress.load_state_dict(before)
                with contextlib.suppress(ValueError):  # (a profiler that never started it: nothing to close)
                    profiler.stop("optimizer_step")

    return run


def step_schedulers(trainer: pl.Trainer, module: pl.LightningModule) -> Stepped:
    """The ``"step"`` schedulers due after this batch's optimizer step (as the automatic loop counts batches)."""
    return _step(trainer, module, "step", trainer.fit_loop.epoch_loop.batch_idx + 1)


def step_epoch_schedulers(trainer: pl.Trainer, module: pl.LightningModule) -> Stepped:
    """The ``"epoch"`` schedulers due, after the epoch's last batch (where the automatic loop steps them)."""
    loop = trainer.fit_loop.epoch_loop
    last = loop.batch_progress.current.ready == trainer.num_training_batches or loop.batch_progress.is_last_batch
    return _step(trainer, module, "epoch", trainer.current_epoch + 1) if last else {}


def _step(trainer: pl.Trainer, module: pl.LightningModule, interval: str, index: int) -> Stepped:
    stepped: Stepped = {}
    for config in trainer.lr_scheduler_configs:
        if config.reduce_on_plateau or config.interval != interval or index % config.frequency:
            continue
        module.lr_scheduler_step(config.scheduler, None)
        stepped[id(config.scheduler)] = getattr(config.scheduler, "last_epoch", None)
    return stepped


def check_schedulers_untouched(trainer: pl.Trainer, stepped: Stepped) -> None:
    """Refuse a scheduler stepped since the guard stepped it (``scheduler.step()`` in ``training_step``, as
    Lightning's manual optimization teaches): it would be stepped twice a step, in silence."""
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if id(scheduler) in stepped and getattr(scheduler, "last_epoch", None) != stepped[id(scheduler)]:
            raise GuardConfigError(
                f"the {type(scheduler).__name__} from configure_optimizers was stepped outside guarded_step: the "
                f"guard steps the schedulers itself, as automatic optimization does (interval and frequency as "
                f"configured). Remove your scheduler.step() call, or it steps twice per optimizer step"
            )


def log_plan(trainer: pl.Trainer, plan: Plan, ooms: int, size: int, shown: set[str]) -> set[str]:
    """``plan`` (on a batch of ``size``) and the OOMs caught so far, to every logger of the Trainer at this step,
    as Lightning's own monitors log (its count of batches that stepped). ``shown``: the rungs the last report
    engaged, reported 0 if given back. Returns the rungs this report engaged."""
    rungs = set(plan.rungs(size))
    metrics = {"oomguard/ooms": float(ooms), "oomguard/micro_batches": float(plan.micro_batches(size))}
    metrics.update({f"oomguard/rung/{name}": float(name in rungs) for name in sorted(rungs | shown)})
    step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
    return rungs
