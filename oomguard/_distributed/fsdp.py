"""FSDP2 (``fully_shard``) under the guard: an OOM agreement that also covers FSDP's own collectives.

DDP can run forward and backward without a collective (``no_sync()``), so its ranks agree once, after backward
(agreement A, see :mod:`oomguard._distributed.agreement`). FSDP2 cannot: every sharded module all-gathers its
parameters before its forward and again before its backward, and reduce-scatters its gradients at the end of its
backward when gradient sync is on. A rank that runs out of memory between two of these leaves the other ranks
waiting in the next one; a rank whose gather buffer cannot be allocated never enters the gather at all.

**The gate.** Every FSDP module of the guarded model gets a custom all-gather and reduce-scatter
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``). Each of their collectives is preceded by exactly one
*gate*: the agreement's all-reduce (the same buffer, width and MAX op as agreement A) of this rank's outcome.

- ``allocate()`` tries the buffer. If that runs out of memory, this rank passes the gate with its failure and
  raises its own error; if it fits, nothing is agreed yet.
- ``__call__`` (just before the collective) passes the gate with "ok". If the gate says some rank failed, this
  rank raises :class:`~oomguard._distributed.peers.PeerOutOfMemory` and never enters the collective.
- A rank that fails anywhere else in forward or backward (compute, FSDP's copy-in between ``allocate`` and the
  collective, a hook) is caught by the step runner, which does agreement A at once: that one all-reduce is its
  failure's gate.

Whichever all-reduce carried a failure, every rank saw it in the same all-reduce (it is a MAX over all ranks)
and *settles* there: no rank does another all-reduce or collective in this attempt. Agreement A, when the runner
then asks for it, answers with the settled verdict without a collective.

**Why every rank does the same number of collectives, whatever failed where.** Number each rank's all-reduces on
the agreement buffer in this attempt: gates g1, g2, ... then agreement A. Forward and backward run the same
modules in the same order on every rank, so FSDP's k-th collective is the same one on every rank, and on every rank
it is preceded by gate k and followed by nothing but local work up to gate k+1 (or A). Let k be the first index at
which some rank sends a failure. Every rank that is still healthy reaches its k-th all-reduce (it has only local
work, collectives 1..k-1 that every rank entered, and gates that all said "ok" in between), so all-reduce k
completes on every rank; it carries the failure, so every rank settles at k and stops. Before it, every rank
entered the same collectives 1..k-1 (gate k precedes collective k everywhere, and collective k is entered only
after gate k said "ok"). So: the same gates, the same FSDP collectives, and every rank raises after the same
count. Two ranks failing in different places send their failures in the same or different all-reduces; the first
one is what everyone settles on (the MAX keeps the worst outcome and the deepest phase), and a rank that already
settled on a peer's failure does not send its own.

After a failed attempt every root FSDP module's iteration state is reset (``reset_iter_state``: in-flight gathers
and reductions waited on and dropped, every group resharded, training states back to idle) and every unsharded
gradient FSDP accumulated for micro-batches without sync is dropped: the retry starts as a fresh step.

**Micro-batching** is FSDP's own: every micro-batch but the last backward without gradient sync
(``set_requires_gradient_sync(False)``, unsharded gradients accumulate on each rank), the last one with it and
``set_is_last_backward(True)``. The reduce-scatter averages over ranks; on gloo it runs as a sum divided afterwards
(gloo's averaging under FSDP2 is silently wrong: pytorch#162338).

**Clipping** sharded gradients needs their norm from every rank: a collective. :meth:`FSDPAgreement.clip` computes
each rank's local squares (it may run out of memory there: the runner then does this rank's agreement B at once),
passes a gate (agreement B's all-reduce: the failing rank's B meets it, everyone settles, and the B after the
step is answered without a collective), then sums the squares over the ranks in a buffer allocated up front and
scales every local gradient in place: nothing after the gate allocates.

Cost: one small all-reduce, and a host sync to read it, per FSDP collective. The gated comms stay installed for
the guard's life, so FSDP collectives outside a guarded call (an evaluation forward) pass gates too: every rank
passes them alike, and an OOM there is only agreed where it hits one of FSDP's buffers (the rest of an
evaluation forward is not the guard's to recover).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.tensor import DTensor
except ImportError:  # (an older torch: check_sharded refuses FSDP2 there)
    FSDPModule = AllGather = ReduceScatter = DTensor = object  # type: ignore[assignment,misc]

from oomguard._distributed.agreement import Agreement, Verdict
from oomguard._distributed.peers import Outcome, failure_outcome, peer_failure
from oomguard._effects.sharding import check_sharded, is_fsdp
from oomguard._ladder.ladder import Ladder
from oomguard._ladder.plan import Phase, Plan

__all__ = ["FSDPAgreement", "check_sharded", "fsdp_modules", "is_fsdp"]


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The modules of ``model`` (itself included) that ``fully_shard`` wrapped."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _roots(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP modules with no FSDP module above them (the model itself, where ``fully_shard`` wrapped it)."""
    inner = {id(child) for module in fsdp_modules(model) for child in list(module.modules())[1:]}  # type: ignore[attr-defined]
    return [module for module in fsdp_modules(model) if id(module) not in inner]


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class FSDPAgreement(Agreement):
    """The agreement of a guard over an FSDP2 model: agreement A and B as under DDP, plus a gate before each of
    FSDP's collectives (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, ladder: Ladder) -> None:
        super().__init__(device, ladder)
        self.roots = _roots(model)
        self.modules = fsdp_modules(model)
        #: What a gate settled in the attempt in flight (None: nothing failed yet); agreement A answers with it.
        self.settled: Verdict | None = None
        self.settled_step: Outcome | None = None  # (what the clip's gate settled)
        self._norm = torch.zeros(1, dtype=torch.float64, device=self._buffer.device)  # the clip's sum of squares
        #: Gates passed with this rank's own failure (an allocation of FSDP's that ran out of memory): a count
        #: tests and logs read.
        self.gate_failures = 0
        self.separate_host = True  # (as the runner's backend: every device the guard runs on but the CPU-only one)
        self._gates = (_GatedAllGather(self), _GatedReduceScatter(self))
        #: Each module's own comms while the gated ones are installed (put back by :meth:`close`).
        self._own: list[tuple[FSDPModule, Any, Any]] = []
        self._install()

    def _install(self) -> None:
        if self._own:
            return
        gather, scatter = self._gates
        for module in self.modules:
            groups = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[attr-defined]
            if not groups:  # (a module fully_shard found no parameters in: it never gathers)
                continue
            group = groups[0]  # (FSDP's setters refuse a module of several groups: a per-parameter mesh)
            self._own.append((module, group._all_gather_comm, group._reduce_scatter_comm))
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)

    def close(self) -> None:
        """The modules' own comms back (the guard closed); the next call installs the gated ones again."""
        for module, gather, scatter in self._own:
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
        self._own = []

    # -- the gate -------------------------------------------------------------------------------------
    def gate(self, outcome: Outcome, phase: Phase) -> Verdict:
        """One all-reduce of this rank's outcome before one of FSDP's collectives; settles on a failure."""
        if self.settled is not None:  # (a rank never gates again once settled: nothing should ask)
            return self.settled
        verdict = Agreement.after_backward(self, outcome, phase, journal=False)
        if verdict.outcome != "ok":
            self.settled = verdict
        return verdict

    def plan(self, plan: Plan, batch_size: int, ladder: Ladder) -> Plan:
        """The plan every rank starts the call on; a gate an FSDP collective passed outside a guarded call (the
        user's evaluation forward) settled nothing this call should read."""
        self.settled = self.settled_step = None
        self._install()  # (every rank: the call is a point all ranks reach)
        return super().plan(plan, batch_size, ladder)

    def after_step(self, outcome: Outcome) -> Outcome:
        """Agreement B, unless the clip's gate settled it (then no collective: every rank settled there)."""
        settled, self.settled_step = self.settled_step, None
        return settled if settled is not None else super().after_step(outcome)

    def clip(self, params: list[torch.Tensor], max_norm: float) -> float:
        """Clip the sharded gradients as ``clip_grad_norm_`` clips the whole ones: each rank's local squares
        (allocations, before the gate: a failure there is this rank's agreement B, which meets the others'
        gate), a gate (agreement B's all-reduce), the sum of the squares over the ranks in a buffer allocated
        up front, and every local gradient scaled in place. Gradients that are no DTensor are whole on every
        rank: rank 0 counts them. Returns the total norm."""
        grads = [p.grad for p in params if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        counted = [t for g, t in zip(grads, local, strict=True) if isinstance(g, DTensor) or self.rank == 0]
        square = torch.stack(torch._foreach_norm(counted, 2.0)).double().pow(2).sum() if counted else None
        outcome = Agreement.after_step(self, "ok")  # the gate: every rank is here, or has failed before it
        if outcome != "ok":
            self.settled_step = outcome
            raise peer_failure(outcome, "clip")
        with torch.no_grad():
            self._norm.zero_()
            if square is not None:
                self._norm.copy_(square.reshape(1))
            dist.all_reduce(self._norm, op=dist.ReduceOp.SUM)
            total = math.sqrt(float(self._norm.item()))
            coefficient = max_norm / (total + 1e-6)  # (as torch's clip_grad_norm_)
            if coefficient < 1.0 and local:
                torch._foreach_mul_(local, coefficient)
        return total

    def after_backward(self, outcome: Outcome, phase: Phase, journal: bool) -> Verdict:
        """Agreement A, unless a gate settled this attempt already (then no collective: every rank settled)."""
        settled, self.settled = self.settled, None
        if settled is not None:
            return settled
        return super().after_backward(outcome, phase, journal)

    def _pass(self) -> None:
        """The gate of a healthy rank just before a collective: raise if any rank failed."""
        phase = Phase.BACKWARD if _in_backward() else Phase.FORWARD
        verdict = self.gate("ok", phase)
        if verdict.outcome != "ok":
            raise peer_failure(verdict.outcome, str(verdict.phase))

    def _allocate(self, size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        try:
            return torch.empty(*size, dtype=dtype, device=device)
        except Exception as exc:
            outcome = failure_outcome(exc, self.separate_host)
            self.gate_failures += 1
            self.gate(outcome, Phase.BACKWARD if _in_backward() else Phase.FORWARD)
            raise

    # -- micro-batches and retries --------------------------------------------------------------------
    def micro_batch(self, last: bool) -> None:
        """Before a micro-batch's forward: gradient sync (the reduce-scatter) only in the last one's backward."""
        for root in self.roots:
            root.set_requires_gradient_sync(last)  # (recursive: every FSDP module below it)
            root.set_is_last_backward(last)

    def reset(self) -> None:
        """After a failed attempt: FSDP's iteration state reset on every root, every unsharded gradient dropped."""
        self.settled = self.settled_step = None
        for root in self.roots:
            root.reset_iter_state()
        for module in self.modules:
            state = module._get_fsdp_state()  # type: ignore[attr-defined]
            for group in state._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    unsharded = getattr(param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
        self.micro_batch(last=True)  # (FSDP's defaults, as a model outside the guard expects them)


class _GatedAllGather(AllGather):
    """FSDP's all-gather behind the gate."""

    def __init__(self, agreement: FSDPAgreement) -> None:
        self.agreement = agreement

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.agreement._allocate(size, dtype, device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        self.agreement._pass()
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _GatedReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter behind the gate; an average runs as a sum divided afterwards on gloo."""

    def __init__(self, agreement: FSDPAgreement) -> None:
        self.agreement = agreement

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.agreement._allocate(size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.agreement._pass()
        average = op == dist.ReduceOp.AVG and dist.get_backend(group) == "gloo"
        work = dist.reduce_scatter_single(
            output_tensor, input_tensor, group=group, op=dist.ReduceOp.SUM if average else op, async_op=False
        )
        if average:
            output_tensor.div_(group.size())
        return work
