"""``OOMGuardTrainer``: the Hugging Face Trainer with oomguard's recovery, as a drop-in subclass.

``per_device_train_batch_size`` stays the effective batch. Every allocation of a training step is protected: the
forward and backward (the Trainer's ``compute_loss``, through the guard, split into micro-batches and deeper rungs
when memory requires it), the loss checks, the clipping and the optimizer step. An OOM anywhere in it is recovered
inside the same call, on the same batch, one rung down: the training loop is not restarted, and ``global_step``,
the optimizer and the scheduler see exactly one step. An OOM in the clipping or the optimizer step (undone first)
recomputes the batch's gradients on a plan that needs less memory and runs that part again.

Any Trainer subclass composes, with ``OOMGuardTrainer`` first: ``class MyTrainer(OOMGuardTrainer, SFTTrainer)``.
The subclass's own ``training_step`` and ``compute_loss`` still run (TRL's activation-offloading context included);
what a failed attempt added to the trainer's plain-data attributes (TRL's ``_metrics``, token counts, your own
counters) is taken back before the retry, so logged metrics are those of a run without OOMs. TRL's preference
batches (DPO, reward models) are split pair by pair (:mod:`oomguard.integrations._pairs`), and GRPO's loss types
weighed as each needs (:mod:`oomguard.integrations._losses`).

Losses stay exact: when the model normalises its loss by ``num_items_in_batch`` (token-weighted, the
Trainer's default for causal LMs), the micro-batch losses are summed; otherwise each micro-batch's mean is
weighted by its share of the counted tokens.

Example::

    from oomguard.integrations.transformers import OOMGuardTrainer

    trainer = OOMGuardTrainer(model=model, args=args, train_dataset=dataset,
                              oomguard={"log_file": "oomguard.jsonl", "state_file": "plans.json"})
    trainer.train()
    print(trainer.oomguard.summary())
"""

from __future__ import annotations

import copy
import logging
import types
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._subclasses.fake_tensor import is_fake

try:
    from transformers import Trainer
    from transformers.training_args import ParallelMode
except ImportError as error:  # say which extra installs it
    from oomguard._extras import missing

    raise missing("transformers", extra="hf", purpose="oomguard.integrations.transformers (OOMGuardTrainer)") from error

from oomguard._backends.memory import current_backend
from oomguard._effects.chunked_loss import ChunkedLoss
from oomguard._errors import GuardConfigError
from oomguard._guard.guard import OOMGuard
from oomguard._ladder.plan import Phase
from oomguard._step.batch import batch_leaves, batch_size
from oomguard._step.runner import Reduction
from oomguard.integrations._losses import batch_coupled, completion_tokens, weighting
from oomguard.integrations._pairs import chosen_then_rejected, collates_pairs, pair_major
from oomguard.integrations._rollback import PlainState

__all__ = ["OOMGuardTrainer"]

logger = logging.getLogger("oomguard")

# The Trainer's own parts of a step: its model, optimizer and scheduler, its clipping, its loss reduction, and its
# Accelerator (which runs backward and mixed precision).
_TRAINER_OWNS = frozenset({"model", "optimizer", "scheduler", "max_grad_norm", "reduction", "accelerator"})
R = TypeVar("R")


@dataclass
class _StepInProgress:
    """The training step in progress, for a replay: its model, batch and item count."""

    model: Any = None
    inputs: Any = None
    items: Any = None
    paired: frozenset[str] = frozenset()  # the keys of a preference batch viewed one pair per row
    size: int = 0  # samples in the batch the guard is given
    warned: bool = False  # that micro-batches change this trainer's loss (here: a rollback leaves it alone)
    replaying: bool = False


class OOMGuardTrainer(Trainer):  # type: ignore[misc]
    """A :class:`transformers.Trainer` whose training steps survive out-of-memory errors.

    Args:
        oomguard: options for the guard, as for :func:`oomguard.oom_guard` (``log_file``, ``state_file``,
            ``ladder``, ``relax_after``...). The model, optimizer, scheduler, clipping and reduction are the
            Trainer's.
        *args, **kwargs: as for :class:`transformers.Trainer` (or the Trainer subclass it is combined with).

    Attributes:
        oomguard_pairs: whether each batch holds preference pairs as TRL's DPO and reward trainers collate them
            (every chosen sequence, then every rejected one): micro-batches then take whole pairs, in that
            layout, so that the loss pairs the right rows. Set from the collator (TRL's preference collators and
            their subclasses); set it yourself for a collator of your own that lays pairs out that way.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        ahead = [k for k in mro[1 : mro.index(OOMGuardTrainer)] if issubclass(k, Trainer)]
        ahead = [k for k in ahead if not issubclass(k, OOMGuardTrainer)]
        if ahead:
            other = ahead[0].__name__
            raise TypeError(
                f"{cls.__name__} lists {other} before OOMGuardTrainer, so {other}'s training_step and compute_loss "
                f"would run unguarded (and {other}.__init__ does not take oomguard=): write "
                f"class {cls.__name__}(OOMGuardTrainer, {other}), OOMGuardTrainer first"
            )

    def __init__(self, *args: Any, oomguard: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise GuardConfigError(
                f"OOMGuardTrainer needs gradient_accumulation_steps=1 (got {self.args.gradient_accumulation_steps}): "
                f"set per_device_train_batch_size to the effective batch and oomguard splits it into "
                f"micro-batches itself, with exact accumulation, only when memory requires it"
            )
        reserved = sorted(_TRAINER_OWNS & set(oomguard or {}))
        if reserved:
            raise GuardConfigError(f"OOMGuardTrainer sets {reserved} itself; remove them from oomguard=")
        self._oomguard_options = dict(oomguard or {})
        self._guard: OOMGuard | None = None
        self._oomguard_step = _StepInProgress()  # (not plain data: what a failed attempt puts back leaves it alone)
        self.oomguard_pairs: bool = collates_pairs(self.data_collator)
        self._oomguard_weighting = weighting(self)  # (GRPO's loss types; None: the Trainer's rule)
        self._oomguard_coupled = batch_coupled(self)  # (why micro-batches change the loss: said once, when they do)

    @property
    def oomguard(self) -> OOMGuard:
        """The guard behind the training steps (its plan, events and ``summary()``), once training started."""
        if self._guard is None:
            raise RuntimeError("the guard is created by the first training step; call train() first")
        return self._guard

    def _build_guard(self, model: torch.nn.Module) -> OOMGuard:
        trainer = self

        def forward(part: Any) -> torch.Tensor:  # the class's compute_loss: the subclass's, under the stand-in
            compute_loss = getattr(type(trainer), "compute_loss")  # noqa: B009  (not the instance attribute)
            if trainer._oomguard_coupled and batch_size(part) < trainer._oomguard_step.size:
                trainer._warn_coupled(part)
            if trainer._oomguard_step.paired:
                part = chosen_then_rejected(part, trainer._oomguard_step.paired)
            if isinstance(part, MutableMapping):  # compute_loss pops the labels out of its inputs (label smoothing,
                part = copy.copy(part)  # compute_loss_func): from this attempt's own dict, the batch keeps them
            loss: torch.Tensor = compute_loss(trainer, model, part, num_items_in_batch=trainer._oomguard_step.items)
            return loss

        inner: Any = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer inside Accelerate's
        options = dict(self._oomguard_options)
        if self._oomguard_weighting == "tokens" and options.get("count_items") is None:
            options["count_items"] = completion_tokens
        guard = OOMGuard(forward, model=model, optimizer=inner, accelerator=self.accelerator, **options)
        accelerated_step = self.optimizer.step

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            trainer._protected(lambda: accelerated_step(*args, **kwargs), Phase.OPTIMIZER)
            optimizer._opt_called = True  # what the scheduler's own step tracker would record

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # (the scheduler checks for its tracker)
        self.optimizer.step = types.MethodType(step, self.optimizer)  # the Trainer's own call goes through it
        return guard

    def _loss_from_logits(self) -> str | None:
        """Why this trainer's loss leaves the chunked_loss rung nothing to save, if it does: with label smoothing
        or a ``compute_loss_func``, the Trainer's ``compute_loss`` takes the labels out of the inputs and computes
        the loss from ``outputs.logits`` itself (the model's own loss is never called), so the full logits exist."""
        if getattr(self, "label_smoother", None) is not None:
            factor = self.args.label_smoothing_factor
            return f"the Trainer's label smoothing (label_smoothing_factor={factor}) computes the loss from all logits"
        if getattr(self, "compute_loss_func", None) is not None:
            return "the Trainer's compute_loss_func computes the loss from the model's outputs (all logits)"
        return None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`transformers.Trainer.train`, after which the model is as it was given: whatever the guard's plan
        changed (offloaded state and layers, checkpointing, halved or quantized weights) is undone when training
        ends, however it ends (the plan is kept: the next ``train()`` starts on it). What cannot come back to the
        device for want of memory stays the guard's, with a warning saying what. While it trains, the chunked_loss
        rung is refused where this trainer computes the loss from the logits itself (:meth:`_loss_from_logits`)."""
        ChunkedLoss.refuse(self.model, self._loss_from_logits())  # (before the first step builds the guard)
        try:
            return super().train(*args, **kwargs)
        finally:
            ChunkedLoss.refuse(self.model, None)  # the model trained elsewhere may have the rung again
            if self._guard is not None:
                self._guard.effects.undo(logged=True)

    # -- the step -------------------------------------------------------------------------------------------
    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The Trainer's (or the subclass's) training step, its forward and backward run by the guard: the whole
        batch, split into micro-batches if memory requires it. Returns the loss as a host tensor (see
        :meth:`_stand_in`)."""
        if self._guard is None:
            self._guard = self._build_guard(model)
        self._keep_loss_on_host()
        self._oomguard_step.model = model
        self.compute_loss = self._guarded_loss  # (the instance attribute shadows every class's compute_loss)
        try:
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
            return loss
        finally:
            del self.compute_loss

    def _guarded_loss(
        self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """``compute_loss`` as the training step calls it: the guard's forward and backward of the whole batch,
        then the stand-in for the Trainer's own backward."""
        if return_outputs:
            raise GuardConfigError(
                "a training_step asked compute_loss for its outputs; under OOMGuardTrainer the forward may run in "
                "micro-batches, so there is no one output to return: compute what you need from the outputs in "
                "compute_loss itself"
            )
        self._oomguard_step.inputs, self._oomguard_step.items = inputs, num_items_in_batch
        # What a failed attempt added to the trainer's records is put back before the batch is tried again (taken
        # after _prepare_inputs: what it recorded, GRPO's rewards, stays). A replay puts back its own.
        rewind = None if self._oomguard_step.replaying else PlainState(self).restore
        scaled_by_model = bool(self.model_accepts_loss_kwargs and num_items_in_batch is not None)
        summed = scaled_by_model or self.compute_loss_func or self._oomguard_weighting == "sum"
        reduction: Reduction = "sum" if summed else "mean"
        batch, self._oomguard_step.paired = pair_major(inputs) if self.oomguard_pairs else (inputs, frozenset())
        self._oomguard_step.size = batch_size(batch)
        result = self.oomguard.accumulate(batch, reduction, rewind=rewind)
        return self._stand_in(result.loss)

    def _warn_coupled(self, part: Any) -> None:
        """Say once, when a real step (not the planner's dry run) is split, why that changes this trainer's loss."""
        if self._oomguard_step.warned or any(is_fake(tensor) for _, tensor in batch_leaves(part)):
            return
        logger.warning("micro-batches of %d: %s", batch_size(part), self._oomguard_coupled)
        self._oomguard_step.warned = True

    def _stand_in(self, loss: float) -> torch.Tensor:
        """The loss, for the training step to backpropagate and return once the guard has done both.

        A host tensor that requires grad and reaches no parameter: its backward changes no gradient, and the
        Trainer's own checks of it (NaN/Inf, the running sum) allocate no device memory, so they cannot run out.
        """
        template = getattr(self, "_tr_loss", None)
        if not isinstance(template, torch.Tensor):  # (a training_step called outside train())
            return torch.tensor(loss, requires_grad=True)
        return template.detach().clone().fill_(loss).requires_grad_()

    def _keep_loss_on_host(self) -> None:
        """The Trainer's running loss on the host, where the stand-in loss is added to it."""
        running = getattr(self, "_tr_loss", None)
        backend = current_backend(self.args.device)
        if isinstance(running, torch.Tensor) and backend.is_device(running):
            self._tr_loss = backend.to_host(running)
            backend.synchronize()

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # Gathering the running loss across ranks needs it on the device (NCCL): there, for the gather only.
        if self.args.parallel_mode != ParallelMode.DISTRIBUTED or tr_loss.device == self.args.device:
            return super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)
        on_device = tr_loss.to(self.args.device)
        try:
            return super()._maybe_log_save_evaluate(on_device, *args, **kwargs)
        finally:
            tr_loss.copy_(on_device)

    # -- after the backward: clipping and the optimizer step ----------------------------------------------
    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        clip = super()._clip_grad_norm
        return self._protected(lambda: clip(model), Phase.CLIP)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        norm = super()._get_grad_norm
        if grad_norm is not None:  # (clipping measured it)
            return norm(model, grad_norm)
        return self._protected(lambda: norm(model), Phase.CLIP)

    def _protected(self, run: Callable[[], R], phase: Phase) -> R:
        """``run``, a part of the step after the backward, recovered by the guard as part of that step (in a replay,
        a piece of the replay's attempt); agreed with the other ranks under torch.distributed."""
        if self._guard is None:
            return run()
        return self._guard.protected_step(run, lambda: self._replay(clip=phase == Phase.OPTIMIZER), phase=phase)

    def _replay(self, clip: bool) -> None:
        """Recompute the step's gradients on the guard's new plan (and clip them as the Trainer did, when the
        optimizer step is what is run again). What the replay adds to the trainer's records is taken back: the
        step's own attempt already counted this batch. The inputs are the step's prepared ones: preparing them again
        could change them (GRPO's ``_prepare_inputs`` generates new completions)."""
        before = PlainState(self)
        self._oomguard_step.replaying = True
        self._prepare_inputs = lambda prepared: prepared  # (shadows the class's, for this replay)
        try:
            self.training_step(self._oomguard_step.model, self._oomguard_step.inputs, self._oomguard_step.items)
            if clip and self.args.max_grad_norm and self.args.max_grad_norm > 0:
                self._clip_grad_norm(self._oomguard_step.model)
        finally:
            del self._prepare_inputs
            self._oomguard_step.replaying = False
            before.restore()
