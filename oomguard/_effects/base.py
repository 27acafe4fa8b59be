"""What an effect is: one rung's change to torch state, applied from a plan and undone exactly.

A rung (:mod:`oomguard._ladder`, :mod:`oomguard._rungs`) only computes plans; its effect makes the model run the
plan. Persistent
changes (checkpointing, offloaded layers) are made by :meth:`Effect.apply` when the plan changes and stay until
it changes again or :meth:`Effect.close`; per-forward ones (autocast, saved-tensor hooks) are contexts around
each micro-batch's forward. :class:`oomguard._effects.effects.Effects` runs every effect of a guard.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from oomguard._backends.memory import MemoryBackend, active_simulation, current_backend
from oomguard._effects.activation_host import ActivationLedger
from oomguard._effects.hoststep import HostStep
from oomguard._ladder.plan import Plan

__all__ = ["Effect", "EffectTarget", "Packer"]


@dataclass(eq=False)
class EffectTarget:
    """What the effects of one guard change, and what they tell each other."""

    #: The module being trained (inside DDP, never the wrapper).
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: Its repeated blocks (decoder layers): what checkpointing and layer offload work on.
    blocks: list[torch.nn.Module]
    #: The Accelerate ``Accelerator`` the job runs under, if any (its mixed precision is then not the guard's).
    accelerator: Any = None
    #: Identities of the device storages of streamed (offloaded) weights, kept by the layer-offload effect:
    #: autocast must not cache copies of them, and activation offload must leave them on the device.
    streamed: set[int] = field(default_factory=set)
    #: What activation offload's saved tensors hold on the host, and the host budget their copies keep (the guard
    #: sets it; its per-sample figure is what the activation-offload rung estimates from).
    activation_host: ActivationLedger = field(default_factory=ActivationLedger)
    #: From how many offloaded blocks layer offload brings the next block in while one computes (None: from
    #: :data:`oomguard._effects.layers.PREFETCH_FROM`; the planner's shallow copies of a deep model set the deep one's).
    prefetch_from: int | None = None
    #: Where the model trains, read once: layer offload later points parameters at host copies.
    device: torch.device = field(init=False)
    device_type: str = field(init=False)  # ("cuda", "cpu"...)

    def __post_init__(self) -> None:
        self.device = next(self.model.parameters()).device
        self.device_type = self.device.type

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer itself: inside Accelerate's ``AcceleratedOptimizer``, the one it wraps (the wrapper
        passes ``step``, ``state_dict`` and ``load_state_dict`` on to it, and has no hook tables of its own). Where
        hooks go, and whose ``step`` an effect replaces."""
        inner = getattr(self.optimizer, "optimizer", None)
        return inner if isinstance(inner, torch.optim.Optimizer) else self.optimizer

    def backend(self, applied: MemoryBackend | None) -> MemoryBackend:
        """The memory backend an undo copies through: a simulated device active now (a guard may be closed inside
        another simulation than the one its plan was applied in), else the backend the plan was ``applied``
        with (closed after its simulation ended, say), else the model's device's."""
        active = active_simulation()
        return active if active is not None else applied if applied is not None else current_backend(self.device)


class Packer(Protocol):
    """One effect's share of the saved-tensor hooks of a forward (only one pair of hooks can be active)."""

    def pack(self, tensor: torch.Tensor) -> Any:
        """What to keep for ``tensor`` until backward, or None to leave it to the next packer."""

    def unpack(self, packed: Any) -> torch.Tensor:
        """The tensor again, from what :meth:`pack` kept."""

    def finish(self) -> None:
        """The forward is over."""


class Effect:
    """One rung's effect. Every method does nothing by default; an effect overrides what it needs.

    Subclass it for a rung of your own (see :class:`oomguard.Rung`): the rung's ``effect()`` returns the subclass,
    which is made with the guard's :class:`EffectTarget`. ``apply`` brings persistent state to a plan (the rung's
    level is ``plan.level(name)`` for a rung without a plan field) and ``close`` undoes it; per-forward changes go
    in ``forward`` or ``packer``.
    """

    def __init__(self, target: EffectTarget) -> None:
        self.target = target

    def check(self, plan: Plan) -> None:
        """Raise :class:`~oomguard.GuardConfigError` if ``plan`` cannot be applied, before any effect changes."""

    def before_apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Undo, before any effect applies ``plan``, what another effect's apply must not find (layer offload
        takes blocks to the host whole: bf16 master weights and 8-bit frozen weights end first); True if it
        changed anything."""
        return False

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Bring persistent state to what ``plan`` asks for; True if anything changed."""
        return False

    def forward(self, plan: Plan) -> contextlib.AbstractContextManager[None] | None:
        """A context around one micro-batch's forward, if ``plan`` needs one from this effect."""
        return None

    def packer(self, plan: Plan, backend: MemoryBackend) -> Packer | None:
        """This effect's saved-tensor hooks for one forward, if ``plan`` needs them."""
        return None

    def optimizer_step(self, plan: Plan, backend: MemoryBackend) -> contextlib.AbstractContextManager[None] | None:
        """A context around the optimizer step (inside its transaction), if ``plan`` needs one from this effect."""
        return None

    @property
    def holds(self) -> bool:
        """Whether the model is changed by this effect now (then no other guard may take the model)."""
        return False

    @property
    def held(self) -> str:
        """What this effect holds now, in words for a message (``"2 offloaded block(s)"``)."""
        return type(self).__name__

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        """For a dry run of the model on fake tensors (the planner swaps fakes in for the parameters): a context
        in which the model's structure is as if this effect held nothing (its hooks and patched methods out of the
        way, each parameter's logical dtype), without moving any data; put back when the context ends. None where
        nothing needs to step aside. An effect that holds the model and cannot step aside raises."""
        if self.holds:
            raise NotImplementedError(
                f"{type(self).__name__} holds the model and does not say how to step aside for the planner's dry "
                f"run (Effect.suspended); the planner cannot plan while it is engaged"
            )
        return None

    def after_micro_batch(self) -> None:
        """One micro-batch's backward is done (the last one's too, before :meth:`after_backward`): its gradients
        are in the parameters' ``.grad``, added to what the micro-batches before it left there."""

    def step_early(self, host_step: HostStep, host_budget: int | None) -> bool:
        """The attempt's last backward is next, and nothing will look at every gradient before its optimizer step
        (no clipping, no scaler, one process): the step may begin during that backward (:mod:`.early`). True if
        it will."""
        return False

    def early_backward(self, loss: torch.Tensor) -> bool:
        """The last forward is done, its backward from ``loss`` next, and :meth:`step_early` said the step may begin
        in it: True if it still may (the effect has checked what the forward made and did, and taken it in);
        False disarms it."""
        return False

    @property
    def stepped_early(self) -> int:
        """Parameters (elements) the last step stepped during its last backward (0: none)."""
        return 0

    def after_backward(self) -> None:
        """The last micro-batch's backward is done: hand over what clipping and the optimizer step need."""

    def host_stepped(self, params: list[torch.Tensor]) -> None:
        """The optimizer step under way has stepped ``params`` on the host (one bucket of them, the rest of the
        step still to come; see :mod:`oomguard._effects.hoststep`): what waits for them may start."""

    @property
    def uploaded_beside(self) -> int:
        """Bytes the last optimizer step copied to the device while the host went on stepping (0: none)."""
        return 0

    def reset(self) -> None:
        """An attempt failed: drop what its half-done forward or backward left behind."""

    def close(self) -> None:
        """Undo everything this effect changed."""
