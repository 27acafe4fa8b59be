"""The ``optimizer_offload`` rung's effect: the optimizer's state in host memory, and its step run there.

While engaged, every tensor of the optimizer's state that lives on the device (Adam's moments; a step counter
kept on the device) is moved to the host, freeing it on the device. Around each optimizer step the parameters and
their gradients are copied to host buffers, each parameter points at its host copy while the user's own
optimizer steps (so the state, the maths and the scheduler's learning rates are its own, on the CPU), and the
updated values are copied back into the device parameters; a step that raises copies nothing back. Per step that
moves the parameters and gradients down and the parameters up: 12 bytes per fp32 parameter.

The parameters are copied down each step, not kept as a host master copy, so a parameter changed outside the
step (a loaded checkpoint, an EMA swap) is never overwritten with a stale one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan

__all__ = ["OptimizerOffloadEffect", "can_step_on_host"]


def can_step_on_host(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can run its step on host tensors (a capturable one keeps its state on the device)."""
    return not any(group.get("capturable", False) for group in optimizer.param_groups)


class OptimizerOffloadEffect(Effect):
    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._backend: MemoryBackend | None = None  # set while engaged
        self._moved: dict[torch.Tensor, set[str]] = {}  # parameter -> the state keys moved to the host
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}  # reusable host buffers, by parameter and role

    @property
    def holds(self) -> bool:
        return self._backend is not None

    def check(self, plan: Plan) -> None:
        if plan.optimizer_offload and not can_step_on_host(self.target.optimizer):
            raise GuardConfigError(
                "optimizer_offload cannot run a capturable optimizer's step on the host: create it with "
                "capturable=False, or leave optimizer_offload out of ladder="
            )

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        if not plan.optimizer_offload:
            if self._backend is None:
                return False
            self.close()
            return True
        self._backend = backend
        moved = False
        for param, state in self.target.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and backend.is_device(value):
                    state[key] = backend.to_host(value)
                    self._moved.setdefault(param, set()).add(key)
                    moved = True
        if moved:
            backend.synchronize()  # the host copies are complete before the device memory is reused
        return moved

    def optimizer_step(self, plan: Plan, backend: MemoryBackend) -> contextlib.AbstractContextManager[None] | None:
        return self._on_host(backend) if plan.optimizer_offload else None

    @contextlib.contextmanager
    def _on_host(self, backend: MemoryBackend) -> Iterator[None]:
        self.apply(Plan(optimizer_offload=True), backend)  # state created since (the first step's) goes too
        swapped = []
        for group in self.target.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None or not backend.is_device(param):
                    continue  # (no gradient: the step skips it; an offloaded layer's: already on the host)
                host = backend.to_host(param.detach(), self._buffers.get((id(param), "param")))
                grad = backend.to_host(param.grad, self._buffers.get((id(param), "grad")))
                self._buffers[id(param), "param"], self._buffers[id(param), "grad"] = host, grad
                swapped.append((param, param.data, param.grad, host, grad))
        backend.synchronize()  # the host copies are complete before the host step reads them
        stepped = False
        try:
            for param, _, _, host, grad in swapped:
                param.data, param.grad = host, grad
            yield
            stepped = True
        finally:
            for param, data, device_grad, host, _ in swapped:
                param.data, param.grad = data, device_grad
                if stepped:
                    backend.upload(data, host)

    def close(self) -> None:
        """The state back on the device: what was moved, and what the host steps created in the parameter's
        shape (moments); a step counter the optimizer keeps on the host by design stays there."""
        backend = self._backend
        if backend is None:
            return
        for param, state in self.target.optimizer.state.items():
            if not backend.is_device(param):
                continue  # an offloaded layer's: the layer-offload effect keeps its state
            moved = self._moved.get(param, set())
            for key, value in list(state.items()):
                host = isinstance(value, torch.Tensor) and not backend.is_device(value)
                if host and (key in moved or value.shape == param.shape):
                    state[key] = backend.to_device(value)  # may run out of memory: then the rest stays moved
            self._moved.pop(param, None)
        self._backend, self._buffers = None, {}
