"""The ``optimizer_offload`` rung's effect: the optimizer's state in host memory, and its step run there.

While engaged, every tensor of the optimizer's state that lives on the device (Adam's moments; a step counter
kept on the device) is moved to the host, freeing it on the device. Around each optimizer step the parameters and
their gradients are copied to host buffers, each parameter points at its host copy while the user's own
optimizer steps (so the state, the maths and the scheduler's learning rates are its own, on the CPU), and the
updated values are copied back into the device parameters; a step that raises copies nothing back. Per step that
moves the parameters and gradients down and the parameters up: 12 bytes per fp32 parameter.

The parameters are copied down each step, not kept as a host master copy, so a parameter changed outside the
step (a loaded checkpoint, an EMA swap) is never overwritten with a stale one.

At the ``"master"`` level (a bf16 plan without offloaded layers) the host also keeps the fp32 master weights and
the device only bf16 copies of them (:mod:`oomguard._effects.masters`): each micro-batch's bf16 gradients go down and
are summed in fp32 on the host, the step runs on the masters there, and they go up rounded to bf16 bucket by bucket
as the host step goes on (2 bytes per parameter each way). Going back up (or closing) puts each master back on the
device bit for bit.

While the state is on the host, ``optimizer.load_state_dict()`` puts a loaded state there too, in fp32 for a halved
weight: torch would cast each tensor to its parameter's dtype and device, bf16 on the device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._effects.hoststep import HostStep
from oomguard._effects.masters import MasterWeights
from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan, keeps_master_weights

__all__ = ["OptimizerOffloadEffect", "can_step_on_host"]


def can_step_on_host(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can run its step on host tensors (a capturable one keeps its state on the device)."""
    return not any(group.get("capturable", False) for group in optimizer.param_groups)


def _master(plan: Plan) -> bool:
    """Whether ``plan`` keeps fp32 master weights on the host (see the module)."""
    return plan.optimizer_offload == "master" and keeps_master_weights(plan.precision, plan.offload_layers)


class OptimizerOffloadEffect(Effect):
    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._backend: MemoryBackend | None = None  # set while engaged
        self._moved: dict[torch.Tensor, set[str]] = {}  # parameter -> the state keys moved to the host
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}  # reusable host buffers, by parameter and role
        self._level = MasterWeights(target)  # the "master" level's weights
        self._hooks: list[RemovableHandle] = []  # the optimizer's load_state_dict hooks, while engaged
        self._loading: dict[torch.Tensor, dict[str, torch.Tensor]] = {}  # a load under way: what torch must not cast

    @property
    def holds(self) -> bool:
        return self._backend is not None

    @property
    def held(self) -> str:
        return "the optimizer state" + (" and the fp32 master weights" if self._level.engaged else "") + " on the host"

    @property
    def _masters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each halved parameter's fp32 master (on the host)."""
        return self._level.masters

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
        self._hook_optimizer()
        self._level.prepare()
        moved = self._move_state(backend)
        if _master(plan):
            halvable = [p for p in self._parameters() if p.dtype == torch.float32 and backend.is_device(p)]
            moved = self._level.halve(halvable, backend) or moved
        self._drop_stale_buffers(backend)
        if moved:
            backend.synchronize()  # the host copies are complete before the device memory is reused
        return moved

    def _drop_stale_buffers(self, backend: MemoryBackend) -> None:
        """Forget the step's host buffers of parameters no longer on the device (halved into a master, or in a
        layer offloaded since): those step on the host as they are, and their buffers, a copy of the weights and
        one of the gradients, would stay alive on the host until the effect closes."""
        on_device = {id(p) for p in self._parameters() if backend.is_device(p) and p not in self._level}
        self._buffers = {key: buffer for key, buffer in self._buffers.items() if key[0] in on_device}

    def before_apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Where ``plan`` keeps no master weights on the host and some are: each back on the device, in fp32."""
        if not self._level.engaged or _master(plan):
            return False
        self._level.restore(backend)
        return True

    def after_micro_batch(self) -> None:
        self._level.after_micro_batch()

    def step_early(self, host_step: HostStep, host_budget: int | None) -> bool:
        return self._level.step_early(host_step, host_budget)

    def early_backward(self, loss: torch.Tensor) -> bool:
        return self._level.early_backward(loss)

    @property
    def stepped_early(self) -> int:
        return self._level.early.elements if self._level.engaged else 0

    def after_backward(self) -> None:
        self._level.lend_masters()

    def host_stepped(self, params: list[torch.Tensor]) -> None:
        self._level.host_stepped(params)  # (the master level's stepped weights go up as the step goes on)

    @property
    def uploaded_beside(self) -> int:
        return self._level.ascent.beside if self._level.engaged else 0

    def reset(self) -> None:
        self._level.prepare()

    def _move_state(self, backend: MemoryBackend) -> bool:
        moved = False
        for param, state in self.target.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and backend.is_device(value):
                    state[key] = backend.to_host(value)
                    self._moved.setdefault(param, set()).add(key)
                    moved = True
        return moved

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        # The state lives on the optimizer, which the planner rebuilds: only the master level's halved weights (and
        # its hooks on the model) must step aside.
        return self._level.suspended() if self._level.engaged else contextlib.nullcontext()

    def _parameters(self) -> list[torch.nn.Parameter]:
        return [p for group in self.target.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def optimizer_step(self, plan: Plan, backend: MemoryBackend) -> contextlib.AbstractContextManager[None] | None:
        return self._on_host(backend) if plan.optimizer_offload else None

    @contextlib.contextmanager
    def _on_host(self, backend: MemoryBackend) -> Iterator[None]:
        self._backend = backend
        self._move_state(backend)  # state created since (the first step's) goes too
        self._level.ready_for_step()  # (the last backward lent the masters, unless a step runs without it)
        swapped = []
        for group in self.target.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None or not backend.is_device(param):
                    continue  # (no gradient: the step skips it; a master's or an offloaded layer's: on the host)
                host = self._down(backend, param.detach(), param, "param")
                grad = self._down(backend, param.grad, param, "grad")
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
            if stepped:
                self._level.stepped()  # (a failed step leaves the masters lent: a retried step needs them)

    def _down(self, backend: MemoryBackend, tensor: torch.Tensor, param: torch.Tensor, role: str) -> torch.Tensor:
        """A host copy of ``tensor`` in the parameter's reusable buffer for ``role``."""
        copy = self._buffers[id(param), role] = backend.to_host(tensor, self._buffers.get((id(param), role)))
        return copy

    # -- optimizer.load_state_dict() while the state is on the host ------------------------------------
    def _hook_optimizer(self) -> None:
        if self._hooks:
            return
        optimizer = self.target.torch_optimizer  # (inside Accelerate's wrapper)
        self._hooks = [
            optimizer.register_load_state_dict_pre_hook(functools.partial(self._load_state)),
            optimizer.register_load_state_dict_post_hook(functools.partial(self._loaded_state), prepend=True),
        ]

    def _load_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        """Before torch loads: the tensors of each device parameter's entry are taken out of its view of the state
        (it would cast them to the parameter's dtype and device: a halved weight's to bf16 on the device)."""
        saved = state_dict.get("param_groups")
        if self._backend is None or not isinstance(saved, list) or not isinstance(state_dict.get("state"), dict):
            return None
        ids = [key for group in saved for key in group.get("params", [])]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if len(ids) != len(params):
            return None  # (torch refuses it)
        state, self._loading = dict(state_dict["state"]), {}
        for key, param in zip(ids, params, strict=True):
            entry = state.get(key)
            if not isinstance(entry, dict) or not (param in self._level or self._backend.is_device(param)):
                continue
            cast = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
            cast.pop("step", None)  # (torch leaves a step counter where it is)
            if cast:
                state[key] = {k: v for k, v in entry.items() if k not in cast}
                self._loading[param] = cast
        return {**state_dict, "state": state}

    def _loaded_state(self, optimizer: torch.optim.Optimizer) -> None:
        """After torch loaded: those tensors on the host, in the fp32 of a master (else the parameter's dtype)."""
        loading, self._loading, backend = self._loading, {}, self._backend
        if backend is None:
            return
        copies = {p: {k: backend.to_host(v.detach()) for k, v in cast.items()} for p, cast in loading.items()}
        backend.synchronize()  # (the copies are complete before they are converted on the host)
        for param, cast in copies.items():
            dtype = torch.float32 if param in self._level else param.dtype
            optimizer.state[param].update({key: value.to(dtype) for key, value in cast.items()})
            self._moved.setdefault(param, set()).update(cast)
        self._move_state(backend)  # (what torch left on the device, a step counter loaded there)

    def close(self) -> None:
        """The weights and the state back on the device: each fp32 master, what was moved, and what the host
        steps created in the parameter's shape (moments); a step counter the optimizer keeps on the host by
        design stays there."""
        if self._backend is None:
            return
        backend = self.target.backend(self._backend)
        self._level.restore(backend)
        for param, state in self.target.optimizer.state.items():
            if not backend.is_device(param):
                continue  # an offloaded layer's: the layer-offload effect keeps its state
            moved = self._moved.get(param, set())
            for key, value in list(state.items()):
                host = isinstance(value, torch.Tensor) and not backend.is_device(value)
                if host and (key in moved or value.shape == param.shape):
                    state[key] = backend.to_device(value)  # may run out of memory: then the rest stays moved
            self._moved.pop(param, None)
        for hook in self._hooks:
            hook.remove()
        self._backend, self._buffers, self._hooks = None, {}, []
