"""Activation checkpointing, through transformers' own API where the model has it, else torch's checkpoint.

``partial`` checkpoints every other repeated block, ``full`` every block. Gradients are identical to training
without it: the recompute runs the same ops (``use_reentrant=False``, RNG state preserved for dropout).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from oomguard._blocks import find_blocks, is_transformers_model
from oomguard._plan import Checkpointing

__all__ = ["enable_checkpointing"]

_KWARGS = {"use_reentrant": False}


def enable_checkpointing(model: torch.nn.Module, mode: Checkpointing) -> Callable[[], None]:
    """Turn checkpointing on in ``mode``; returns the function that turns it off again."""
    every = 1 if mode == "full" else 2
    if is_transformers_model(model):
        return _enable_transformers(model, every)
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (an nn.ModuleList of same-typed layers) to checkpoint"
        )
    return _enable_generic(blocks[::every])


def _enable_transformers(model: Any, every: int) -> Callable[[], None]:
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and "every_n_layers" in inspect.signature(enable).parameters:  # transformers 5.x
        enable(activation_checkpointing_kwargs=dict(_KWARGS), every_n_layers=every)
        return model.activation_checkpointing_disable  # type: ignore[no-any-return]
    # Older releases: the deprecated name, no every_n_layers; skip layers by their flag, as 5.x does.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(_KWARGS))
    if every > 1:
        for index, block in enumerate(find_blocks(model)):
            if hasattr(block, "gradient_checkpointing"):
                setattr(block, "gradient_checkpointing", index % every == 0)  # noqa: B010

    def disable() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()

    return disable


def _enable_generic(blocks: list[torch.nn.Module]) -> Callable[[], None]:
    for block in blocks:
        original = block.forward

        def forward(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                return checkpoint(_original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
            return _original(*args, **kwargs)

        block.forward = forward  # type: ignore[method-assign]

    def disable() -> None:
        for block in blocks:
            if "forward" in vars(block):
                del block.forward

    return disable
