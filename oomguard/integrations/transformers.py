"""``OOMGuardTrainer``: the Hugging Face Trainer with oomguard's recovery, as a drop-in subclass.

``per_device_train_batch_size`` stays the effective batch. On an OOM in ``training_step`` the same batch is
retried, split into micro-batches (and deeper rungs), inside the same call: the training loop is not restarted,
and ``global_step``, the optimizer and the scheduler are untouched. The Trainer calls ``optimizer.step()``
outside ``training_step``; that call is made undoable too, and an OOM there is recovered by recomputing the
same batch's gradients on a cheaper plan and stepping again, so there is still exactly one step.

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

import types
from typing import Any

import torch
from transformers import Trainer

from oomguard._errors import GuardConfigError
from oomguard._guard.guard import OOMGuard
from oomguard._step.runner import Reduction

__all__ = ["OOMGuardTrainer"]

# The Trainer's own parts of a step: its model, optimizer and scheduler, its clipping, its loss reduction, and its
# Accelerator (which runs backward and mixed precision).
_TRAINER_OWNS = frozenset({"model", "optimizer", "scheduler", "max_grad_norm", "reduction", "accelerator"})


class OOMGuardTrainer(Trainer):  # type: ignore[misc]
    """A :class:`transformers.Trainer` whose training steps survive out-of-memory errors.

    Args:
        oomguard: options for the guard, as for :func:`oomguard.oom_guard` (``log_file``, ``state_file``,
            ``ladder``, ``relax_after``...). The model, optimizer, scheduler, clipping and reduction are the
            Trainer's.
        *args, **kwargs: as for :class:`transformers.Trainer`.
    """

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
        self._inputs: Any = None
        self._items: Any = None
        self._reduction: Reduction = "mean"

    @property
    def oomguard(self) -> OOMGuard:
        """The guard behind the training steps (its plan, events and ``summary()``), once training started."""
        if self._guard is None:
            raise RuntimeError("the guard is created by the first training step; call train() first")
        return self._guard

    def _build_guard(self, model: torch.nn.Module) -> OOMGuard:
        trainer = self

        def forward(part: Any) -> torch.Tensor:
            with trainer.compute_loss_context_manager():
                loss: torch.Tensor = trainer.compute_loss(model, part, num_items_in_batch=trainer._items)
            return loss

        inner: Any = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer inside Accelerate's
        guard = OOMGuard(forward, model=model, optimizer=inner, accelerator=self.accelerator, **self._oomguard_options)
        accelerated_step = self.optimizer.step

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            guard.protected_step(lambda: accelerated_step(*args, **kwargs), trainer._replay)
            optimizer._opt_called = True  # what the scheduler's own step tracker would record

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # (the scheduler checks for its tracker)
        self.optimizer.step = types.MethodType(step, self.optimizer)  # the Trainer's own call goes through it
        return guard

    def _replay(self) -> None:
        """Recompute the last batch's gradients (on the guard's new plan) and clip them as the Trainer did."""
        self.oomguard.accumulate(self._inputs, self._reduction)
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            self._clip_grad_norm(self.model_wrapped)

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Forward and backward of the whole batch, split into micro-batches if memory requires it."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        if self._guard is None:
            self._guard = self._build_guard(model)
        scaled_by_model = bool(self.model_accepts_loss_kwargs and num_items_in_batch is not None)
        self._reduction = "sum" if scaled_by_model or self.compute_loss_func else "mean"
        self._inputs, self._items = inputs, num_items_in_batch
        result = self._guard.accumulate(inputs, self._reduction)
        return torch.tensor(result.loss, device=self.args.device)
