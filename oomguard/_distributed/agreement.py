"""Keeping every rank of a distributed job in agreement, so an OOM on one rank never hangs the others.

The hazard: a collective that one rank enters and another never reaches blocks forever (NCCL) or aborts
(gloo). DDP puts collectives inside forward (buffer broadcast) and inside backward (the gradient all-reduce),
and a rank that runs out of memory there skips them. The scheme here puts every collective at a point all ranks
are sure to reach, whatever failed where:

1. **Plan.** At the start of a call all ranks agree on the plan (the most conservative of their choices).
2. **Forward and backward** of every micro-batch run under DDP's ``no_sync()``, with DDP's forward-time
   buffer broadcast switched off: no collective at all. A rank that fails anywhere in this phase (applying the
   plan, splitting, forward, backward) catches the error and goes on to
3. **Agreement A**, one all-reduce (MAX) of a few integers: did any rank fail, in which phase, how large a
   micro-batch the peak models allow, and can every rank take the optimizer step without a journal. If any rank
   failed, every rank raises (the failing one its own OOM, the others :class:`PeerOutOfMemory`), and all
   recover and escalate identically from the agreed figures.
4. **Gradient all-reduce**, in place (no allocation, so it cannot run out of memory), averaged as DDP does;
   gradients the offload rungs keep on the host (fp32 master sums, offloaded blocks') in a gloo group under NCCL.
5. **Clip, optimizer step and scheduler step**, journaled unless every rank agreed it can skip the journal,
   then **agreement B**: if any rank failed, every rank rolls its step back and raises; nobody has stepped.
6. After a successful step, rank 0's buffers are broadcast (what DDP's next forward would have done).

Every rank runs the same collectives in the same order whatever happened, and the agreement tensor is
allocated once, up front: agreeing allocates no device memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from oomguard._distributed.peers import OUTCOMES, Outcome
from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Phase, Plan

__all__ = ["Agreement", "Verdict", "ddp_of", "distributed_active", "quiet_ddp", "unwrap"]

# A failure's phase as a number: the deepest any rank reached wins the MAX, and every rank escalates from it.
_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.APPLY)
_LEAST = -(2**62)  # what a rank sends where only rank 0's figure counts
_PHASE_CODE = {Phase.SPLIT: 0, Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.CLIP: 2, Phase.OPTIMIZER: 2, Phase.APPLY: 3}


def distributed_active() -> bool:
    """Whether this process is one rank of an initialised process group of two or more."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def ddp_of(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP wrapper if ``model`` is one."""
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed after forward and backward."""

    outcome: Outcome  # the worst of all ranks
    phase: Phase  # the deepest phase any rank failed in
    journal: bool  # some rank needs a journaled optimizer step


class Agreement:
    """The agreement protocol of one guard: fixed-size all-reduces on a buffer allocated once."""

    def __init__(self, device: torch.device, ladder: Ladder) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        on_device = dist.get_backend() == "nccl"  # NCCL reduces device tensors, gloo host tensors
        width = max(3, len(ladder.known))  # a level per rung a plan can hold, or agreement A's three figures
        self._buffer = torch.zeros(width, dtype=torch.int64, device=device if on_device else torch.device("cpu"))
        # Gradients the offload rungs keep on the host (the master level's fp32 sums, offloaded blocks') are
        # all-reduced where NCCL cannot: in a gloo group of the same ranks (made now, while every rank is here).
        self._host_group = dist.new_group(backend="gloo") if on_device else None

    def plan(self, plan: Plan, batch_size: int, ladder: Ladder) -> Plan:
        """The plan every rank uses: per rung, the deepest level any rank chose."""
        levels = self._all_max(*ladder.levels(plan, batch_size))
        return ladder.at_levels(plan, levels, batch_size)

    def after_backward(self, outcome: Outcome, phase: Phase, journal: bool) -> Verdict:
        """Agreement A: how every rank's forward and backward went, and whether any needs a journal."""
        code = _PHASE_CODE.get(phase, 0) if outcome != "ok" else 0
        agreed = self._all_max(OUTCOMES.index(outcome), code, int(journal))
        return Verdict(OUTCOMES[agreed[0]], _PHASES[agreed[1]], bool(agreed[2]))

    def after_step(self, outcome: Outcome) -> Outcome:
        """Agreement B: the worst outcome of every rank's clip, optimizer step and scheduler step."""
        return OUTCOMES[self._all_max(OUTCOMES.index(outcome))[0]]

    def plans_of_rank0(
        self, plans: list[Plan] | None, base: Plan, batch_size: int, ladder: Ladder
    ) -> list[Plan] | None:
        """Rank 0's ``plans`` on every rank (tuning's trials: rank 0 searches, every rank tries the same plans in
        the same order); None where rank 0 has none (yet). ``base``: the plan each is described relative to."""
        count = self._from_rank0([-1 if plans is None else len(plans)], 1)[0]
        if count < 0:
            return None
        width = len(ladder.levels(base, batch_size))
        shared = []
        for index in range(count):
            own = ladder.levels(plans[index], batch_size) if plans is not None else []
            shared.append(ladder.at_levels(base, self._from_rank0(own, width), batch_size))
        return shared

    def slowest(self, seconds: float) -> float:
        """The longest of every rank's ``seconds`` (tuning's times: the slowest rank sets the job's pace)."""
        return self._all_max(round(seconds * 1e6))[0] / 1e6

    def micro_batch(self, last: bool) -> None:
        """Before each micro-batch's forward (``last``: the attempt's last one). Nothing under DDP, whose
        gradients are reduced after agreement A; FSDP2 syncs in the last backward (see ``fsdp``)."""

    def reset(self) -> None:
        """After a failed attempt, before the retry: nothing under DDP (see ``quiet_ddp``); FSDP2 resets its
        iteration state."""

    def clip(self, params: list[torch.Tensor], max_norm: float) -> float | None:
        """Clip the gradients of ``params`` to ``max_norm`` where the protocol must (FSDP2: sharded gradients,
        whose norm is a collective); None under DDP, whose gradients are whole on every rank: the runner clips."""
        return None

    def close(self) -> None:
        """The guard closed: put back what the protocol changed on the model (nothing under DDP)."""

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (a bound hit on one rank's clock stops them all)."""
        return bool(self._all_max(int(flag))[0])

    def _from_rank0(self, values: list[int], length: int) -> list[int]:
        """Rank 0's ``length`` ``values`` on every rank (the others' are ignored): a MAX in which the others send
        the least there is."""
        own = values if self.rank == 0 else [_LEAST] * length
        return self._all_max(*own)

    def _all_max(self, *values: int) -> list[int]:
        buffer = self._buffer
        with torch.no_grad():
            buffer.zero_()
            for index, value in enumerate(values):  # fill_ in place: `buffer[i] = v` would allocate a tensor
                buffer[index].fill_(value)
            dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
        return [int(v) for v in buffer.tolist()[: len(values)]]

    # -- gradients and buffers ------------------------------------------------------------------------
    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """All-reduce every gradient in place and divide by the world size, as DDP does."""
        with torch.no_grad():
            works = [
                dist.all_reduce(p.grad, group=self._group_of(p.grad), async_op=True)
                for p in params
                if p.grad is not None
            ]
            for work in works:
                if work is not None:
                    work.wait()
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self.world)

    def _group_of(self, tensor: torch.Tensor) -> Any:
        """The process group that reduces ``tensor``: the default one, or the gloo one for a host tensor."""
        return self._host_group if self._host_group is not None and tensor.device.type == "cpu" else None

    def broadcast_buffers(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Rank 0's buffers to every rank, in place (DDP's forward-time broadcast, done at a safe point)."""
        if not getattr(ddp, "broadcast_buffers", False):
            return
        with torch.no_grad():
            for buffer in ddp.module.buffers():
                dist.broadcast(buffer, src=0)


@contextlib.contextmanager
def quiet_ddp(ddp: torch.nn.parallel.DistributedDataParallel | None) -> Iterator[None]:
    """DDP with no collective inside forward or backward: ``no_sync()``, and no forward buffer broadcast."""
    if ddp is None:
        yield
        return
    ddp.require_forward_param_sync = False  # the same known state on every rank, whatever failed before
    try:
        with ddp.no_sync():
            yield
    finally:  # (a failed forward too: DDP's next forward must not broadcast buffers in the middle of a retry)
        ddp.require_forward_param_sync = False


def unwrap(model: torch.nn.Module) -> Any:
    """The module inside DDP (and similar wrappers with ``.module``)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) and ddp_of(model) is not None else model
