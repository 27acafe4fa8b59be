"""The master level's gradients on their way down to their fp32 sums on the host.

Each halved parameter's bf16 gradient leaves the device as soon as backward has accumulated it (a hook after the
accumulation sends it and the device copy is let go), so the device never holds every gradient at once: where they
all stayed until the end of backward, a step peaked at twice the bf16 weights. The copies of one micro-batch land
together after its backward, one synchronize for all, and each is added to its fp32 sum there (the first copied).
"""

from __future__ import annotations

from typing import Protocol

import torch

from oomguard._backends.memory import MemoryBackend

__all__ = ["Descent", "summed"]


class _Summed(Protocol):
    """What a halved weight keeps on the host for its gradient (see :class:`~oomguard._effects.masters._Weight`)."""

    master: torch.Tensor  # fp32: the sum's shape and dtype
    grad: torch.Tensor | None  # the fp32 sum
    staging: torch.Tensor | None  # a gradient on its way down
    summed: bool  # whether ``grad`` holds this attempt's gradients


class Descent:
    """The gradients sent down in the current backward, until they land in their sums."""

    def __init__(self) -> None:
        self._pending: dict[int, _Summed] = {}  # by the weight's identity, in the order sent

    def send(self, weight: _Summed, grad: torch.Tensor, backend: MemoryBackend) -> None:
        """``grad`` (on the device) on its way into ``weight``'s staging buffer on the host."""
        if id(weight) in self._pending:  # (a second gradient for it in one backward: the first is summed first)
            self.land(backend)
        weight.staging = backend.to_host(grad, weight.staging)
        self._pending[id(weight)] = weight

    def land(self, backend: MemoryBackend) -> None:
        """Every gradient sent: complete, and added to its weight's fp32 sum on the host."""
        if not self._pending:
            return
        backend.synchronize()  # the copies are complete before the host reads them
        for weight in self._pending.values():
            summed(weight)
        self._pending.clear()

    def take(self, weights: list[_Summed]) -> None:
        """``weights``' gradients sent are someone else's to land (:mod:`.early`: a bucket whose step begins)."""
        for weight in weights:
            self._pending.pop(id(weight), None)

    def drop(self) -> None:
        """A failed attempt: what was sent is not summed."""
        self._pending.clear()


def summed(weight: _Summed) -> None:
    """``weight``'s gradient sent down (complete on the host) added to its fp32 sum."""
    assert weight.staging is not None
    if weight.grad is None or weight.grad.shape != weight.master.shape:
        weight.grad = torch.empty_like(weight.master)  # (on the host: made from one)
    if weight.summed:
        weight.grad.add_(weight.staging)  # (bf16 into fp32)
    else:
        weight.grad.copy_(weight.staging)
    weight.summed = True
