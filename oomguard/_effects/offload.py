"""Offloading to host memory: saved activations, and whole blocks' parameters, gradients and optimizer state.

Both go through the memory backend's copy primitives only (``to_host``, ``to_device``), so the same code runs on
CUDA (pinned host memory, non-blocking copies) and on :class:`~oomguard.testing.SimulatedGPU` (where a host
copy leaves the accounting and a device copy enters it).

Layer offload streams a block's parameters the way FSDP does: each parameter keeps one device tensor whose
*storage* is resized to zero when the block is not in use and refilled from the host copy just before use. The
autograd graph keeps views of that storage (a linear layer saves ``weight.t()``), so swapping ``p.data`` alone
would free nothing; emptying the storage frees it while those views stay valid for the refill before backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from oomguard._backends.memory import MemoryBackend

__all__ = ["ActivationOffloader", "LayerOffloader", "saved_tensor_hooks"]


class _HostCopy:
    """One offloaded storage: its host bytes, and the device copy made for backward while it is in use."""

    __slots__ = ("__weakref__", "device", "host")

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.device: weakref.ref[torch.Tensor] | None = None


@dataclass(frozen=True)
class _Packed:
    """A saved tensor as a view into an offloaded storage."""

    copy: _HostCopy
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Recast:
    """A copy of a streamed weight that a forward saved for backward (autocast's half-precision cast, or a view
    of it): made again from the weight when backward needs it, rather than kept on the device in between."""

    param: torch.Tensor
    dtype: torch.dtype
    device: torch.device
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def make(self) -> torch.Tensor:
        copy = self.param.detach().to(device=self.device, dtype=self.dtype)
        return copy.as_strided(self.size, self.stride, self.offset)


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole storage under ``tensor`` as a flat view of its dtype (nothing is copied); None if it does not
    divide into elements of that dtype. A view, not ``set_``: fake tensors (the planner's) would keep a storage
    given to ``set_`` alive for good."""
    nbytes, itemsize = tensor.untyped_storage().nbytes(), tensor.element_size()
    if nbytes % itemsize:
        return None
    return tensor.detach().as_strided((nbytes // itemsize,), (1,), 0)


class ActivationOffloader:
    """Saved-tensor hooks that keep activations saved for backward in host memory.

    Each storage is copied once however many saved views share it, and brought back once per backward however
    many times it is unpacked. Leaves (parameters, inputs) stay where they are. Every other saved tensor is
    offloaded, however small: a pack hook that hands back a tensor an op saved of its *own output* makes a
    reference cycle through autograd's C++ graph (node -> saved tensor -> grad_fn -> node) that only backward
    breaks, so after a forward that fails it would never be freed.
    """

    def __init__(self, backend: MemoryBackend, keep: Callable[[torch.UntypedStorage], bool]) -> None:
        self.backend = backend
        self.keep = keep  # storages that must stay on the device (parameters)
        self._copies: dict[int, tuple[weakref.ref[torch.UntypedStorage], _HostCopy]] = {}

    def pack(self, tensor: torch.Tensor) -> Any:
        """A saved tensor, or a handle on its host copy."""
        if tensor.grad_fn is None or not self.backend.is_device(tensor) or tensor.layout != torch.strided:
            return tensor
        storage = tensor.untyped_storage()
        if self.keep(storage):
            return tensor
        known = self._copies.get(id(storage))
        if known is None or known[0]() is not storage:
            whole = _whole_storage(tensor)
            if whole is None:
                return tensor
            copy = _HostCopy(self.backend.to_host(whole))
            known = (weakref.ref(storage), copy)
            self._copies[id(storage)] = known
        return _Packed(
            known[1], tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset())
        )

    def unpack(self, packed: Any) -> torch.Tensor:
        """What :meth:`pack` saved, back on the device."""
        if not isinstance(packed, _Packed):
            return packed  # type: ignore[no-any-return]
        copy = packed.copy
        device = copy.device() if copy.device is not None else None
        if device is None:
            device = self.backend.to_device(copy.host)
            copy.device = weakref.ref(device)
        flat = device if device.dtype == packed.dtype else device.view(packed.dtype)  # another view's dtype
        return flat.as_strided(packed.size, packed.stride, packed.offset)

    def forget(self) -> None:
        """Drop the index of host copies once a forward is over (the packed handles hold what backward needs)."""
        self._copies.clear()


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
    pending: int = 0  # gradients still to arrive in this backward before the block can be released
    handles: list[Any] = field(default_factory=list)


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
        self._streamed: set[int] = set()  # ids of every streamed parameter

    def device_storages(self) -> set[int]:
        """Identities of the device storages streamed weights use (they persist, resized in place)."""
        return {id(item.device.untyped_storage()) for block in self.blocks for item in block.params}

    def add(self, module: torch.nn.Module) -> None:
        """Offload one more block. Only host memory is allocated, so this cannot run the device out of memory."""
        params = [  # a parameter shared with a block already offloaded is streamed by that block
            _Streamed(p, self.backend.to_host(p.data), p.data)
            for p in module.parameters()
            if id(p) not in self._streamed
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
        block.handles.append(module.register_forward_pre_hook(self._before_forward(block)))
        block.handles.append(module.register_forward_hook(self._after_forward(block)))
        for item in params:
            if item.param.requires_grad:
                hook = self._grad_ready(block)
                block.handles.append(item.param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        self.blocks.append(block)
        self._streamed.update(id(item.param) for item in params)

    def recast_of(self, tensor: torch.Tensor) -> _Recast | None:
        """A handle that re-makes ``tensor`` in backward if it is a copy of a streamed weight, else None.

        Under autocast a linear layer saves the half-precision copy of its weight (as ``weight.t()``): kept, the
        copies of every offloaded block would stay on the device from forward to backward, half the size of the
        weights offload took off it. Casting again in backward, from the weight brought back for it, costs one
        copy per use.
        """
        base = tensor._base if tensor._base is not None else tensor
        node = base.grad_fn
        if node is None or node.name() != "ToCopyBackward0":
            return None
        source = node.next_functions[0][0]
        param = getattr(source, "variable", None)  # AccumulateGrad: the leaf the copy was made of
        if param is None or id(param) not in self._streamed:
            return None
        return _Recast(
            param,
            tensor.dtype,
            tensor.device,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
        )

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
            item.device.copy_(item.host, non_blocking=True)
            item.param.data = item.device
            if device_state:
                self.optimizer.state[item.param].update(device_state)
        self.backend.synchronize()
        self.blocks.pop()
        self._streamed.difference_update(id(item.param) for item in block.params)

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
        if block.resident:
            return
        block.resident = True  # first: if an allocation below fails, reset() still releases what was grown
        for item in block.params:
            self.backend.resize_storage(item.device, item.host.numel() * item.host.element_size())
            item.device.copy_(item.host, non_blocking=True)
            item.param.data = item.device
        block.pending = sum(1 for item in block.params if item.param.requires_grad)

    def _release(self, block: _Block) -> None:
        if not block.resident:
            return
        for item in block.params:
            item.param.data = item.host
            self.backend.resize_storage(item.device, 0)
        block.resident = False

    def _before_forward(self, block: _Block) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._materialize(block)

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
                host = self.backend.to_host(grad)
                self.backend.synchronize()  # the host add below reads it
                item.grad = host if item.grad is None else item.grad.add_(host)
                param.grad = None  # free the device gradient now
            block.pending -= 1
            if block.pending <= 0:
                self._release(block)

        return hook

    # -- around the optimizer step --------------------------------------------------------------------
    def attach_grads(self) -> None:
        """After the last backward: release every block and hand the host gradients to the parameters."""
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


@contextmanager
def saved_tensor_hooks(layers: LayerOffloader | None, activations: ActivationOffloader | None) -> Iterator[None]:
    """The saved-tensor hooks of one forward: copies of streamed weights are made again in backward, and with
    activation offload every other activation saved for backward goes to the host. One pair of hooks for both,
    since only the innermost pair applies."""

    def pack(tensor: torch.Tensor) -> Any:
        recast = layers.recast_of(tensor) if layers is not None else None
        if recast is not None:
            return recast
        if activations is not None:
            return activations.pack(tensor)
        # Detached: a tensor an op saved of its own output, handed back with its grad_fn, would make a cycle
        # through autograd's graph that only backward breaks (see ActivationOffloader). Unpacked, autograd gives
        # it back its history.
        return tensor.detach() if tensor.grad_fn is not None else tensor

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Recast):
            return packed.make()
        return activations.unpack(packed) if activations is not None else packed

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        if activations is not None:
            activations.forget()
