"""The device copy of a halved weight at the master level (:mod:`.masters`): which storage it is, whether what a
parameter points at is still it, and the master merged with what was written into it.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

__all__ = ["layout", "merged", "ours"]

_BF16 = torch.bfloat16


class _Halved(Protocol):
    master: torch.Tensor  # fp32, host: the weight
    image: torch.Tensor  # bf16, host: what the device copy holds as last uploaded
    layout: tuple[Any, ...]  # the device copy's storage (weakly) and its dtype, shape, strides and offset


def layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    return weakref.ref(tensor.untyped_storage()), tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset()


def ours(weight: _Halved, data: torch.Tensor) -> bool:
    """Whether ``data`` (what ``p.data`` is) is still the device copy the level made, and not a replacement."""
    storage, *layout = weight.layout
    return storage() is data.untyped_storage() and layout == [
        data.dtype,
        data.shape,
        data.stride(),
        data.storage_offset(),
    ]


def merged(weight: _Halved, values: torch.Tensor) -> torch.Tensor:
    """The master with the elements ``values`` (the device copy, on the host) hold otherwise than the image."""
    if values.shape != weight.master.shape:  # (a replacement of another shape: its values whole)
        return values.to(torch.float32, copy=True)
    if values.dtype == _BF16:  # bit patterns: a written -0.0 or NaN counts too
        written = values.view(torch.int16) != weight.image.view(torch.int16)
    else:
        written = values.float() != weight.image.float()
    return torch.where(written, values.float(), weight.master)
