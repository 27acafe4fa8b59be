"""The ``optimizer_offload`` rung's effect: the optimizer's state in host memory, and its step run there.

While engaged, every tensor of the optimizer's state that lives on the device (Adam's moments; a step counter
kept on the device) is moved to the host, freeing it on the device. Around each optimizer step the parameters and
their gradients are copied to host buffers, each parameter points at its host copy while the user's own
optimizer steps (so the state, the maths and the scheduler's learning rates are its own, on the CPU), and the
updated values are copied back into the device parameters; a step that raises copies nothing back. Per step that
moves the parameters and gradients down and the parameters up: 12 bytes per fp32 parameter.

The parameters are copied down each step, not kept as a host master copy, so a parameter changed outside the
step (a loaded checkpoint, an EMA swap) is never overwritten with a stale one.

At the ``"master"`` level (a bf16 plan without offloaded layers) the host does keep the fp32 master weights: each
trainable fp32 parameter on the device becomes a bf16 copy of its master, its gradients come out of backward in
bf16, and a step moves them down (2 bytes per parameter), steps the fp32 masters on the host with fp32 copies of
them, and uploads the masters rounded to bf16 (2 bytes). Weights and gradients take half the device memory. Going
back up (or closing) puts each master back on the device bit for bit. Meanwhile the masters are the weights:
``model.state_dict()`` gives them (a checkpoint saved then is exact), ``load_state_dict`` writes them, and a
parameter written in place on the device some other way (its version counter moves) becomes its master's value
at the next step.
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
from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan

__all__ = ["OptimizerOffloadEffect", "can_step_on_host"]


def can_step_on_host(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can run its step on host tensors (a capturable one keeps its state on the device)."""
    return not any(group.get("capturable", False) for group in optimizer.param_groups)


def _master(plan: Plan) -> bool:
    """Whether ``plan`` keeps fp32 master weights on the host (see the module)."""
    return plan.optimizer_offload == "master" and plan.precision == "bf16" and not plan.offload_layers


class OptimizerOffloadEffect(Effect):
    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._backend: MemoryBackend | None = None  # set while engaged
        self._moved: dict[torch.Tensor, set[str]] = {}  # parameter -> the state keys moved to the host
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}  # reusable host buffers, by parameter and role
        self._masters: dict[torch.nn.Parameter, torch.Tensor] = {}  # parameter -> its fp32 master on the host
        self._versions: dict[torch.nn.Parameter, int] = {}  # parameter -> its version when it matched its master
        self._hooks: list[RemovableHandle] = []  # the model's state_dict and load_state_dict hooks, while halved

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
        moved = self._move_state(backend)
        if _master(plan):
            moved = self._halve(backend) or moved
        if moved:
            backend.synchronize()  # the host copies are complete before the device memory is reused
        return moved

    def before_apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Where ``plan`` keeps no master weights on the host and some are: each back on the device, in fp32."""
        if not self._masters or _master(plan):
            return False
        self._restore_weights(backend)
        return True

    def _move_state(self, backend: MemoryBackend) -> bool:
        moved = False
        for param, state in self.target.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and backend.is_device(value):
                    state[key] = backend.to_host(value)
                    self._moved.setdefault(param, set()).add(key)
                    moved = True
        return moved

    def _halve(self, backend: MemoryBackend) -> bool:
        """Every trainable fp32 parameter on the device: its master to the host, a bf16 copy in its place. All or
        nothing: every copy is made before any parameter changes, so an OOM part-way leaves the model as it was."""
        params = [p for p in self._parameters() if p.dtype == torch.float32 and backend.is_device(p)]
        halves = [param.detach().to(torch.bfloat16) for param in params]  # (may run out of memory: nothing changed)
        for param, half in zip(params, halves, strict=True):
            self._masters[param] = backend.to_host(param.detach())
            self._buffers[id(param), "half"] = backend.to_host(half)  # (pinned on CUDA: uploads run async)
            grad = param.grad
            param.data = half
            param.grad = None if grad is None else grad.to(torch.bfloat16)  # (accumulated so far: kept)
            self._versions[param] = param._version
        if params and not self._hooks:
            model = self.target.model
            self._hooks = [
                # (partials: torch marks the hook it is given, which a bound method cannot take)
                model.register_state_dict_post_hook(functools.partial(self._saving)),  # type: ignore[no-untyped-call]
                model.register_load_state_dict_pre_hook(functools.partial(self._loading)),  # type: ignore[no-untyped-call]
                model.register_load_state_dict_post_hook(functools.partial(self._loaded)),  # type: ignore[no-untyped-call]
            ]
        return bool(params)

    def _named_masters(self, module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in module.named_parameters(remove_duplicate=False):
            master = self._masters.get(param)
            if master is not None:
                yield prefix + name, master

    def _saving(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
        """``state_dict()`` gives each halved parameter's fp32 master (a copy), not its bf16 stand-in."""
        for key, master in self._named_masters(module, prefix):
            if key in state_dict:
                state_dict[key] = master.clone()

    def _loading(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """``load_state_dict()`` writes each halved parameter's master exactly (the bf16 copy follows)."""
        for key, master in self._named_masters(module, prefix):
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.shape == master.shape:
                with torch.no_grad():
                    master.copy_(value.detach().to("cpu"))

    def _loaded(self, module: torch.nn.Module, incompatible: Any) -> None:
        self._versions.update((param, param._version) for param in self._masters)

    def _restore_weights(self, backend: MemoryBackend) -> None:
        """Each master back on the device, in fp32 (may run out of memory: then the rest stay halved)."""
        for param in list(self._masters):
            grad = param.grad
            param.data = backend.to_device(self._masters[param])
            param.grad = None if grad is None else grad.float()
            del self._masters[param]
            self._versions.pop(param, None)
            self._buffers.pop((id(param), "half"), None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        # The state lives on the optimizer, which the planner rebuilds; only halved weights must look like their
        # fp32 masters (the planner fakes each parameter in its dtype).
        return self._masters_in_place() if self._masters else contextlib.nullcontext()

    @contextlib.contextmanager
    def _masters_in_place(self) -> Iterator[None]:
        halves = {param: param.data for param in self._masters}
        try:
            for param, master in self._masters.items():
                param.data = master  # (no copy: the parameter points at its host master for a while)
            yield
        finally:
            for param, half in halves.items():
                param.data = half

    def _parameters(self) -> list[torch.nn.Parameter]:
        return [p for group in self.target.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def optimizer_step(self, plan: Plan, backend: MemoryBackend) -> contextlib.AbstractContextManager[None] | None:
        return self._on_host(backend) if plan.optimizer_offload else None

    @contextlib.contextmanager
    def _on_host(self, backend: MemoryBackend) -> Iterator[None]:
        self._backend = backend
        self._move_state(backend)  # state created since (the first step's) goes too
        self._refresh_masters(backend)
        swapped = []
        for group in self.target.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None or not backend.is_device(param):
                    continue  # (no gradient: the step skips it; an offloaded layer's: already on the host)
                master = self._masters.get(param)
                if master is None:  # fp32 on the device: the parameter and its gradient go down
                    host = self._down(backend, param.detach(), param, "param")
                    grad = self._down(backend, param.grad, param, "grad")
                else:  # bf16 on the device: its gradient goes down, to be widened into an fp32 buffer
                    self._down(backend, param.grad, param, "grad16")
                    if (id(param), "grad") not in self._buffers:
                        self._buffers[id(param), "grad"] = torch.empty_like(master)  # (on the host: made from one)
                    host, grad = master, self._buffers[id(param), "grad"]
                swapped.append((param, param.data, param.grad, host, grad, master))
        backend.synchronize()  # the host copies are complete before the host step reads them
        for param, _, _, _, grad, master in swapped:
            if master is not None:
                grad.copy_(self._buffers[id(param), "grad16"])  # (bf16 to fp32, on the host)
        stepped = False
        try:
            for param, _, _, host, grad, _ in swapped:
                param.data, param.grad = host, grad
            yield
            stepped = True
        finally:
            for param, data, device_grad, host, _, master in swapped:
                param.data, param.grad = data, device_grad
                if master is not None:
                    self._versions[param] = param._version  # (the host step wrote through it)
                if stepped and master is not None:
                    self._buffers[id(param), "half"].copy_(master)  # (fp32 to bf16, on the host)
                    host = self._buffers[id(param), "half"]
                if stepped:
                    backend.upload(data, host)

    def _refresh_masters(self, backend: MemoryBackend) -> None:
        """A halved parameter written in place since its master was last uploaded: its master takes its value."""
        changed = [p for p in self._masters if p._version != self._versions.get(p)]
        for param in changed:
            self._down(backend, param.detach(), param, "half")
        backend.synchronize()
        for param in changed:
            self._masters[param].copy_(self._buffers[id(param), "half"])
            self._versions[param] = param._version

    def _down(self, backend: MemoryBackend, tensor: torch.Tensor, param: torch.Tensor, role: str) -> torch.Tensor:
        """A host copy of ``tensor`` in the parameter's reusable buffer for ``role``."""
        copy = self._buffers[id(param), role] = backend.to_host(tensor, self._buffers.get((id(param), role)))
        return copy

    def close(self) -> None:
        """The weights and the state back on the device: each fp32 master, what was moved, and what the host
        steps created in the parameter's shape (moments); a step counter the optimizer keeps on the host by
        design stays there."""
        backend = self._backend
        if backend is None:
            return
        self._restore_weights(backend)
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
