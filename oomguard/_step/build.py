"""Assembling the step runner of a guard (or of the planner) from its options, and what rungs may assume."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oomguard._backends.memory import bf16_supported
from oomguard._distributed.agreement import ddp_of, unwrap
from oomguard._effects.base import EffectTarget
from oomguard._effects.blocks import find_blocks
from oomguard._effects.checkpointing import user_checkpointing
from oomguard._effects.effects import Effects
from oomguard._effects.transaction import OptimizerTransaction
from oomguard._ladder.rungs import RungContext
from oomguard._options import GuardOptions
from oomguard._step.batch import default_item_counter
from oomguard._step.runner import StepRunner

__all__ = ["build_runner", "model_context"]


def build_runner(
    step_fn: Callable[[Any], Any], options: GuardOptions, item_counter: Callable[[Any], float] | None = None
) -> StepRunner:
    """The runner of ``step_fn`` with ``options``: its effects work on the module inside DDP, never the wrapper."""
    core = unwrap(options.model)
    return StepRunner(
        step_fn,
        model=options.model,
        optimizer=options.optimizer,
        scheduler=options.scheduler,
        transaction=OptimizerTransaction(options.optimizer, options.step_journal),
        effects=Effects(EffectTarget(core, options.optimizer, find_blocks(core)), options.rungs.rungs),
        max_grad_norm=options.max_grad_norm,
        item_counter=item_counter or options.count_items or default_item_counter(options.model),
        reduction=options.reduction,
        ddp=ddp_of(options.model),
        accelerator=options.accelerator,
    )


def model_context(runner: StepRunner) -> RungContext:
    """What the rungs may assume about the runner's model and device; each call fills in its batch and phase."""
    target = runner.effects.target
    accelerator = runner.accelerator
    return RungContext(
        batch_size=0,
        num_blocks=len(target.blocks),
        bf16_supported=bf16_supported(next(target.model.parameters()).device),
        checkpointed=user_checkpointing(target.model),
        amp_available=accelerator is None or getattr(accelerator, "mixed_precision", "no") == "no",
    )
