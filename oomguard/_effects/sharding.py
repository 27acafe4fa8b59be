"""Whether the model is sharded by FSDP2 (``fully_shard``): a fact the rungs that cannot work on sharded
parameters (DTensors, gathered and freed by FSDP inside forward and backward) read to stay off the ladder.

What each rung does under FSDP2, and why, is told in docs/fsdp.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from oomguard._effects.base import EffectTarget

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # (a torch built without torch.distributed, or older than FSDP2's public name)
    FSDPModule = None  # type: ignore[assignment,misc]

__all__ = ["SHARDED", "is_fsdp", "sharded_fact"]

#: The name of the fact (see :meth:`oomguard.Rung.facts`): True where FSDP2 shards the model.
SHARDED = "fsdp_sharded"


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) wrapped ``model`` or any module inside it (where torch has no public
    ``FSDPModule``: any module whose class ``fully_shard`` named ``FSDP<Name>``)."""
    if FSDPModule is None:
        return any(type(module).__name__.startswith("FSDP") for module in model.modules())
    return any(isinstance(module, FSDPModule) for module in model.modules())


def sharded_fact(target: EffectTarget) -> Mapping[str, Any]:
    """The fact for a rung's :meth:`~oomguard.Rung.facts`: whether the target's model is sharded by FSDP2."""
    return {SHARDED: is_fsdp(target.model)}
