"""Checking a guard's configuration up front, with errors that name the problem and the fix."""

from __future__ import annotations

from typing import Any

import torch

from oomguard._errors import GuardConfigError

__all__ = ["validate"]


def validate(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    max_grad_norm: float | None,
    reduction: str,
    max_attempts: int,
    max_recovery_seconds: float | None,
) -> None:
    if not isinstance(model, torch.nn.Module):
        raise GuardConfigError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise GuardConfigError(f"optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _refuse_sharded(model)
    model_params = {id(p) for p in model.parameters()}
    if not model_params:
        raise GuardConfigError(
            f"the model ({type(model).__name__}) has no parameters, so there is nothing to train or guard"
        )
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params)
    if foreign:
        raise GuardConfigError(
            f"the optimizer holds {foreign} parameter(s) that are not the model's: build it over "
            f"model.parameters() (the guard drops and recomputes the model's gradients on every retry)"
        )
    if scheduler is not None:
        if not callable(getattr(scheduler, "step", None)):
            raise GuardConfigError(f"scheduler= needs a .step() method, got {type(scheduler).__name__}")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise GuardConfigError("scheduler= was built over a different optimizer than optimizer=")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise GuardConfigError(f"max_grad_norm must be positive (or None to disable clipping), got {max_grad_norm!r}")
    if reduction not in ("mean", "sum"):
        raise GuardConfigError(f"reduction must be 'mean' or 'sum' (how the step's loss reduces), got {reduction!r}")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise GuardConfigError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
    if max_recovery_seconds is not None and not max_recovery_seconds > 0:
        raise GuardConfigError(f"max_recovery_seconds must be positive or None, got {max_recovery_seconds!r}")


def _refuse_sharded(model: torch.nn.Module) -> None:
    """FSDP (1 and 2) gathers and frees parameters inside forward and backward with collectives the guard
    cannot agree around yet; refuse it up front instead of risking a hang after an OOM."""
    for module in model.modules():
        kind = type(module).__name__
        if kind == "FullyShardedDataParallel" or kind.startswith("FSDP"):
            raise GuardConfigError(
                f"the model contains {kind}: FSDP is not supported by oomguard yet (an OOM inside its sharded "
                f"collectives could hang the other ranks). Use DistributedDataParallel, or run without the guard"
            )


def check_optional_positive_int(name: str, value: int | None, allow_zero: bool = False) -> None:
    """``value`` is None or an int >= 1 (>= 0 with ``allow_zero``)."""
    low = 0 if allow_zero else 1
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise GuardConfigError(f"{name} must be an int >= {low} or None, got {value!r}")
