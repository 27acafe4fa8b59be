"""The loss a step function returns, and the numbers an attempt reads off it: its value, and the refusal to
step on a loss or gradient norm that is not a real, finite number."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake

from oomguard._errors import LossError, NonFiniteLoss

__all__ = ["loss_of", "loss_value", "non_finite", "value_of"]


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a step function's return value: a tensor, ``{"loss": ...}`` or an object with ``.loss``.

    Raises :class:`~oomguard.LossError` with the fix when there is none, when it is not a single number, or
    when it does not require grad (nothing to train).
    """
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    elif hasattr(output, "loss"):
        loss = output.loss
    else:
        raise LossError(
            f"the step function returned a {type(output).__name__} with no loss; return the loss tensor, a "
            f"mapping with a 'loss' key, or an object with a .loss attribute (a transformers ModelOutput)"
        )
    if loss is None:
        raise LossError(
            "the step function returned no loss (loss is None); a transformers model computes one only when "
            "the batch has 'labels'"
        )
    if not isinstance(loss, torch.Tensor):
        raise LossError(f"the loss must be a torch.Tensor, got {type(loss).__name__}: {loss!r}")
    if loss.numel() != 1:
        raise LossError(
            f"the loss must be a single number, got a tensor of shape {tuple(loss.shape)}; reduce it first, "
            f"for example with .mean()"
        )
    if not loss.requires_grad:
        raise LossError(
            "the loss does not require grad, so there is nothing to train: is the forward running under "
            "torch.no_grad() or torch.inference_mode(), or are all parameters frozen?"
        )
    return loss


def loss_value(total: torch.Tensor | None, *, refuse_non_finite: bool) -> float:
    """The batch's loss as a number (NaN where no micro-batch counted an item), or the error of a step that must
    not commit: a loss that is a fake tensor outside the dry run (a tensor the planner made, kept by the step or
    the model), or, where ``refuse_non_finite``, a NaN or infinite loss (one read of the device: the step waits
    for the backward to finish, which it would before returning anyway)."""
    if total is None:
        return math.nan
    if is_fake(total):
        if detect_fake_mode() is not None:  # the dry run itself: fake tensors hold no values
            return math.nan
        raise LossError(
            "the step's loss is a FakeTensor, which holds no values: a tensor the dry-run planner made (the jump "
            "after an OOM, preplan=True, or tuning run the step on fake tensors) was kept somewhere the step or "
            "the model reads it again (a warning said where, after that dry run). Nothing was stepped. Keep such "
            "state in module attributes or buffers, in the step's closure or in the globals it names (the planner "
            "puts those back), or turn the dry runs off: predictive=False, tune_after=None, preplan=False"
        )
    value = float(total)
    if refuse_non_finite and not math.isfinite(value):
        raise NonFiniteLoss(non_finite("loss", value))
    return value


def non_finite(what: str, value: float) -> str:
    return (
        f"the batch's {what} is {value}: nothing was stepped (the model, the optimizer and the scheduler are as "
        f"they were before this call), since an optimizer step on it would write NaN into the weights it "
        f"touches. Skip the batch (catch oomguard.NonFiniteLoss), lower the learning rate, or look for the "
        f"diverging layer (torch.autograd.set_detect_anomaly)"
    )


def value_of(tensor: torch.Tensor | None) -> float:
    """A scalar's value; NaN for none, and for the fake tensors of a dry run (see oomguard.plan), which have none."""
    if tensor is None or is_fake(tensor):
        return float("nan")
    return float(tensor)
