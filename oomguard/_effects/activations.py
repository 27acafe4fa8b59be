"""The activation-offload rung's effect: tensors saved for backward are kept in host memory until backward.

It goes through the memory backend's copy primitives only (``to_host``, ``to_device``), so the same code runs on
CUDA (pinned host memory, non-blocking copies) and on the simulated device of :mod:`oomguard._backends` (where a
host copy leaves the accounting and a device copy enters it). Each copy keeps the guard's host budget as it is made,
and is counted (:mod:`oomguard._effects.activation_host`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.activation_host import ActivationLedger
from oomguard._effects.base import Effect, Packer
from oomguard._ladder.plan import Plan

__all__ = ["ActivationOffloadEffect", "ActivationOffloader"]


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

    def __init__(
        self, backend: MemoryBackend, keep: Callable[[torch.UntypedStorage], bool], ledger: ActivationLedger, plan: Plan
    ) -> None:
        self.backend = backend
        self.keep = keep  # storages that must stay on the device (parameters)
        # Where the host budget is kept as each copy is made, and the copies counted (see activation_host); the plan,
        # whose other offloading the budget's check counts where the backend does not count the host.
        self.ledger, self.plan = ledger, plan
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
            nbytes = whole.untyped_storage().nbytes()
            self.ledger.reserve(nbytes, self.plan, self.backend)  # (refused before the copy, past the host budget)
            copy = _HostCopy(self.backend.to_host(whole))
            self.ledger.add(copy, nbytes)  # (counted until the graph that saved it lets it go)
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

    def finish(self) -> None:
        """Drop the index of host copies once a forward is over (the packed handles hold what backward needs)."""
        self._copies.clear()


class ActivationOffloadEffect(Effect):
    """Saved activations to the host, around each forward of a plan with ``activation_offload``."""

    def packer(self, plan: Plan, backend: MemoryBackend) -> Packer | None:
        if not plan.activation_offload:
            return None
        # Parameters stay on the device, and so do streamed weights (whose storage is refilled only later).
        keep = {id(p.untyped_storage()) for p in self.target.model.parameters()} | self.target.streamed
        return ActivationOffloader(backend, lambda storage: id(storage) in keep, self.target.activation_host, plan)

    def reset(self) -> None:
        self.target.activation_host.failed()  # (a forward cut short measures nothing)
