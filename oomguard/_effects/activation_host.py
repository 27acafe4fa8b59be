"""Activation offload's host memory: the guard's host budget, kept where the saved tensors are copied, and measured.

The optimizer's state or an offloaded block is known before it moves (the rungs estimate it from the model:
:mod:`oomguard._effects.footprint`), but what a forward saves for backward is only known as it runs: activation
offload copies each saved tensor to the host in the pack hook, one at a time. So the host budget is kept there:
before each copy, the host memory the guard would hold with it is compared with the budget, and a copy past it
raises :class:`~oomguard._backends.host.HostAllocationError`, a host failure (the guard commits nothing and does not
move down the ladder, whose next rungs would offload more). Past the host's RAM the job would be killed with no
exception; this error is what stands in its place. What the guard holds is the backend's count where it keeps one
(:func:`~oomguard._backends.host.host_in_use`: a simulated host), else the rungs' estimate of what the rest of the
plan keeps (``others``: optimizer state, masters, offloaded blocks) plus the saved tensors copied so far.

It also measures what the saved tensors took: the most held on the host at once in a step that worked, per sample
of that step's micro-batches (:attr:`ActivationLedger.per_sample`). The activation_offload rung scales it by a
plan's micro-batch size (its ``host_bytes``), so the walk and stepping back up refuse a plan past the budget
before running it. It is 0 until a step on activation offload has worked: unknown, and the check at each copy is
then the bound.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from oomguard._backends.host import HostAllocationError, host_in_use
from oomguard._backends.units import format_bytes
from oomguard._ladder.plan import Plan

__all__ = ["ActivationLedger"]


def _nothing(plan: Plan) -> int:
    return 0


class ActivationLedger:
    """The host bytes of activation offload's saved tensors: held now, at their peak in this step, per sample in
    the last step measured; and the budget their copies must keep (None: unlimited or unknown, nothing refused)."""

    def __init__(self) -> None:
        #: The guard's host budget (set at its first call).
        self.budget: int | None = None
        #: The rungs' estimate of what a plan keeps on the host besides the saved tensors (set by the guard): what
        #: the check adds the copies to where the backend does not count the host (CUDA).
        self.others: Callable[[Plan], int] = _nothing
        #: Bytes per sample of a micro-batch at the peak of the last step measured (0: none measured yet).
        self.per_sample = 0.0
        self.peak = 0  # the most held at once since the last measure (or failed attempt)
        self._total = 0  # bytes copied, less those freed and drained from ``_freed``
        # The bytes of copies freed since: a finalizer (which may run in any thread, inside any allocation) only
        # appends here, so it never tears an update of ``_total``, which only the forward's thread makes.
        self._freed: list[int] = []

    @property
    def held(self) -> int:
        """Bytes of saved tensors on the host now."""
        while self._freed:
            self._total -= self._freed.pop()
        return self._total

    def reserve(self, nbytes: int, plan: Plan, backend: object) -> None:
        """Raise :class:`HostAllocationError` where copying ``nbytes`` more to the host would take the guard past
        its host budget (see the module); do nothing otherwise."""
        if self.budget is None:
            return
        counted = host_in_use(backend)
        held = self.held
        in_use = counted if counted is not None else self.others(plan) + held
        if in_use + nbytes <= self.budget:
            return
        source = "counted" if counted is not None else "estimated: the plan's other offloading and these tensors"
        raise HostAllocationError(
            f"host memory: activation offload would copy {format_bytes(nbytes)} more of the tensors saved for "
            f"backward to the host, which holds {format_bytes(held)} of them already and {format_bytes(in_use)} "
            f"of the guard's in all ({source}), past the guard's host budget of {format_bytes(self.budget)}"
        )

    def add(self, owner: object, nbytes: int) -> None:
        """A host copy of ``nbytes``, alive as long as ``owner`` (weakly referenced)."""
        self._total += nbytes
        weakref.finalize(owner, self._freed.append, nbytes)  # (holds the list, not the ledger)
        self.peak = max(self.peak, self.held)

    def measured(self, micro_batch_size: int) -> None:
        """A step on activation offload worked, with micro-batches of ``micro_batch_size`` samples: its peak per
        sample is the figure from now on (kept where it copied nothing); the next step's peak starts afresh."""
        if self.peak and micro_batch_size > 0:
            self.per_sample = self.peak / micro_batch_size
        self.peak = self.held

    def failed(self) -> None:
        """An attempt failed: its peak (a forward cut short) measures nothing."""
        self.peak = self.held
