"""Effects: the only place where a plan changes torch state, and where that change is undone.

:class:`Effects` runs the effect of every rung a plan can engage: those of the registered rungs, in the order the
registry gives (:func:`~oomguard._ladder.rungs.effect_order`), then those of the ladder's own rungs. It
applies persistent effects when the plan changes, wraps each micro-batch's forward in the per-forward ones (with
one pair of saved-tensor hooks shared by the effects that need them), and undoes everything on
:meth:`Effects.close`, so a plan can be relaxed later.
It also keeps the fp16 loss scale of the last committed step, from which each fp16 attempt starts.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from oomguard._backends.memory import MemoryBackend
from oomguard._detect import is_oom
from oomguard._effects.base import Effect, EffectTarget, Packer
from oomguard._effects.hoststep import HostStep, host_loops
from oomguard._effects.layers import LayerOffloadEffect
from oomguard._errors import GuardConfigError
from oomguard._events import logger
from oomguard._ladder.plan import Plan
from oomguard._ladder.rungs import Rung, builtin, effect_order

__all__ = ["Effects"]


# Each model changed by a guard's effects, and (weakly: neither keeps the other alive) those effects: a second
# guard on the model would fight the first (streamed blocks' gradients going to the first one's host buffers), so
# it is refused. A guard that is dropped undoes its effects (a finalizer), which frees the model.
_HOLDERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[Effects]] = weakref.WeakKeyDictionary()


class Effects:
    """Applies plans to one model and optimizer, through one effect per rung."""

    def __init__(self, target: EffectTarget, rungs: Iterable[Rung] = (), host_step: HostStep = "fused") -> None:
        _refuse_if_held(target.model, self)
        self.target = target
        #: How what steps on the host runs (``host_step=``, see :mod:`.hoststep`).
        self.host_step: HostStep = host_step
        # Every registered rung's effect, whether the ladder lists it or not (a plan assigned by hand or remembered
        # may engage it), in the registry's order; then the ladder's own rungs'. Undone in the reverse order.
        own = [rung for rung in rungs if builtin(rung.name) is None]
        #: The rungs whose effects these are (what the model's context asks, see ``model_context``).
        self.rungs: tuple[Rung, ...] = (*effect_order(), *own)
        self._effects: list[Effect] = []
        for rung in self.rungs:
            make = rung.effect()
            if make is not None:
                self._effects.append(_made(make, target, rung))
        self._scaler_state: dict[str, Any] | None = None

    @property
    def offloaded_layers(self) -> int:
        """How many blocks are offloaded now (what the layer-offload effect streams; 0 without one)."""
        return sum(effect.offloaded for effect in self._effects if isinstance(effect, LayerOffloadEffect))

    # -- persistent effects ---------------------------------------------------------------------------
    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Bring every effect to what ``plan`` asks for; True if anything changed.

        A plan that cannot be applied (more offloaded layers than the model has blocks, say) raises
        :class:`~oomguard.GuardConfigError` before anything is changed.
        """
        for effect in self._effects:
            effect.check(plan)
        _refuse_if_held(self.target.model, self)
        try:
            changed = [effect.before_apply(plan, backend) for effect in self._effects]
            changed += [effect.apply(plan, backend) for effect in self._effects]  # every one, in order
        finally:
            self._hold_while_changed()
        return any(changed)

    def _hold_while_changed(self) -> None:
        if self.holds:
            _HOLDERS[self.target.model] = weakref.ref(self)
        elif _holder(self.target.model) is self:
            del _HOLDERS[self.target.model]

    @property
    def holds(self) -> bool:
        """Whether any effect has changed the model now (hooks, offloaded tensors, checkpointing)."""
        return any(effect.holds for effect in self._effects)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The model as if no effect held it, structurally and without moving data, for the planner's dry run on
        fake tensors (see :meth:`Effect.suspended`); every effect back in place after. Another set of effects (the
        planner's own) may take the model meanwhile."""
        with contextlib.ExitStack() as stack:
            for effect in reversed(self._effects):
                context = effect.suspended()
                if context is not None:
                    stack.enter_context(context)
            held = _HOLDERS.pop(self.target.model, None)
            try:
                yield
            finally:
                if held is not None:
                    _HOLDERS[self.target.model] = held

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

    @contextlib.contextmanager
    def optimizer_step(self, plan: Plan, backend: MemoryBackend) -> Iterator[None]:
        """Every effect's context around the optimizer step of ``plan``; innermost, torch's fused kernel or loop
        for what steps on the host (:mod:`.hoststep`)."""
        with contextlib.ExitStack() as stack:
            for effect in self._effects:
                context = effect.optimizer_step(plan, backend)
                if context is not None:
                    stack.enter_context(context)
            if plan.optimizer_offload or plan.offload_layers:  # (a plan stepping nothing on the host: no cost)
                loops = host_loops(self.target.optimizer, backend, self.host_step, stepped=self._host_stepped)
                stack.enter_context(loops)  # (innermost)
            yield

    def _host_stepped(self, params: list[torch.Tensor]) -> None:
        """The step under way has stepped ``params`` on the host (a bucket): every effect hears of it."""
        for effect in self._effects:
            effect.host_stepped(params)

    @property
    def uploaded_beside(self) -> int:
        """Bytes the last optimizer step copied to the device while the host went on stepping (the master level's
        stepped weights, bucket by bucket): what the planner's time model lets the host step hide."""
        return sum(effect.uploaded_beside for effect in self._effects)

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
    def after_micro_batch(self) -> None:
        """A micro-batch's backward is done (master weights move its bf16 gradients into fp32 sums on the host)."""
        for effect in self._effects:
            effect.after_micro_batch()

    def step_early(self, host_budget: int | None) -> bool:
        """The last micro-batch's backward is next, and nothing looks at every gradient before the step: it may
        begin during that backward (:mod:`.early`), within ``host_budget``."""
        armed = False
        for effect in self._effects:  # (every one of them told)
            armed = effect.step_early(self.host_step, host_budget) or armed
        return armed

    def early_backward(self, loss: torch.Tensor) -> bool:
        """The last forward is done: whether the step :meth:`step_early` armed may still begin in the backward from
        ``loss`` (see :meth:`.Effect.early_backward`)."""
        armed = False
        for effect in self._effects:  # (every one of them told)
            armed = effect.early_backward(loss) or armed
        return armed

    @property
    def stepped_early(self) -> int:
        """Parameters (elements) the last step stepped during its last backward."""
        return sum(effect.stepped_early for effect in self._effects)

    def after_backward(self) -> None:
        """The last backward is done (offloaded blocks hand their host gradients to their parameters)."""
        for effect in self._effects:
            effect.after_backward()

    def reset(self) -> None:
        """After a failed attempt: drop what a half-done forward/backward left in the effects."""
        for effect in self._effects:
            effect.reset()

    def undo(self, logged: bool = False) -> str | None:
        """:meth:`close`, for a guard that gives up or is dropped: what could not be undone (what could not come back
        to the device, for want of memory) is returned, and ``logged`` too, rather than raised."""
        try:
            self.close()
            return None
        except Exception as exc:
            if not is_oom(exc):
                raise
        held = ", ".join(effect.held for effect in self._effects if effect.holds)  # (the except block is over)
        left = (
            f"{held} could not be brought back to the device (out of memory): the model and optimizer are still "
            f"the guard's, as its plan had them; call guard.close() once memory allows"
        )
        if logged:
            logger.warning("oomguard: %s", left)
        return left

    def undo_when_dropped(self) -> None:
        """:meth:`undo` (logged) for a guard the garbage collector drops: that can happen inside anything, another
        guard's dry run on fake tensors or a simulated device's accounting included, whose dispatch modes must not
        see (or fake) this model's tensors, so they are set aside while it runs."""
        with _disable_current_modes():
            self.undo(logged=True)

    def close(self) -> None:
        """Undo every effect: hooks removed, offloaded tensors back on the device, checkpointing off."""
        try:
            for effect in reversed(self._effects):
                effect.close()
        finally:
            self._hold_while_changed()


def _holder(model: torch.nn.Module) -> Effects | None:
    held = _HOLDERS.get(model)
    return held() if held is not None else None


def _refuse_if_held(model: torch.nn.Module, effects: Effects) -> None:
    holder = _holder(model)
    if holder is not None and holder is not effects:
        raise GuardConfigError(
            f"another guard has changed this {type(model).__name__} (offloaded layers or checkpointing that only "
            f"it can undo): two guards on one model would undo each other's work. Call close() on the other "
            f"guard first (a guard that was dropped without undoing its changes, for want of memory, is closed "
            f"when it is garbage-collected), or keep one guard per model"
        )


def _made(make: Any, target: EffectTarget, rung: Rung) -> Effect:
    effect = make(target)
    if not isinstance(effect, Effect):
        raise GuardConfigError(
            f"the effect of rung {rung.name!r} is a {type(effect).__name__}; Rung.effect() must return a subclass "
            f"of oomguard.Effect (or None for a rung without an effect of its own)"
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
