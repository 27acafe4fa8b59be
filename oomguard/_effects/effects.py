"""Effects: the only place where a plan changes torch state, and where that change is undone.

Persistent effects (checkpointing, layer offload) are applied when the plan changes and stay until it changes
again or :meth:`Effects.close`; per-forward effects (autocast, activation offload) are contexts around each
micro-batch's forward. Every effect can be undone cleanly, so a plan can be relaxed later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.checkpointing import enable_checkpointing
from oomguard._effects.offload import ActivationOffloader, LayerOffloader, saved_tensor_hooks
from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import CheckpointingMode, Plan, Precision

__all__ = ["Effects"]

_DTYPES: dict[Precision, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Effects:
    """Applies plans to one model and optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, blocks: list[torch.nn.Module]) -> None:
        self.model = model
        self.optimizer = optimizer
        self.blocks = blocks
        self._device_type = next(model.parameters()).device.type
        self._checkpointing: CheckpointingMode | None = None
        self._undo_checkpointing: Callable[[], None] | None = None
        self._layers: LayerOffloader | None = None
        self._scaler_state: dict[str, Any] | None = None

    # -- persistent effects ---------------------------------------------------------------------------
    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Bring checkpointing and layer offload to what ``plan`` asks for; True if anything changed.

        A plan that offloads more layers than the model has blocks raises :class:`~oomguard.GuardConfigError`
        before anything is changed.
        """
        if plan.offload_layers > len(self.blocks):
            raise GuardConfigError(
                f"the plan offloads {plan.offload_layers} layer(s) but {type(self.model).__name__} has "
                f"{len(self.blocks)} repeated block(s), the unit layer offload moves (an nn.ModuleList of same-typed "
                f"layers); assign a Plan with offload_layers <= {len(self.blocks)}"
            )
        changed = plan.checkpointing != self._checkpointing or plan.offload_layers != self.offloaded_layers
        if plan.checkpointing != self._checkpointing:
            if self._undo_checkpointing is not None:
                self._undo_checkpointing()
                self._undo_checkpointing, self._checkpointing = None, None
            if plan.checkpointing is not None:
                self._undo_checkpointing = enable_checkpointing(self.model, plan.checkpointing)
                self._checkpointing = plan.checkpointing
        if self._layers is None and plan.offload_layers:
            self._layers = LayerOffloader(self.optimizer, backend)
        if self._layers is not None:
            # One block at a time: offloading more only moves memory to the host; restoring is all-or-nothing
            # per block, so an OOM part-way leaves a consistent (if deeper) configuration to retry from.
            while len(self._layers.blocks) < plan.offload_layers:
                self._layers.add(self.blocks[len(self._layers.blocks)])
            while len(self._layers.blocks) > plan.offload_layers:
                self._layers.restore_last()
        return changed

    @property
    def offloaded_layers(self) -> int:
        """How many blocks are offloaded now."""
        return len(self._layers.blocks) if self._layers is not None else 0

    # -- per-forward effects --------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self, plan: Plan, backend: MemoryBackend) -> Iterator[None]:
        """Autocast, activation offload and the re-making of streamed weights' copies around one micro-batch's
        forward."""
        with contextlib.ExitStack() as stack:
            if plan.precision is not None:
                # autocast caches the half-precision copy of every weight until the forward ends, which would
                # keep each streamed block's weights on the device: no cache while layers are offloaded.
                cache = self.offloaded_layers == 0
                dtype = _DTYPES[plan.precision]
                stack.enter_context(torch.autocast(device_type=self._device_type, dtype=dtype, cache_enabled=cache))
            offloader = None
            if plan.activation_offload:
                params = {id(p.untyped_storage()) for p in self.model.parameters()}
                if self._layers is not None:
                    params |= self._layers.device_storages()  # streamed weights get their storage later
                offloader = ActivationOffloader(backend, lambda storage: id(storage) in params)
            layers = self._layers if self.offloaded_layers else None
            if offloader is not None or layers is not None:
                stack.enter_context(saved_tensor_hooks(layers, offloader))
            yield

    def scaler(self, plan: Plan) -> torch.amp.GradScaler | None:
        """A gradient scaler for an fp16 attempt, starting from the last committed scaler state."""
        if plan.precision != "fp16":
            return None
        scaler = torch.amp.GradScaler(self._device_type)
        if self._scaler_state is not None:
            scaler.load_state_dict(self._scaler_state)
        return scaler

    def commit_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Remember the scaler state of a step that succeeded (a failed attempt's scaler is dropped)."""
        if scaler is not None:
            self._scaler_state = scaler.state_dict()

    # -- around backward and failures -----------------------------------------------------------------
    def after_backward(self) -> None:
        """Hand offloaded blocks' host gradients to their parameters before clipping and the step."""
        if self._layers is not None:
            self._layers.attach_grads()

    def reset(self) -> None:
        """After a failed attempt: drop what a half-done forward/backward left in the effects."""
        if self._layers is not None:
            self._layers.reset()

    def close(self) -> None:
        """Undo every effect: checkpointing off, hooks removed, offloaded tensors back on the device."""
        if self._layers is not None:
            self._layers.close()
            self._layers = None
        if self._undo_checkpointing is not None:
            self._undo_checkpointing()
            self._undo_checkpointing, self._checkpointing = None, None
