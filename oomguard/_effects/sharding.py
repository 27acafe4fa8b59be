"""Whether the model is sharded by FSDP2 (``fully_shard``): a fact the rungs that cannot work on sharded
parameters (DTensors, gathered and freed by FSDP inside forward and backward) read to stay off the ladder.

What each rung does under FSDP2, and why, is told in docs/fsdp.md.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from oomguard._effects.base import EffectTarget
from oomguard._errors import GuardConfigError

__all__ = ["SHARDED", "check_sharded", "is_fsdp", "sharded_fact"]

#: The name of the fact (see :meth:`oomguard.Rung.facts`): True where FSDP2 shards the model.
SHARDED = "fsdp_sharded"
_FSDP = "torch.distributed.fsdp"
#: What the guard needs of torch's FSDP2: its gated comms and the reset after a failed attempt.
_NEEDS = ("set_custom_all_gather", "set_custom_reduce_scatter", "reset_iter_state")


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) wrapped ``model`` or any module inside it (where torch has no public
    ``FSDPModule``: any module whose class ``fully_shard`` named ``FSDP<Name>``). Nothing is, where torch's FSDP
    was never imported: it is not imported here (about a second, at every start of ``oomguard plan``)."""
    if _FSDP not in sys.modules:
        return False
    kind = _fsdp_module()
    if kind is None:
        return any(type(module).__name__.startswith("FSDP") for module in model.modules())
    return any(isinstance(module, kind) for module in model.modules())


def check_sharded(model: torch.nn.Module) -> None:
    """Refuse what the guard cannot keep safe: FSDP1, and FSDP2 on a torch without what the guard needs."""
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            raise GuardConfigError(
                "the model contains FullyShardedDataParallel (FSDP1), which oomguard does not support: an OOM inside "
                "its flat-parameter collectives could hang the other ranks. Shard with FSDP2 instead "
                "(torch.distributed.fsdp.fully_shard per block, then on the root), or use DistributedDataParallel"
            )
    if is_fsdp(model) and not all(hasattr(_fsdp_module(), name) for name in _NEEDS):
        raise GuardConfigError(
            f"the model is sharded with fully_shard (FSDP2), which oomguard guards with torch 2.13 or newer "
            f"(FSDPModule.{', '.join(_NEEDS)}); this is torch {torch.__version__}. Upgrade torch, or use "
            f"DistributedDataParallel"
        )


def _fsdp_module() -> type | None:
    """torch's ``FSDPModule``, where its FSDP was imported and names it."""
    return getattr(sys.modules.get(_FSDP), "FSDPModule", None)


def sharded_fact(target: EffectTarget) -> Mapping[str, Any]:
    """The fact for a rung's :meth:`~oomguard.Rung.facts`: whether the target's model is sharded by FSDP2."""
    return {SHARDED: is_fsdp(target.model)}
