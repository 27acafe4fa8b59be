"""PyTorch Lightning: ``guarded_step`` inside a LightningModule's ``training_step``, and ``OOMGuardCallback``.

Lightning's automatic optimization cannot be guarded: its loop runs forward, backward and the optimizer step inside
one closure, and no hook can catch an out-of-memory error there and retry the batch (``on_exception`` runs while
the Trainer tears down). Under manual optimization ``training_step`` owns the step, so the guard can own it: the
module sets ``self.automatic_optimization = False`` and hands each batch, with a forward-only loss function, to
:func:`guarded_step`. The guard then runs forward and backward (split into micro-batches, and further down its
ladder, only when memory requires it), Lightning's optimizer step (through the ``LightningOptimizer``: its hooks,
profiler and ``global_step`` count), and the schedulers ``configure_optimizers`` returned, as automatic optimization
would step them. An OOM anywhere in it is recovered inside the same ``training_step``, on the same batch: exactly
one optimizer step per call.

:class:`OOMGuardCallback` takes the guard's options, keeps its plans in Lightning's checkpoints (a resumed job
starts on the plan it had settled on) and logs its fallbacks through the Trainer's loggers: a few metrics at the
step an OOM changed the plan, not a line per OOM.

Example::

    from oomguard.integrations.lightning import OOMGuardCallback, guarded_step

    class LitLM(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.automatic_optimization = False       # the guard runs backward and the optimizer step
            self.model = model

        def training_step(self, batch, batch_idx):
            result = guarded_step(self, batch, lambda part: self.model(**part).loss)
            self.log("train_loss", result.loss)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    trainer = L.Trainer(max_steps=1000, callbacks=[OOMGuardCallback(log_file="oomguard.jsonl")])
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
except ImportError as error:  # say which extra installs it
    from oomguard._extras import missing

    raise missing(
        "lightning", extra="lightning", purpose="oomguard.integrations.lightning (guarded_step, OOMGuardCallback)"
    ) from error

from oomguard._errors import GuardConfigError
from oomguard._events import Event
from oomguard._guard.guard import OOMGuard
from oomguard._guard.results import StepResult
from oomguard._ladder.ladder import resolve_ladder
from oomguard._ladder.plan import Phase, Plan
from oomguard._step.batch import default_item_counter
from oomguard.integrations._lightning_loop import (
    Stepped,
    check_schedulers_untouched,
    log_plan,
    optimizer_step,
    step_epoch_schedulers,
    step_schedulers,
)
from oomguard.integrations._rollback import PlainState

__all__ = ["OOMGuardCallback", "guarded_step"]

logger = logging.getLogger("oomguard")

# What Lightning owns: the model, its optimizer and schedulers, the Accelerator's part (precision and backward).
_LIGHTNING_OWNS = frozenset({"model", "optimizer", "scheduler", "accelerator"})
# The events after which the loggers hear of the plan: it changed, or an OOM was caught.
_PLAN_EVENTS = frozenset({"oom", "fallback", "recovered", "relax", "retry", "tuned"})
_STATE_VERSION = 1


def guarded_step(module: pl.LightningModule, batch: Any, forward: Callable[[Any], Any]) -> StepResult:
    """One guarded training step of ``module`` on ``batch``: call it from ``training_step`` under manual
    optimization, with the Trainer's :class:`OOMGuardCallback`.

    ``forward`` takes a batch (the whole one, or a micro-batch of it) and returns its loss (a tensor, a mapping with
    ``"loss"``, or an object with ``.loss``): forward only, no ``manual_backward``, no optimizer call. The guard runs
    backward, the clipping (``max_grad_norm=`` on the callback), the optimizer step through Lightning's
    ``LightningOptimizer`` and the schedulers' step, then drops the gradients; on an out-of-memory error it retries
    the same batch on a plan that needs less memory, as :func:`oomguard.oom_guard` does. Under DDP every micro-batch
    runs without DDP's collectives and the gradients are averaged once, after every rank's backward worked.

    Log from the result (``self.log("train_loss", result.loss)``), not inside ``forward``: ``forward`` runs once per
    micro-batch and again after an OOM. Returns the step's :class:`~oomguard.StepResult`: ``loss`` is the whole
    batch's, ``ooms`` the OOMs caught in this call, ``grad_norm`` the norm before clipping (where it clips).
    """
    callbacks = [c for c in module.trainer.callbacks if isinstance(c, OOMGuardCallback)]  # type: ignore[attr-defined]
    if len(callbacks) != 1:
        raise GuardConfigError(
            f"guarded_step needs one OOMGuardCallback on the Trainer (it holds the guard, its options and its plans), "
            f"found {len(callbacks)}: L.Trainer(..., callbacks=[OOMGuardCallback(log_file='oomguard.jsonl')])"
        )
    return callbacks[0].step(module, batch, forward)


class OOMGuardCallback(pl.Callback):
    """The guard behind :func:`guarded_step`: its options, its plans in Lightning's checkpoints, its fallbacks in
    Lightning's loggers.

    Args:
        max_grad_norm: clip the gradient norm of the whole batch to this before the optimizer step (Lightning refuses
            ``Trainer(gradient_clip_val=...)`` under manual optimization).
        **options: the options of :func:`oomguard.oom_guard` (``log_file``, ``state_file``, ``ladder``,
            ``relax_after``...); the model, optimizer and schedulers are Lightning's. ``count_items`` defaults to the
            counted ``labels`` tokens where the module holds a transformers causal LM.

    The guard is built at the first training step of each ``fit`` (``.guard``), after Lightning has set up the
    strategy and restored the checkpoint, and undoes its plan's effects on the model when ``fit`` ends. The plans are
    kept in the callback's state (``checkpoint["callbacks"]["OOMGuardCallback"]``): a job resumed from a checkpoint
    starts every batch on the plan of its largest batch bucket, the one that needed the most memory, and steps back up
    after clean steps as usual. When a step runs out of memory, the loggers get ``oomguard/ooms`` (OOMs caught so
    far), ``oomguard/micro_batches`` and ``oomguard/rung/<name>`` (1 for each rung the plan engages; 0 for one it
    gave back) at that step.
    """

    def __init__(self, *, max_grad_norm: float | None = None, **options: Any) -> None:
        reserved = sorted(_LIGHTNING_OWNS & set(options))
        if reserved:
            raise GuardConfigError(f"OOMGuardCallback takes {reserved} from Lightning; remove them from its options")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise GuardConfigError(f"max_grad_norm must be positive (or None: no clipping), got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        self.options = options
        #: The guard of this ``fit`` (of the last one, once it ended), built at its first training step.
        self.guard: OOMGuard | None = None
        self._live = False  # whether .guard is this fit's
        self._plans: dict[int, Plan] = {}  # kept across fits, and from a checkpoint until the guard takes them
        self._restored = False
        self._forward: Callable[[Any], Any] | None = None  # this call's loss function (see _loss)
        self._ooms = 0
        self._plan_changed = False
        self._logged_rungs: set[str] = set()
        self._size = 0  # the last step's batch size (for the rungs the loggers hear of)
        self._scheduler_epochs: Stepped = {}  # each scheduler's last_epoch after the guard stepped it

    # -- Lightning's hooks --------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse what the guard cannot run before the first step: automatic optimization, a strategy other than
        one device or DDP, several optimizers, fp16 mixed precision (Lightning scales that loss itself)."""
        _check(trainer, pl_module, self.options.get("ladder"))
        if any(config.reduce_on_plateau for config in trainer.lr_scheduler_configs):
            logger.warning(
                "oomguard: guarded_step steps the schedulers of configure_optimizers as automatic optimization "
                "would, except ReduceLROnPlateau, which waits on a metric: step it yourself, as manual optimization "
                "asks (e.g. in on_validation_epoch_end, with the metric it monitors)"
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is not None and self._plan_changed:
            self._logged_rungs = log_plan(trainer, self.guard.plan, self._ooms, self._size, self._logged_rungs)
            self._plan_changed = False
        self._scheduler_epochs.update(step_epoch_schedulers(trainer, pl_module))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The guard's effects undone (the model as it was given); its plans kept for the next ``fit``, which builds
        a guard of its own (over the optimizer it configures). ``.guard`` stays readable (its ``summary()``)."""
        if self.guard is None or not self._live:
            return
        self._plans, self._live = self.guard.plans, False
        self.guard.effects.undo(logged=True)

    def state_dict(self) -> dict[str, Any]:
        """The plans per batch bucket, as plain data (a checkpoint loads it with ``weights_only=True``)."""
        plans = self.guard.plans if self.guard is not None and self._live else self._plans
        return {"version": _STATE_VERSION, "plans": {str(bucket): plan.to_dict() for bucket, plan in plans.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The plans of a checkpoint, for the next guard to start on; an unreadable entry is skipped, said once."""
        plans: dict[int, Plan] = {}
        try:
            for bucket, plan in dict(state_dict.get("plans", {})).items():
                plans[int(bucket)] = Plan.from_dict(plan)
        except (TypeError, ValueError) as error:
            logger.warning("oomguard: the checkpoint's plans are unreadable (%s); starting on the plain plan", error)
            plans = {}
        self._plans, self._restored = plans, bool(plans)

    # -- the step -----------------------------------------------------------------------------------
    def step(self, module: pl.LightningModule, batch: Any, forward: Callable[[Any], Any]) -> StepResult:
        """:func:`guarded_step`'s work (see there)."""
        guard = self.guard if self.guard is not None and self._live else self._build(module)
        trainer = module.trainer
        check_schedulers_untouched(trainer, self._scheduler_epochs)
        self._forward, ooms = forward, self._ooms
        result = guard.accumulate(batch, rewind=PlainState(module).restore)
        norm = None

        def replay(clip: bool) -> None:  # the batch's gradients on the guard's new plan, after an OOM past them
            before = PlainState(module)
            try:
                guard.accumulate(batch)
                if clip and self.max_grad_norm is not None:
                    guard.protected_step(_clip(guard, self.max_grad_norm), lambda: replay(False), phase=Phase.CLIP)
            finally:
                before.restore()  # (the step's own attempt counted the batch already)

        if self.max_grad_norm is not None:
            norm = guard.protected_step(_clip(guard, self.max_grad_norm), lambda: replay(False), phase=Phase.CLIP)
        guard.protected_step(optimizer_step(module), lambda: replay(True), phase=Phase.OPTIMIZER)
        module.zero_grad(set_to_none=True)  # (their memory back before the next step, validation or checkpoint)
        self._scheduler_epochs.update(step_schedulers(trainer, module))
        plan, size = guard.plan, result.batch_size
        self._size = size
        return dataclasses.replace(
            result,
            ooms=self._ooms - ooms,
            plan=plan,
            rungs=plan.rungs(size),
            micro_batch_size=plan.effective_micro_batch_size(size),
            micro_batches=plan.micro_batches(size) if plan != result.plan else result.micro_batches,
            grad_norm=norm,
        )

    def _build(self, module: pl.LightningModule) -> OOMGuard:
        """The guard over this fit's model and optimizer (the strategy's model: DDP's wrapper under DDP, which the
        guard keeps quiet and averages once), started on the checkpoint's or the last fit's plans."""
        trainer = module.trainer
        model = _check(trainer, module, self.options.get("ladder"))
        options = dict(self.options)
        options["sinks"] = [*options.get("sinks", ()), self._heard]
        if options.get("ladder") is None and isinstance(trainer.precision_plugin, MixedPrecision):
            options["ladder"] = [name for name in resolve_ladder(None).names if name != "amp"]  # (Lightning's)
        if options.get("count_items") is None:
            options["count_items"] = default_item_counter(_causal_lm(module))
        optimizer = trainer.optimizers[0]
        self.guard = OOMGuard(self._loss, model=model, optimizer=optimizer, **options)
        self._live = True
        if self._plans:
            self.guard.plan = self._plans[max(self._plans)]  # (the largest bucket's: the most memory a batch needed)
            if self._restored:
                logger.info("oomguard: starting on the checkpoint's plan: %s", self.guard.plan.describe())
        self._restored = False
        return self.guard

    def _loss(self, part: Any) -> Any:
        """The guard's step function: this call's ``forward`` (the guard calls it only during :meth:`step`)."""
        if self._forward is None:
            raise GuardConfigError("the guard's forward runs only inside guarded_step")
        return self._forward(part)

    def _heard(self, event: Event) -> None:
        """Every event of the guard: an OOM, or a change of plan, is logged at the end of the step."""
        if event.kind == "oom":
            self._ooms += 1
        if event.kind in _PLAN_EVENTS:
            self._plan_changed = True


def _clip(guard: OOMGuard, limit: float) -> Callable[[], float]:
    """The clipping of the optimizer's gradients to ``limit``, as Lightning's ``gradient_clip_val`` clips them."""
    params = [p for group in guard.optimizer.param_groups for p in group["params"]]

    def clip() -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, limit))

    return clip


def _causal_lm(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside ``module`` (whose loss compares ``labels[:, 1:]``), or ``module`` itself."""
    for inner in module.modules():
        if any(kind.__name__.endswith(("ForCausalLM", "LMHeadModel")) for kind in type(inner).__mro__):
            return inner
    return module


def _check(trainer: pl.Trainer, module: pl.LightningModule, ladder: Any) -> torch.nn.Module:
    """The model the guard runs under this Trainer (``module``, or DDP's wrapper of it); what the guard cannot run
    is refused, naming the fix."""
    if module.automatic_optimization:
        raise GuardConfigError(
            f"{type(module).__name__} uses Lightning's automatic optimization, whose loop runs backward and the "
            f"optimizer step where no hook can catch an out-of-memory error and retry the batch. Switch to manual "
            f"optimization and let the guard own the step: set `self.automatic_optimization = False` in __init__, "
            f"and in training_step call `result = guarded_step(self, batch, lambda part: <your loss of part>)` "
            f"(no manual_backward, no optimizer.step(): the guard runs both)"
        )
    model = trainer.strategy.model
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.module is module
    if model is None or (model is not module and not wrapped):
        raise GuardConfigError(
            f"oomguard's Lightning integration runs on one device or under DDP (strategy='ddp'); this Trainer's "
            f"{type(trainer.strategy).__name__} wraps the module in {type(model).__name__}"
        )
    if len(trainer.optimizers) != 1:
        raise GuardConfigError(
            f"guarded_step steps one optimizer per training_step; configure_optimizers returned "
            f"{len(trainer.optimizers)}: return one (with its schedulers)"
        )
    _check_precision(trainer.precision_plugin, ladder)
    return model


def _check_precision(plugin: Precision, ladder: Any) -> None:
    """Lightning's precision, where the guard can run beside it: fp32/fp64/half weights, or bf16 autocast."""
    if isinstance(plugin, MixedPrecision):
        if plugin.scaler is not None:
            raise GuardConfigError(
                "Lightning's precision='16-mixed' scales the loss inside manual_backward, which the guard replaces "
                "with its own backward: use precision='bf16-mixed', or '32-true' and let the guard's amp rung run "
                "fp16 with its own gradient scaler only when memory requires it"
            )
        if ladder is not None and "amp" in [getattr(rung, "name", rung) for rung in ladder]:
            raise GuardConfigError(
                "Lightning's precision='bf16-mixed' already runs the forward under autocast: the amp rung has "
                "nothing to add; remove 'amp' from ladder="
            )
    elif type(plugin) not in (Precision, DoublePrecision, HalfPrecision):
        raise GuardConfigError(
            f"oomguard's Lightning integration runs with precision '32-true', '64-true', 'bf16-true', '16-true' or "
            f"'bf16-mixed'; this Trainer's {type(plugin).__name__} is not one of them"
        )
