"""Layer offload's copies of streamed weights that a forward saved for backward, made again in backward
(:mod:`.layers`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Recast", "Recasts", "recast_of"]


@dataclass(frozen=True)
class Recast:
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


def recast_of(tensor: torch.Tensor, streamed: set[int]) -> Recast | None:
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
    param: torch.Tensor | None = getattr(source, "variable", None)  # AccumulateGrad: the leaf the copy was made of
    if param is None or id(param) not in streamed:
        return None
    return Recast(
        param,
        tensor.dtype,
        tensor.device,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        int(tensor.storage_offset()),
    )


class Recasts:
    """The saved-tensor hook share of layer offload: copies of streamed weights are made again in backward."""

    def __init__(self, streamed: set[int]) -> None:
        self.streamed = streamed  # (the offloader's own set, kept up to date as blocks come and go)

    def pack(self, tensor: torch.Tensor) -> Recast | None:
        return recast_of(tensor, self.streamed)

    def unpack(self, packed: Recast) -> torch.Tensor:
        return packed.make()

    def finish(self) -> None:
        return None
