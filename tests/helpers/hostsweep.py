"""The host-fault sweep: one failed host allocation at a time in a guarded step on an offload rung's plan.

Imported by tests/test_fault_sweep.py. Where :mod:`helpers.sweep` fails a device allocation and checks that the
guard recovered down the ladder, this fails the ``i``-th host allocation of a step
(``SimulatedGPU.fail_host_allocation``, a failed pinned ``cudaHostAlloc`` or a host ``MemoryError``): moving the
optimizer state or the fp32 masters to the host, an offloaded block's parameters, gradients or state, a saved
activation's host buffer, the step journal's copies, the host optimizer step's own temporaries. A host fault is not
a device OOM: offloading more would only make it worse. What "survived" means for one (:func:`host_problems`):

* the call raised :class:`oomguard.HostMemoryError` (a ``MemoryError`` whose message names host memory), never a
  device-OOM escalation: no fallback event, the guard's plan after the call is the plan before it, and the error
  lists that one plan as all that was tried;
* nothing was committed: weights, Adam's state, the scheduler, the GradScaler and torch's RNG state are, bit for
  bit, what they were before the call, and no parameter holds a gradient;
* nothing of the failed attempt is left held: the host holds nothing of the guard's, and the device what a guard's
  first call on this state finds (giving up undid every effect, what the plan had offloaded included);
* the same batch, called again on the same guard with no fault, trains exactly as a fault-free step on the same
  plan does (:func:`helpers.sweep.problems`: bit for bit, every sample once, one Adam and one scheduler step, the
  same memory in use after).

Each step is faulted on a guard's first call, which engages the plan itself, and the step after them on a guard
that ran them all, as a running job's: there the optimizer step would skip its journal (the device has room for
it) but for the armed fault, which ``SimulatedGPU.reserve`` reports as it does an armed device fault.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from helpers.sweep import (
    CAPACITY,
    STEPS,
    TINY,
    Outcome,
    PhaseGPU,
    Rig,
    Sample,
    Snapshot,
    Sweep,
    Workload,
    differences,
    initial_state,
    make_rig,
    problems,
)
from oomguard import FallbackEvent, HostMemoryError, Plan
from oomguard._backends.hostledger import HostLedger

#: The offload rungs' plans the host sweep runs (names from helpers.sweep.rung_configs): each puts something on
#: the host that a failed host allocation can hit.
HOST_CONFIGS = ("activation offload", "optimizer offload", "optimizer offload, master weights", "layer offload")


class _PhasedLedger(HostLedger):
    """A host ledger that calls ``record(before, after)`` whenever its allocation count grows (a plain attribute
    the ledger increments), from inside its own bookkeeping."""

    def __init__(self, capacity: int | None, record: Callable[[int, int], None]) -> None:
        self._record = record  # (set first: the base class's __init__ sets the count)
        self._count = 0
        super().__init__(capacity)

    @property  # type: ignore[override]
    def allocations(self) -> int:
        return self._count

    @allocations.setter
    def allocations(self, value: int) -> None:
        before, self._count = self._count, value
        self._record(before, value)


class HostPhaseGPU(PhaseGPU):
    """A PhaseGPU that also records the phase of the step each host allocation was made in (``apply`` for what a
    plan's effects move to the host as they are applied, ``"outside"`` before the first attempt)."""

    def __init__(self, capacity: int | str) -> None:
        self.host_phases: list[str] = []
        super().__init__(capacity)
        self._host = _PhasedLedger(self.host_capacity, self._host_counted)  # (before anything is on the host)

    def _host_counted(self, before: int, after: int) -> None:
        phase = self.phase() if self.attempt_bases else "outside"
        self.host_phases.extend([phase] * (after - before))


@dataclass
class HostOutcome:
    """What a call with a failed host allocation did, and what calling again with the same batch did."""

    raised: BaseException | None  # what the faulted call raised (None: it returned)
    fired: bool  # whether the armed host allocation failed
    plans: tuple[Plan, Plan]  # the guard's plan before and after the faulted call
    tried: list[Plan]  # the plans the error says were tried
    fallbacks: int  # fallback events the faulted call emitted
    before: Snapshot  # the training state before the faulted call, and after it
    after_failure: Snapshot
    rng: tuple[torch.Tensor, torch.Tensor]  # torch's RNG state before the faulted call, and after it
    grads_left: int  # parameters holding a gradient after the faulted call
    memory: tuple[int, int]  # device memory in use before the faulted call, and after it
    host_memory: tuple[int, int]  # host memory in use before the faulted call, and after it
    retry: Outcome  # calling again with the same batch, no fault


def _state(rig: Rig) -> tuple[Snapshot, torch.Tensor]:
    """The rig's training state and torch's RNG state, copied outside the device's accounting (they are the test's
    copies, not device allocations)."""
    with rig.gpu._paused:
        return Snapshot.of(rig.model, rig.optimizer, rig.scheduler, rig.guard), torch.get_rng_state()


def _faulted_call(rig: Rig, batch: Any, fault: int) -> dict[str, Any]:
    """Call the rig's guard with its ``fault``-th host allocation from now failing: what it raised and left."""
    gpu, guard = rig.gpu, rig.guard
    before, rng = _state(rig)
    plan, events = guard.plan, len(guard.events)
    memory, host_memory = gpu.memory_allocated(), gpu.host_memory_allocated()
    gpu.fail_host_allocation(fault)
    raised: BaseException | None = None
    try:
        rig.call(batch)
    except Exception as error:  # (anything but a HostMemoryError is a problem host_problems reports)
        raised = error
    after_failure, rng_after = _state(rig)
    return {
        "raised": raised,
        "fired": not gpu._host.fault_pending,
        "plans": (plan, guard.plan),
        "tried": [tried for tried, _ in getattr(raised, "tried", ())],
        "fallbacks": sum(isinstance(event, FallbackEvent) for event in guard.events[events:]),
        "before": before,
        "after_failure": after_failure,
        "rng": (rng, rng_after),
        "grads_left": sum(p.grad is not None for p in rig.model.parameters()),
        "memory": (memory, gpu.memory_allocated()),  # (the error is still held here, as a caller's except holds it)
        "host_memory": (host_memory, gpu.host_memory_allocated()),
    }


#: A host allocation no step reaches: armed, it fails nothing.
NEVER = 2**62

#: Where a rig starts from to have its plan engaged as the step begins, as a running job's guard has: a state and
#: the batches of the steps from it, called fault-free first (None: the guard's first call engages the plan itself).
Previous = tuple[Snapshot, list[Any]] | None


@contextlib.contextmanager
def _engaged(
    state: Snapshot, plan: Plan, workload: Workload, ladder: list[str] | None, previous: Previous
) -> Iterator[Rig]:
    """A rig on ``plan`` from ``state``, or from ``previous`` and then called with its batches; inside its
    device's context (build its outcome after leaving: the copies are not device allocations)."""
    start = state if previous is None else previous[0]
    rig = make_rig(start, plan, workload=workload, gpu=HostPhaseGPU(CAPACITY), ladder=ladder)
    with rig.gpu:
        rig.enter()
        for batch in previous[1] if previous is not None else []:
            rig.call(batch)  # fault-free: the plan's effects are engaged, what it offloads is on the host
        rig.ooms.clear()  # the next call counts its attempts from 0
        rig.seen.clear()
        yield rig


def host_fault_step(
    state: Snapshot, batch: Any, plan: Plan, fault: int, *, workload: Workload = TINY, previous: Previous = None
) -> HostOutcome:
    """A guarded call on ``plan`` from ``state`` (or engaged by ``previous``) with host allocation ``fault``
    (1-based, counted from the call) failing, then the same batch again on the same guard with no fault."""
    with _engaged(state, plan, workload, None, previous) as rig:
        found = _faulted_call(rig, batch, fault)
        rig.ooms.clear()  # the retry is a call of its own: its attempts are counted from 0
        rig.seen.clear()
        result, figures = rig.call(batch)
        fired = not rig.gpu.fault_pending  # (no device fault was armed: True)
    return HostOutcome(retry=rig.outcome(result, figures, fired), **found)


def host_allocations(
    state: Snapshot, batch: Any, plan: Plan, workload: Workload = TINY, previous: Previous = None
) -> tuple[Outcome, list[str]]:
    """A fault-free step on ``plan`` alone, and the phase of each host allocation it made (what a sweep faults):
    with a host failure armed that never fires, so that the step takes the path a faulted one takes (a running
    job's optimizer step is journaled, not fast, while one is armed: see ``SimulatedGPU.reserve``)."""
    with _engaged(state, plan, workload, [], previous) as rig:
        rig.gpu.fail_host_allocation(NEVER)
        start = len(rig.gpu.host_phases)
        result, figures = rig.call(batch)
        fired = not rig.gpu.fault_pending
    return rig.outcome(result, figures, fired), rig.gpu.host_phases[start:]


def host_problems(
    outcome: HostOutcome,
    reference: Outcome,
    *,
    plan: Plan,
    step: int,
    sample_ids: list[int],
    running: Outcome | None = None,
) -> list[str]:
    """Everything wrong with a call whose host allocation failed (see the module's docstring), ``reference`` a
    fault-free step on ``plan`` from the same state on a guard's first call; ``running``, where the faulted guard
    had run steps before, the fault-free step such a guard makes (its weights and state compared too). Empty
    when the fault was survived."""
    found: list[str] = []
    raised = outcome.raised
    if not outcome.fired:
        found.append("the host fault never fired")
    elif raised is None:
        found.append("the call returned: the failed host allocation was recovered from")
    elif not isinstance(raised, HostMemoryError):
        found.append(f"the call raised {type(raised).__name__}, not HostMemoryError: {str(raised)[:300]}")
    elif "host memory (RAM) ran out" not in str(raised):
        found.append(f"the HostMemoryError does not say host memory ran out: {str(raised)[:300]}")
    if outcome.fallbacks:
        found.append(f"{outcome.fallbacks} fallback(s): the host fault was escalated down the ladder")
    if outcome.plans[0] != outcome.plans[1]:
        found.append(f"the guard's plan moved from {outcome.plans[0].describe()} to {outcome.plans[1].describe()}")
    if isinstance(raised, HostMemoryError) and outcome.tried != [plan]:
        found.append(f"plans tried {[tried.describe() for tried in outcome.tried]}, not {plan.describe()} alone")
    found += [f"committed: {d}" for d in differences(outcome.after_failure, outcome.before)]
    if not torch.equal(*outcome.rng):
        found.append("torch's RNG state moved")
    if outcome.grads_left:
        found.append(f"{outcome.grads_left} parameter(s) hold a gradient after the failed call")
    # Giving up undoes every effect: what the plan had offloaded is back on the device, the host holds nothing; the
    # device as a guard's first call on this state finds it (the reference's, as its first attempt began).
    memory_after, host_after, idle = outcome.memory[1], outcome.host_memory[1], reference.memory_before
    if memory_after != idle:
        found.append(f"{memory_after - idle:+d} bytes of device memory in use after the failed call")
    if host_after:
        found.append(f"{host_after} bytes of host memory still in use after the failed call")
    retry = outcome.retry
    if retry.result.plan != plan:
        found.append(f"called again, it trained on {retry.result.plan.describe()}, not {plan.describe()}")
    found += [
        f"called again: {p}"
        for p in problems(retry, ooms=0, same_plan=reference, intended=reference, step=step, sample_ids=sample_ids)
    ]
    if running is not None:
        found += [
            f"called again, vs the running job's fault-free step: {d}" for d in differences(retry.after, running.after)
        ]
    return found


def every_host_allocation(step: int, phases: list[str]) -> list[int]:
    """The full sweep: every host allocation of every step (applying the plan's effects included)."""
    return list(range(1, len(phases) + 1))


def _phase_edges(phases: list[str], first: bool) -> set[int]:
    """The last host allocation of every phase, and its first where ``first``."""
    picked: set[int] = set()
    for phase in set(phases):
        where = [i for i, p in enumerate(phases, 1) if p == phase]
        picked |= {where[0], where[-1]} if first else {where[-1]}
    return picked


def host_edges(step: int, phases: list[str]) -> list[int]:
    """The default run's sample: the first and last two host allocations of a step, and the first and last of each
    phase (applying the plan, forward, backward, the optimizer step...) that makes any."""
    count = len(phases)
    return sorted({i for i in (1, 2, count - 1, count) if 1 <= i <= count} | _phase_edges(phases, first=True))


def host_ends(step: int, phases: list[str]) -> list[int]:
    """A lighter sample for a slow plan: the first host allocation of a step and the last of each phase."""
    return sorted(({1} if phases else set()) | _phase_edges(phases, first=False))


def _sweep_case(
    report: Sweep, plan: Plan, sample: Sample, workload: Workload, step: int, state: Snapshot, previous: Previous
) -> Outcome:
    """Fail each sampled host allocation of step ``step`` from ``state`` (engaged by ``previous`` if given) and
    record what :func:`host_problems` finds in ``report``; the fault-free step."""
    batch = workload.batch(step)
    ids = [int(i) for i in workload.ids(batch).tolist()]
    engaged = previous is not None
    where = f"step {step}" + (", its plan engaged by the steps before" if engaged else "")
    reference, phases = host_allocations(state, batch, plan, workload, previous)
    # Giving up undid every effect: called again, the guard engages the plan anew, as a guard's first call does
    # (the same weights and state as the running job's step, bit for bit, checked too).
    first_call = host_allocations(state, batch, plan, workload)[0] if engaged else reference
    report.failures += [
        f"fault-free {where}: {p}"
        for p in problems(reference, ooms=0, same_plan=reference, intended=reference, step=step, sample_ids=ids)
    ]
    if not phases:
        report.failures.append(f"{where} on {plan.describe()} made no host allocation to fail")
    for index in sample(step, phases):
        outcome = host_fault_step(state, batch, plan, index, workload=workload, previous=previous)
        found = host_problems(outcome, first_call, plan=plan, step=step, sample_ids=ids, running=reference)
        phase = phases[index - 1]
        raised = type(outcome.raised).__name__ if outcome.raised is not None else None
        fault = {"step": step, "engaged": engaged, "index": index, "phase": phase, "error": raised, "problems": found}
        report.faults.append(fault)
        report.failures += [f"{where}, host allocation {index} ({phase}): {p}" for p in found]
    return reference


def host_sweep(plan: Plan, sample: Sample, *, workload: Workload = TINY, steps: int = STEPS) -> Sweep:
    """Fail each sampled host allocation of each of the first ``steps`` steps on ``plan``, each from the fault-free
    state before it on a guard's first call (which engages the plan itself, as a job started on a remembered plan
    does); then of the step after them, on a guard that ran them all (a running job's: the plan engaged, the step
    journal's host copies kept or the journal skipped, as they would be)."""
    report = Sweep()
    start = state = initial_state(workload)
    for step in range(steps):
        state = _sweep_case(report, plan, sample, workload, step, state, None).after
    _sweep_case(report, plan, sample, workload, steps, state, (start, [workload.batch(i) for i in range(steps)]))
    return report
