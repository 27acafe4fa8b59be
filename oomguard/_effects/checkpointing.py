"""Activation checkpointing, through transformers' own API where the model has it, else torch's checkpoint.

``partial`` checkpoints every other repeated block, ``full`` every block. Gradients are identical to training
without it: the recompute runs the same ops (``use_reentrant=False``, RNG state preserved for dropout).

Undoing puts the model back exactly as it was: a layer the user had checkpointed stays checkpointed (and stays
so while the rung is on), and the input-embedding hook transformers adds is removed only if it was ours.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._effects.blocks import find_blocks, is_transformers_model
from oomguard._ladder.plan import CheckpointingMode, Plan

__all__ = ["CheckpointingEffect", "enable_checkpointing", "user_checkpointing"]

_KWARGS = {"use_reentrant": False}
_MISSING = object()
_HOOK_ATTRS = ("_require_grads_hooks", "_require_grads_hook")  # where transformers keeps its input-grad hooks


class CheckpointingEffect(Effect):
    """The checkpointing rung's effect: checkpointing on in the plan's mode, and the model put back after."""

    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._mode: CheckpointingMode | None = None
        self._undo: Callable[[], None] | None = None

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        if plan.checkpointing == self._mode:
            return False
        self.close()
        if plan.checkpointing is not None:
            self._undo = enable_checkpointing(self.target.model, plan.checkpointing)
            self._mode = plan.checkpointing
        return True

    @property
    def holds(self) -> bool:
        return self._mode is not None

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        if self._undo is None or self._mode is None:
            return None
        return self._off_for_a_while(self._mode, self._undo)

    @contextlib.contextmanager
    def _off_for_a_while(self, mode: CheckpointingMode, undo: Callable[[], None]) -> Iterator[None]:
        """Checkpointing off (flags and wrappers only: no data moves), then on again in the same mode."""
        undo()
        self._undo = None
        try:
            yield
        finally:
            self._undo = enable_checkpointing(self.target.model, mode)

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo, self._mode = None, None


def user_checkpointing(model: torch.nn.Module) -> bool:
    """Whether the user already checkpoints every layer (then the rung has nothing to add).

    Asks the transformers model inside any wrapper (``torch.compile``'s, PEFT's) through its public
    ``is_activation_checkpointing``; never the deprecated ``is_gradient_checkpointing`` a wrapper would forward to.
    """
    inner = next((m for m in model.modules() if hasattr(type(m), "is_activation_checkpointing")), None)
    if inner is not None:
        on = bool(inner.is_activation_checkpointing)
    else:  # not a transformers model: the layers' own flags
        on = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    return on and all(getattr(block, "gradient_checkpointing", True) for block in find_blocks(model))


def enable_checkpointing(model: torch.nn.Module, mode: CheckpointingMode) -> Callable[[], None]:
    """Turn checkpointing on in ``mode``; returns the function that puts the model back as it was."""
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
    flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    before = [(m, m.gradient_checkpointing, vars(m).get("_gradient_checkpointing_func", _MISSING)) for m in flagged]
    enable: Callable[..., Any] | None = getattr(model, "activation_checkpointing_enable", None)
    modern = enable is not None and "every_n_layers" in inspect.signature(enable).parameters  # transformers 5.x
    if enable is None or not modern:
        enable = model.gradient_checkpointing_enable
    # The input-grad hooks are kept on the model whose method this is: through a wrapper that forwards attributes
    # (PEFT's), the transformers model inside. Looked for on the wrapper, they stayed after undo: the embeddings'
    # output then required grad for good (one more activation kept and one more gradient made per step).
    owner = getattr(enable, "__self__", model)
    hooks_before = {name: vars(owner).get(name, _MISSING) for name in _HOOK_ATTRS}
    old_handles = _handles(hooks_before.get("_require_grads_hooks"))

    if modern:
        enable(activation_checkpointing_kwargs=dict(_KWARGS), every_n_layers=every)
    else:  # older releases: the deprecated name, no every_n_layers; skip layers by their flag, as 5.x does
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(gradient_checkpointing_kwargs=dict(_KWARGS))
        for index, block in enumerate(find_blocks(model)):
            if hasattr(block, "gradient_checkpointing"):
                setattr(block, "gradient_checkpointing", index % every == 0)  # noqa: B010
    for module, flag, _ in before:  # never un-checkpoint a layer the user checkpointed
        if flag:
            module.gradient_checkpointing = True

    def undo() -> None:
        for handle in _handles(vars(owner).get("_require_grads_hooks")):
            if not any(handle is old for old in old_handles):
                handle.remove()
        for name, value in hooks_before.items():
            _restore(owner, name, value)
        for module, flag, func in before:
            module.gradient_checkpointing = flag
            _restore(module, "_gradient_checkpointing_func", func)

    return undo


def _handles(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _restore(obj: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        if name in vars(obj):
            delattr(obj, name)
    else:
        setattr(obj, name, value)


def _enable_generic(blocks: list[torch.nn.Module]) -> Callable[[], None]:
    previous = [vars(block).get("forward", _MISSING) for block in blocks]  # a wrapper the user already set
    for block in blocks:
        original = block.forward

        def forward(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                return checkpoint(_original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
            return _original(*args, **kwargs)

        block.forward = forward  # type: ignore[method-assign]

    def undo() -> None:
        for block, forward in zip(blocks, previous, strict=True):
            _restore(block, "forward", forward)

    return undo
