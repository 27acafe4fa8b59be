"""Effects: the only place where a plan changes torch state, and where that change is undone.

:class:`Effects` runs the effect of every rung a plan can engage: the built-in ones (autocast, checkpointing,
layer offload, activation offload) and those of custom rungs. It applies persistent effects when the plan
changes, wraps each micro-batch's forward in the per-forward ones (with one pair of saved-tensor hooks shared by
the effects that need them), and undoes everything on :meth:`Effects.close`, so a plan can be relaxed later.
It also keeps the fp16 loss scale of the last committed step, from which each fp16 attempt starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.activations import ActivationOffloadEffect
from oomguard._effects.base import Effect, EffectTarget, Packer
from oomguard._effects.checkpointing import CheckpointingEffect
from oomguard._effects.layers import LayerOffloadEffect
from oomguard._effects.precision import AutocastEffect
from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan
from oomguard._ladder.rungs import Rung

__all__ = ["Effects"]


class Effects:
    """Applies plans to one model and optimizer, through one effect per rung."""

    def __init__(self, target: EffectTarget, rungs: Iterable[Rung] = ()) -> None:
        self.target = target
        self._layers = LayerOffloadEffect(target)
        # Layer offload before activation offload: its saved-tensor hook must see the copies of streamed weights
        # before activation offload would move them to the host. Undone in the reverse order.
        self._effects: list[Effect] = [
            AutocastEffect(target),
            CheckpointingEffect(target),
            self._layers,
            ActivationOffloadEffect(target),
        ]
        for rung in rungs:
            make = rung.effect()
            if make is not None:
                self._effects.append(_made(make, target, rung))
        self._scaler_state: dict[str, Any] | None = None

    # -- persistent effects ---------------------------------------------------------------------------
    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Bring every effect to what ``plan`` asks for; True if anything changed.

        A plan that cannot be applied (more offloaded layers than the model has blocks, say) raises
        :class:`~oomguard.GuardConfigError` before anything is changed.
        """
        for effect in self._effects:
            effect.check(plan)
        changed = [effect.apply(plan, backend) for effect in self._effects]  # every one, in order
        return any(changed)

    @property
    def offloaded_layers(self) -> int:
        """How many blocks are offloaded now."""
        return self._layers.offloaded

    # -- per-forward effects --------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self, plan: Plan, backend: MemoryBackend) -> Iterator[None]:
        """Every per-forward effect of ``plan`` around one micro-batch's forward."""
        with contextlib.ExitStack() as stack:
            for effect in self._effects:
                context = effect.forward(plan)
                if context is not None:
                    stack.enter_context(context)
            packers = [packer for effect in self._effects if (packer := effect.packer(plan, backend)) is not None]
            if packers:
                stack.enter_context(_saved_tensor_hooks(packers))
            yield

    def scaler(self, plan: Plan) -> torch.amp.GradScaler | None:
        """A gradient scaler for an fp16 attempt, starting from the last committed scaler state."""
        if plan.precision != "fp16":
            return None
        scaler = torch.amp.GradScaler(self.target.device_type)
        if self._scaler_state is not None:
            scaler.load_state_dict(self._scaler_state)
        return scaler

    def commit_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Remember the scaler state of a step that succeeded (a failed attempt's scaler is dropped)."""
        if scaler is not None:
            self._scaler_state = scaler.state_dict()

    # -- around backward and failures -----------------------------------------------------------------
    def after_backward(self) -> None:
        """The last backward is done (offloaded blocks hand their host gradients to their parameters)."""
        for effect in self._effects:
            effect.after_backward()

    def reset(self) -> None:
        """After a failed attempt: drop what a half-done forward/backward left in the effects."""
        for effect in self._effects:
            effect.reset()

    def close(self) -> None:
        """Undo every effect: hooks removed, offloaded tensors back on the device, checkpointing off."""
        for effect in reversed(self._effects):
            effect.close()


def _made(make: Any, target: EffectTarget, rung: Rung) -> Effect:
    effect = make(target)
    if not isinstance(effect, Effect):
        raise GuardConfigError(
            f"the effect of rung {rung.name!r} is a {type(effect).__name__}; Rung.effect() must return a subclass "
            f"of oomguard._effects.Effect (or None for a rung without an effect of its own)"
        )
    return effect


@contextlib.contextmanager
def _saved_tensor_hooks(packers: list[Packer]) -> Iterator[None]:
    """One pair of saved-tensor hooks for every packer (only the innermost pair would apply): the first packer
    that takes a tensor keeps it. A tensor none takes is kept detached: a tensor an op saved of its own output,
    handed back with its grad_fn, would make a cycle through autograd's graph that only backward breaks (so a
    failed forward would never be freed); unpacked, autograd gives it back its history."""

    def pack(tensor: torch.Tensor) -> tuple[int, Any]:
        for index, packer in enumerate(packers):
            packed = packer.pack(tensor)
            if packed is not None:
                return index, packed
        return -1, tensor.detach() if tensor.grad_fn is not None else tensor

    def unpack(packed: tuple[int, Any]) -> torch.Tensor:
        index, kept = packed
        return packers[index].unpack(kept) if index >= 0 else kept  # type: ignore[no-any-return]

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for packer in packers:
            packer.finish()
