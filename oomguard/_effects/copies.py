"""The device copy of a halved weight at the master level (:mod:`.masters`): which storage it is, whether what a
parameter points at is still it, and the master merged with what was written into it; and the copies of a model
whose weights are halved (``copy.deepcopy``, ``torch.save``): fp32 parameters holding each weight's value.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch

from oomguard._effects.hooks import released

__all__ = ["deep_copies", "layout", "mended", "merged", "ours"]

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


def deep_copies(
    memo: dict[Any, Any],
    key: Hashable,
    values: Callable[[], dict[torch.nn.Parameter, torch.Tensor]],
    places: dict[torch.nn.Parameter, torch.device],
) -> None:
    """``copy.deepcopy`` of a model under way (``memo``): each halved parameter's copy an fp32 parameter holding its
    value (``values()``), on its device (``places``): made here, or, where the copy already met the parameter, given
    that value. ``key`` marks it done (every hook of the model asks; the first answers)."""
    if key in memo:
        return
    memo[key] = True
    keep = memo.setdefault(id(memo), [])  # (copy's own list of originals kept alive while it runs)
    for param, value in values().items():
        fp32 = value.to(places[param], copy=True)
        copied = memo.get(id(param))
        if copied is not None:
            copied.data = fp32
        else:
            memo[id(param)] = type(param)(fp32, param.requires_grad)
            keep.append(param)


def mended(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> Callable[..., None]:
    """An unpickled copy of a model saved at the master level: each halved parameter its fp32 master, where loaded."""
    for param, master in pairs:
        param.data = master.to(param.device)
    return released
