"""The layer-offload rung's effect: whole blocks' parameters, gradients and optimizer state in host memory.

Layer offload streams a block's parameters the way FSDP does: each parameter keeps one device tensor whose
*storage* is resized to zero when the block is not in use and refilled from the host copy just before use. The
autograd graph keeps views of that storage (a linear layer saves ``weight.t()``), so swapping ``p.data`` alone
would free nothing; emptying the storage frees it while those views stay valid for the refill before backward.
Copies go through the memory backend's primitives only, so the same code runs on CUDA and on the simulated device.

While one block computes, the next one in the pass's direction (block k+1 in forward, k-1 in backward, checkpoint
recomputes included) is brought in beside it (:meth:`~oomguard._backends.memory.MemoryBackend.prefetch`: on CUDA
on the copy stream, the compute waiting only when it reaches that block), so that the link works while the device
does: at most two offloaded blocks are resident at once, where one was; so only where at least
:data:`PREFETCH_FROM` blocks are offloaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.base import Effect, EffectTarget, Packer
from oomguard._effects.hooks import aside
from oomguard._effects.recast import Recasts
from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan

__all__ = ["PREFETCH_FROM", "LayerOffloadEffect", "LayerOffloader"]

#: How many blocks must be offloaded for the next one to come in while one computes: with ``n`` offloaded, two are
#: resident at once, so streaming relieves ``n - 1`` blocks' weights where it relieved ``n``; from 3 on it keeps at
#: least two thirds of that (with 2, half: the ladder's second level would gain nothing on its first).
PREFETCH_FROM = 3


@dataclass(eq=False)
class _Streamed:
    """One offloaded parameter: its host master copy, its device tensor, and its gradient on the host."""

    param: torch.nn.Parameter
    host: torch.Tensor
    device: torch.Tensor
    grad: torch.Tensor | None = None
    moved: frozenset[str] = frozenset()  # optimizer-state keys moved to the host with it


@dataclass(eq=False)
class _Block:
    module: torch.nn.Module
    params: list[_Streamed]
    resident: bool = False
    #: Gradients still to arrive in this backward before the block can be released; None for a block with frozen
    #: parameters (a LoRA base layer), whose weights backward may still need after its last gradient arrived: it
    #: is released once the gradient of its input is complete (or after backward).
    pending: int | None = 0
    handles: list[Any] = field(default_factory=list)
    #: While the block's weights are on their way up beside the compute (prefetched): what the compute calls to
    #: wait for them before it reads them.
    arriving: list[Callable[[], None]] = field(default_factory=list)


def _resizable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, whose storage the offloader empties and refills; where that storage cannot be resized (a weight
    mapped from a file: a model ``from_pretrained`` loaded on the CPU, under a SimulatedGPU) a copy of it in one that
    can, made before the block changes (an out-of-memory error here leaves it as it was), the mapped one let go
    with the parameter's data. A bitsandbytes 4-bit weight is streamed as its packed codes, through ``.data``: its
    quantization state stays on the device, and ``Params4bit.to``, which moves that shared state, is never called."""
    return tensor if tensor.untyped_storage().resizable() else tensor.clone()


class LayerOffloader:
    """Keeps the parameters, gradients and optimizer state of ``blocks`` in host memory.

    A block's parameters are brought to the device just before its forward and just before its backward, and
    released after each; gradients are moved to the host as soon as autograd has accumulated them. Between
    steps the parameters *are* the host copies, so ``optimizer.step()`` (and its state) runs on the host.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backend: MemoryBackend) -> None:
        self.backend = backend
        self.optimizer = optimizer
        self.blocks: list[_Block] = []
        self.prefetch_from = PREFETCH_FROM  # (see the module; the effect sets its target's at each apply)
        self.streamed: set[int] = set()  # ids of every streamed parameter

    def device_storages(self) -> set[int]:
        """Identities of the device storages streamed weights use (they persist, resized in place)."""
        return {id(item.device.untyped_storage()) for block in self.blocks for item in block.params}

    def add(self, module: torch.nn.Module) -> None:
        """Offload one more block. Only host memory is allocated, but for the copy of a weight whose storage cannot
        be resized (:func:`_resizable`), made before anything changes: an out-of-memory error leaves the block as it
        was."""
        params = [  # a parameter shared with a block already offloaded is streamed by that block
            _Streamed(p, self.backend.to_host(p.data), _resizable(p.data))
            for p in module.parameters()
            if id(p) not in self.streamed
        ]
        states = [self._state_tensors(item.param, on=item.device.device) for item in params]
        for item, state in zip(params, states, strict=True):
            item.moved = frozenset(state)
        host_states = [{key: self.backend.to_host(value) for key, value in state.items()} for state in states]
        self.backend.synchronize()  # every host copy has landed before the device memory is let go
        block = _Block(module, params)
        for item, host_state in zip(params, host_states, strict=True):
            if host_state:  # (no empty entry: an entry's absence means "state not built yet")
                self.optimizer.state[item.param].update(host_state)
            item.param.data = item.host
            self.backend.resize_storage(item.device, 0)
        block.handles.append(module.register_forward_pre_hook(self._before_forward(block), with_kwargs=True))
        block.handles.append(module.register_forward_hook(self._after_forward(block)))
        for item in params:
            if item.param.requires_grad:
                hook = self._grad_ready(block)
                block.handles.append(item.param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        self.blocks.append(block)
        self.streamed.update(id(item.param) for item in params)

    def restore_last(self) -> None:
        """Bring the most recently offloaded block back to the device, all or nothing.

        Every device allocation (parameters, optimizer state) is made before anything is switched over, so an
        out-of-memory error here leaves the block offloaded and intact.
        """
        block = self.blocks[-1]
        self._release(block)
        sizes = [item.host.numel() * item.host.element_size() for item in block.params]
        grown: list[_Streamed] = []
        try:
            for item, size in zip(block.params, sizes, strict=True):
                self.backend.resize_storage(item.device, size)
                grown.append(item)
            device_states = [
                {
                    key: self.backend.to_device(value)
                    for key, value in self._state_tensors(item.param).items()
                    if key in item.moved or value.shape == item.param.shape
                }
                for item in block.params
            ]
        except BaseException:
            for item in grown:
                self.backend.resize_storage(item.device, 0)
            raise
        for handle in block.handles:
            handle.remove()
        for item, device_state in zip(block.params, device_states, strict=True):
            self.backend.upload(item.device, item.host)
            item.param.data = item.device
            if device_state:
                self.optimizer.state[item.param].update(device_state)
        self.backend.synchronize()
        self.blocks.pop()
        self.streamed.difference_update(id(item.param) for item in block.params)

    def _state_tensors(self, param: torch.Tensor, on: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The optimizer state of ``param``: every tensor, or only those on device ``on``.

        Moments move with the parameter; so does a step counter kept on the device (capturable/fused Adam),
        while one kept on the host (the default) stays there.
        """
        state = self.optimizer.state.get(param, {})
        return {
            key: value
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and (on is None or value.device == on)
        }

    # -- streaming ------------------------------------------------------------------------------------
    def _materialize(self, block: _Block) -> None:
        """``block`` on the device for the compute that follows, and the next block of this pass on its way."""
        self._bring(block, prefetch=False)
        waits, block.arriving = block.arriving, []
        for wait in waits:  # (prefetched: the compute waits for the copies, the host does not)
            wait()
        index = self.blocks.index(block)
        following = index - 1 if torch._C._current_graph_task_id() != -1 else index + 1  # (backward: the one before)
        if len(self.blocks) >= self.prefetch_from and 0 <= following < len(self.blocks):
            self._bring(self.blocks[following], prefetch=True)

    def _bring(self, block: _Block, prefetch: bool) -> None:
        if block.resident:
            return
        block.resident = True  # first: if an allocation below fails, reset() still releases what was grown
        for item in block.params:
            self.backend.resize_storage(item.device, item.host.numel() * item.host.element_size())
            if prefetch:
                block.arriving.append(self.backend.prefetch(item.device, item.host))
            else:
                self.backend.upload(item.device, item.host)
            item.param.data = item.device
        frozen = any(not item.param.requires_grad for item in block.params)
        block.pending = None if frozen else sum(1 for item in block.params if item.param.requires_grad)

    def _release(self, block: _Block) -> None:
        block.arriving = []  # (a prefetched block let go unread: on CUDA its copy still holds the memory)
        if not block.resident:
            return
        for item in block.params:
            item.param.data = item.host
            self.backend.resize_storage(item.device, 0)
        block.resident = False

    def _before_forward(self, block: _Block) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self._materialize(block)
            if block.pending is None and torch.is_grad_enabled():  # frozen weights: see _Block.pending
                for leaf in tree_flatten((args, kwargs))[0]:
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        leaf.register_hook(self._after_backward(block))  # type: ignore[no-untyped-call]

        return hook

    def _after_backward(self, block: _Block) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._release(block)  # the block's backward is done: its input's gradient is complete

        return hook

    def _after_forward(self, block: _Block) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # a checkpoint recompute inside backward: the backward that follows needs the weights
            if torch.is_grad_enabled():
                for leaf in tree_flatten(output)[0]:
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        leaf.register_hook(self._before_backward(block))  # type: ignore[no-untyped-call]
            self._release(block)

        return hook

    def _before_backward(self, block: _Block) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._materialize(block)

        return hook

    def _grad_ready(self, block: _Block) -> Callable[[torch.Tensor], None]:
        by_param = {id(item.param): item for item in block.params}

        def hook(param: torch.Tensor) -> None:
            item = by_param[id(param)]
            grad = param.grad
            if grad is not None:
                if item.grad is None:  # (the first: nothing reads it before attach_grads, which waits for it)
                    item.grad = self.backend.to_host(grad)
                else:
                    host = self.backend.to_host(grad)
                    self.backend.synchronize()  # the host add below reads it (and every copy before it)
                    item.grad.add_(host)
                param.grad = None  # free the device gradient now (its memory lives until the copy has read it)
            if block.pending is None:
                return  # (released when the gradient of the block's input is complete)
            block.pending -= 1
            if block.pending <= 0:
                self._release(block)

        return hook

    # -- around the optimizer step --------------------------------------------------------------------
    def attach_grads(self) -> None:
        """After the last backward: release every block and hand the host gradients to the parameters (their
        copies complete: the step reads them on the host)."""
        self.backend.synchronize()
        for block in self.blocks:
            self._release(block)
            for item in block.params:
                item.param.grad = item.grad
                item.grad = None

    def reset(self) -> None:
        """After a failed attempt: release every block and drop partial host gradients."""
        for block in self.blocks:
            self._release(block)
            for item in block.params:
                item.grad = None
                item.param.grad = None

    def close(self) -> None:
        """Undo everything: hooks removed, parameters and optimizer state back on the device."""
        self.reset()
        while self.blocks:
            self.restore_last()

    def hooks_aside(self) -> contextlib.AbstractContextManager[None]:
        """Every streaming hook out of its table for a while (see :func:`oomguard._effects.hooks.aside`)."""
        return aside(handle for block in self.blocks for handle in block.handles)


class LayerOffloadEffect(Effect):
    """Offloads as many of the model's blocks as the plan says, one at a time, and streams them in for use."""

    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._layers: LayerOffloader | None = None

    @property
    def offloaded(self) -> int:
        """How many blocks are offloaded now."""
        return len(self._layers.blocks) if self._layers is not None else 0

    @property
    def holds(self) -> bool:
        return self.offloaded > 0

    @property
    def held(self) -> str:
        return f"{self.offloaded} offloaded block(s)"

    def check(self, plan: Plan) -> None:
        blocks = len(self.target.blocks)
        if plan.offload_layers > blocks:
            raise GuardConfigError(
                f"the plan offloads {plan.offload_layers} layer(s) but {type(self.target.model).__name__} has "
                f"{blocks} repeated block(s), the unit layer offload moves (an nn.ModuleList of same-typed "
                f"layers); assign a Plan with offload_layers <= {blocks}"
            )

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        if self._layers is None and plan.offload_layers:
            self._layers = LayerOffloader(self.target.optimizer, backend)
        layers = self._layers
        if layers is not None:
            ahead = self.target.prefetch_from
            layers.prefetch_from = PREFETCH_FROM if ahead is None else ahead
        if layers is None or plan.offload_layers == len(layers.blocks):
            return False
        try:
            # One block at a time: offloading more only moves memory to the host; restoring is all-or-nothing
            # per block, so an OOM part-way leaves a consistent (if deeper) configuration to retry from.
            while len(layers.blocks) < plan.offload_layers:
                layers.add(self.target.blocks[len(layers.blocks)])
            while len(layers.blocks) > plan.offload_layers:
                layers.restore_last()
        finally:
            self.target.streamed = layers.device_storages()
        return True

    def packer(self, plan: Plan, backend: MemoryBackend) -> Packer | None:
        return Recasts(self._layers.streamed) if self._layers is not None and self._layers.blocks else None

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        # Between steps a streamed parameter *is* its host copy (shape and dtype as the user made it): only the
        # streaming hooks, which would fire on the planner's fakes, step aside.
        return self._layers.hooks_aside() if self._layers is not None and self._layers.blocks else None

    def after_backward(self) -> None:
        """Hand offloaded blocks' host gradients to their parameters before clipping and the step."""
        if self._layers is not None:
            self._layers.attach_grads()

    def reset(self) -> None:
        if self._layers is not None:
            self._layers.reset()

    def close(self) -> None:
        if self._layers is None:
            return
        self._layers.backend = self.target.backend(self._layers.backend)  # (see EffectTarget.backend)
        try:
            self._layers.close()
            self._layers = None
        finally:
            self.target.streamed = self._layers.device_storages() if self._layers is not None else set()
