"""An optimizer step that either happens completely or not at all.

Adam's first step is not atomic: it creates ``exp_avg``, ``exp_avg_sq`` and ``step`` lazily, group by group,
and updates parameters in place between allocations, so an out-of-memory error part-way leaves some parameters
stepped and some state half-built. Later steps allocate temporaries (the foreach path takes a square root of
every second moment at once) after they have already changed the moments in place.

The transaction has two paths:

* **Journaled** (the first step, a step that will create state, and any step that cannot be shown to fit):
  the state *structure* is copied (a shallow copy of each state dict, so entries and keys the step adds can
  be removed), and the values of every tensor the step may change (parameters with a gradient and their state)
  are copied to host memory through the memory backend. On failure the structure and values are put back.
* **Fast** (steady state): the previous step's transient memory is known (an upper bound measured from the
  backend's peak), the state structure is complete, and the backend confirms that much memory is free now. No
  copy is made; tensor version counters are read instead. If the step fails anyway and nothing was changed,
  the failure propagates as any OOM; if tensors were changed, :class:`~oomguard.StepRollbackError` says so
  rather than leave a silently half-stepped model.

Host copies are kept between journaled steps (pinned buffers are expensive to make on CUDA) and released once
the fast path takes over.

An interrupt never splits a step: the guard holds SIGINT and SIGTERM from the step until it is counted
(``oomguard._guard.loop``), and the journal's undo runs whole (:func:`.interrupts.run_whole`). An interrupt
raised by code inside a fast step (not a signal) propagates as itself; the guard then refuses to train on the
half-stepped model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from oomguard._backends.host import host_in_use, host_peak
from oomguard._backends.memory import MemoryBackend
from oomguard._backends.units import format_bytes
from oomguard._detect import is_oom
from oomguard._distributed.peers import Agree, failure_outcome, own_or_peer_failure, peer_failure
from oomguard._effects.interrupts import run_whole
from oomguard._errors import StepRollbackError
from oomguard._events import logger
from oomguard._ladder.plan import Phase

__all__ = ["JournalMode", "OptimizerTransaction"]

JournalMode = Literal["auto", "always", "never"]


class Scheduler(Protocol):
    """What the transaction needs of a learning-rate scheduler."""

    def step(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# Without allocator statistics (plain CPU), assume a step may need this many times its parameters' size.
_UNTRACKED_BOUND_FACTOR = 3


class OptimizerTransaction:
    """Runs ``optimizer.step()`` (and an optional follow-up such as the scheduler step) atomically."""

    def __init__(self, optimizer: torch.optim.Optimizer, journal: JournalMode = "auto") -> None:
        self.optimizer = optimizer
        self.journal: JournalMode = journal
        self._bound: int | None = None  # upper bound of the transient memory of the last step, in bytes
        self._host: dict[int, torch.Tensor] = {}  # id(device tensor) -> reusable host copy
        #: How many steps took the journaled path (for tests and diagnostics).
        self.journaled_steps = 0
        #: The host bytes a journaled step copies, as of the last step (every parameter with a gradient and its
        #: state, as the step saw them: a master level's fp32 masters), whichever path it took: what the planner
        #: adds to a plan's host peak, since the first step on every new plan is journaled.
        self.journal_bytes = 0
        #: The guard's host budget (None: unlimited or unknown): a journal whose copies would not fit is skipped.
        self.host_budget: int | None = None
        self._skipped_for_host = False  # whether a skipped journal was logged (once per guard: not per step)
        self._host_transient = 0  # host bytes the last step took beyond what it began with (where they are counted)
        #: Why the optimizer can no longer be trusted: a fast step was interrupted half-way. Every later step
        #: refuses with this.
        self.broken: str | None = None

    def invalidate(self) -> None:
        """Forget the measured transient memory (the plan changed): the next step is journaled again."""
        self._bound = None

    def release_host_copies(self) -> None:
        """Drop the host copies kept for the next journaled step: once host memory ran out, the host needs them
        back more than the next step needs them ready."""
        self._host = {}

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _mutable_tensors(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Parameters with a gradient and the tensors in their state (a state value that is not a tensor may name
        the tensors it keeps, as ``.tensors``: 8-bit moments): what a step may change in place."""
        seen: dict[int, torch.Tensor] = {}
        for p in params:
            seen.setdefault(id(p), p)
            for value in self.optimizer.state.get(p, {}).values():
                for tensor in (value,) if isinstance(value, torch.Tensor) else getattr(value, "tensors", ()):
                    seen.setdefault(id(tensor), tensor)
        return list(seen.values())

    def _may_skip_journal(self, backend: MemoryBackend, params: list[torch.Tensor]) -> bool:
        if self.journal != "auto":
            return self.journal == "never"
        if self._bound is None:
            return False
        state = self.optimizer.state
        if any(p not in state for p in params):  # this step would create state: journal it
            return False
        return backend.reserve(self._bound)

    def _journal_fits(self, backend: MemoryBackend, params: list[torch.Tensor]) -> bool:
        """Whether the journal's new host copies fit the host budget beside what the guard holds there (where the
        backend counts it; else the copies alone). A journal that does not fit is skipped, and said once: past the
        budget the OS would end the job, which is worse than a step that cannot be undone."""
        if self.host_budget is None or self.journal != "auto":
            return True  # ("always" is the user's: journaled whatever it costs)
        kept = {key: copy.numel() * copy.element_size() for key, copy in self._host.items()}
        tensors = self._mutable_tensors(params)
        needed = sum(max(0, t.numel() * t.element_size() - kept.get(id(t), 0)) for t in tensors)
        held = host_in_use(backend) or 0
        if held + needed + self._host_transient <= self.host_budget:  # (and the step's own host temporaries)
            return True
        if not self._skipped_for_host:
            self._skipped_for_host = True
            logger.warning(
                "step journal skipped: its host copies (%s more) do not fit the host budget of %s beside the %s the "
                "guard holds there; until they do, an optimizer step that fails part-way cannot be undone (it "
                "raises StepRollbackError). Give the job more host memory (host_memory=) to journal every step",
                format_bytes(needed),
                format_bytes(self.host_budget),
                format_bytes(held),
            )
        return False

    def can_skip_journal(self, backend: MemoryBackend) -> bool:
        """Whether the next step would run without a journal (fast path) on this process."""
        return self._may_skip_journal(backend, self._params())

    def step(
        self,
        backend: MemoryBackend,
        scheduler: Scheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        agree: Agree | None = None,
        allow_fast: bool = True,
        run: Callable[[], None] | None = None,
    ) -> None:
        """Run ``optimizer.step()`` (through ``scaler`` if given), then ``scheduler.step()``.

        If anything raises, the optimizer and scheduler are put back as they were and the error re-raised; a
        failed attempt's ``scaler`` is simply discarded by its owner. Under distributed training ``agree``
        tells the other ranks how the step went and returns the worst outcome of all ranks (``"ok"``,
        ``"oom"``, ``"host"`` or ``"fatal"``); if another rank failed, this rank's step is undone too.
        ``allow_fast=False`` forces the journal (some rank may need to undo). ``run`` replaces the step itself (an
        integration that steps through its own wrapper, such as Accelerate's optimizer).
        """
        if self.broken is not None:
            raise StepRollbackError(self.broken)
        params = self._params()
        before, host_before = backend.memory_allocated(), host_in_use(backend)
        run = run or self._runner(backend, scheduler, scaler)
        copied = 0  # bytes of the journal's host copies
        if allow_fast and (self._may_skip_journal(backend, params) or not self._journal_fits(backend, params)):
            self._host.clear()
            self._fast_step(params, run, agree)
        else:
            copied = self._journaled_step(backend, params, run, scheduler, agree)
        self._measure(backend, before, params)
        peak = host_peak(backend)
        if peak is not None and host_before is not None:  # (what a step on the host computes: its temporaries)
            self._host_transient = max(0, peak - host_before - copied)

    def _runner(
        self, backend: MemoryBackend, scheduler: Scheduler | None, scaler: torch.amp.GradScaler | None
    ) -> Callable[[], None]:
        def run() -> None:
            if scaler is not None:
                scaler.step(self.optimizer)  # skips the step on inf/nan gradients, the standard way
                scaler.update()
            else:
                self.optimizer.step()
            if scheduler is not None:
                _scheduler_step(scheduler, backend)

        return run

    def _fast_step(self, params: list[torch.Tensor], run: Callable[[], None], agree: Agree | None) -> None:
        tensors = self._mutable_tensors(params)
        versions = [t._version for t in tensors]
        try:
            run()
        except BaseException as exc:
            changed = sum(t._version != v for t, v in zip(tensors, versions, strict=True))
            if not isinstance(exc, Exception):  # an interrupt raised inside the step: it stays itself
                if changed:
                    self.broken = (
                        f"the optimizer step was interrupted by {type(exc).__name__} after changing {changed} of "
                        f"{len(tensors)} parameter/state tensors, on a step run without a journal: the model is "
                        f"half-stepped, so the guard refuses to train on. Restore from a checkpoint; pass "
                        f"step_journal='always' to oom_guard to make every step undoable."
                    )
                    _add_note(exc, f"oomguard: {self.broken}")
                raise
            if agree is not None:
                agree("fatal")  # the other ranks stepped without a journal: nobody can undo
            if changed or agree is not None:
                raise StepRollbackError(
                    f"the optimizer step failed with {type(exc).__name__} after changing {changed} of "
                    f"{len(tensors)} parameter/state tensors, on a step the guard judged safe to run without "
                    f"a journal, so it cannot be undone and the batch cannot be retried. Restore from a "
                    f"checkpoint; pass step_journal='always' to oom_guard to make every step undoable."
                ) from exc
            raise
        if agree is not None and agree("ok") != "ok":
            raise StepRollbackError(
                "another rank's optimizer step failed on a step every rank judged safe to run without a journal; "
                "the replicas may now differ. Restore from a checkpoint; pass step_journal='always' to make "
                "every step undoable."
            )

    def _journaled_step(
        self,
        backend: MemoryBackend,
        params: list[torch.Tensor],
        run: Callable[[], None],
        scheduler: Scheduler | None,
        agree: Agree | None,
    ) -> int:
        """The journaled step; returns the bytes of the host copies it made."""
        self.journaled_steps += 1
        optimizer = self.optimizer
        # Structure: which params have state and which keys each state holds (shallow: tensors are shared).
        entries = {p: dict(optimizer.state[p]) for p in params if p in optimizer.state}
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        scheduler_state = scheduler.state_dict() if scheduler is not None else None
        # Values: host copies of every tensor the step may change in place.
        tensors = self._mutable_tensors(params)
        copies = [backend.to_host(t, self._host.get(id(t))) for t in tensors]
        backend.synchronize()  # the copies must have read every tensor before the step writes to it
        self._host = {id(t): c for t, c in zip(tensors, copies, strict=True)}

        def structure() -> None:
            for p in params:
                if p in entries:
                    optimizer.state[p] = entries[p]
                else:
                    optimizer.state.pop(p, None)
            for group, saved in zip(optimizer.param_groups, groups, strict=True):
                group.update(saved)
            if scheduler is not None and scheduler_state is not None:
                scheduler.load_state_dict(scheduler_state)

        def undo() -> None:  # as one, whatever interrupts it (see run_whole): every part can be run again
            uploads = [functools.partial(backend.upload, t, c) for t, c in zip(tensors, copies, strict=True)]
            run_whole([*uploads, structure, backend.synchronize])

        try:
            run()
        except BaseException as exc:
            undo()
            if agree is None or not isinstance(exc, Exception):
                raise
            own = failure_outcome(exc, backend.offloads)  # (host memory: all stop, and say so)
            failure = own_or_peer_failure(exc, own, agree(own), Phase.OPTIMIZER)
            if failure is not exc:
                raise failure from None
            raise
        outcome = agree("ok") if agree is not None else "ok"
        if outcome != "ok":
            undo()
            raise peer_failure(outcome, Phase.OPTIMIZER)
        return sum(c.numel() * c.element_size() for c in copies)

    def _measure(self, backend: MemoryBackend, before: int, params: list[torch.Tensor]) -> None:
        self.journal_bytes = sum(t.numel() * t.element_size() for t in self._mutable_tensors(params))
        if backend.tracks_allocations:
            # The peak since the step began is at least before + transient: an upper bound, never too small.
            self._bound = max(0, backend.max_memory_allocated() - before)
        else:
            self._bound = _UNTRACKED_BOUND_FACTOR * sum(p.numel() * p.element_size() for p in params)


def _scheduler_step(scheduler: Scheduler, backend: MemoryBackend) -> None:
    """The scheduler's step, once the optimizer has stepped. It allocates next to nothing, but on a fast step the
    optimizer step is already committed, so an OOM here must not leave the schedule a step behind: its state is
    put back, the cache emptied, and it steps once more."""
    saved = scheduler.state_dict()
    try:
        scheduler.step()
        return
    except Exception as exc:
        if not is_oom(exc):
            raise
    scheduler.load_state_dict(saved)  # outside the except block: the failed attempt's frames are gone
    backend.empty_cache()
    scheduler.step()


def _add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` where Python prints notes (3.11 and later)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
