"""What the offload rungs put on the host, in the figures they estimate it from before they engage.

The guard's host budget must be kept *before* a rung moves anything: past it, the job is killed with no exception
(see :mod:`oomguard._backends.host`). The rungs estimate their host bytes from three facts of the model and
optimizer, read once per guard: the bytes of the trainable parameters, the bytes of the optimizer's state per byte
of them (Adam's two moments: 2; read off the state where it exists, else known per optimizer), and each block's
trainable bytes (what layer offload moves, block by block).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from oomguard._effects.base import EffectTarget

__all__ = ["host_facts"]

# State tensors per parameter, each the parameter's size, by optimizer (before its first step makes them).
_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "Adadelta": 2}
_UNKNOWN_STATE = 2  # an optimizer not listed: as much as Adam's (a bound for most)


def _trainable(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_ratio(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of optimizer state per byte of trainable parameters: measured where the state exists (a scalar step
    counter is left out), else by the optimizer's kind (SGD's momentum buffer, RMSprop's average and momentum)."""
    params = _trainable(optimizer)
    if params and all(p in optimizer.state for p in params):
        state = [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim()]
        return _bytes(state) / max(1, _bytes(params))
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    kind = type(optimizer).__name__
    if kind == "SGD":
        return 1.0 if group.get("momentum", 0) else 0.0
    if kind == "RMSprop":
        return 1.0 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    return float(_STATE_TENSORS.get(kind, _UNKNOWN_STATE))


def host_facts(target: EffectTarget) -> Mapping[str, Any]:
    """The facts the offload rungs estimate their host bytes from (see the module)."""
    trainable = {id(p) for p in _trainable(target.optimizer)}
    blocks = tuple(_bytes([p for p in block.parameters() if id(p) in trainable]) for block in target.blocks)
    return {
        "trainable_bytes": _bytes(_trainable(target.optimizer)),
        "state_ratio": _state_ratio(target.optimizer),
        "block_bytes": blocks,
    }
