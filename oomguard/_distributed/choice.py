"""Which agreement protocol a guard's model needs: none in a single process, torch's FSDP2 collectives gated where
``fully_shard`` wrapped it, the plain one otherwise. Apart from :mod:`oomguard._distributed.fsdp`, which imports torch's
FSDP (about a second) only where a model is sharded."""

from __future__ import annotations

import torch
import torch.distributed as dist

from oomguard._distributed.agreement import Agreement, distributed_active
from oomguard._effects.sharding import is_fsdp
from oomguard._ladder.ladder import Ladder

__all__ = ["agreement_for"]


def agreement_for(model: torch.nn.Module, device: torch.device, ladder: Ladder) -> Agreement | None:
    """The agreement protocol for ``model`` (None: a single process, nothing to agree): with FSDP's collectives
    gated where ``fully_shard`` wrapped it. An FSDP2 model on a process group of one gets it too, for its
    micro-batching and for the reset of FSDP's state after a failed attempt (its gates agree with itself)."""
    if is_fsdp(model) and dist.is_available() and dist.is_initialized():
        from oomguard._distributed.fsdp import FSDPAgreement  # (imported where needed: see above)

        return FSDPAgreement(model, device, ladder)
    return Agreement(device, ladder) if distributed_active() else None
