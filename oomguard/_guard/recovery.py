"""After a failed attempt: what the guard keeps of it, how what it held is freed, the bounds on trying again,
and how giving up is worded."""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass
from typing import Any, Literal

import torch

from oomguard._backends.memory import MemoryBackend, MemorySnapshot, snapshot
from oomguard._backends.telemetry import apply_expandable_segments
from oomguard._backends.units import format_bytes
from oomguard._detect import is_oom
from oomguard._events import FailureSummary, RelaxEvent, host_figures
from oomguard._guard.buckets import Choice
from oomguard._guard.call import Call
from oomguard._ladder.plan import Phase, Plan
from oomguard._step.runner import StepRunner

__all__ = [
    "Bounds",
    "Failure",
    "GiveUp",
    "device_telemetry",
    "free_failed_attempt",
    "give_up_message",
    "held_back_event",
    "relax_event",
    "released",
]

#: Why the guard gives up on a batch: nothing left on the ladder, a bound on attempts or time, or host memory ran
#: out (which the ladder cannot relieve: its next rungs offload more to the host).
GiveUp = Literal["ladder", "attempts", "time", "host"]


@dataclass(eq=False)
class Failure:
    """A failed attempt as the guard keeps it: the plan, a summary, and the error without its frames."""

    plan: Plan
    summary: FailureSummary
    seconds: float
    base: int | None  # allocated when the attempt began, after its plan was applied (None: unknown)
    #: The error, released from its frames (see :func:`released`): the cause of an error that gives up.
    error: BaseException
    agreed_phase: Phase | None = None  # under distributed training: the deepest phase any rank failed in
    host: bool = False  # host memory ran out (RAM), not the device's: not retried down the ladder


def released(exc: BaseException) -> BaseException:
    """``exc`` without the frames of the failed attempt, which hold its tensors; its traceback is kept as text in
    a note (Python 3.11 and later print notes), so the error that gives up can still show where it began."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    todo, seen = [exc], set()
    while todo:  # every linked error, contexts hidden by ``from None`` included: they still hold their frames
        error = todo.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        todo += [e for e in (error.__cause__, error.__context__) if e is not None]
        todo += list(getattr(error, "exceptions", ()))
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(f"(the traceback of that attempt; its frames were released to free its memory)\n{text}")
    return exc


class Bounds:
    """The bounds on one call's recovery: attempts, and seconds since the call began (None: no time bound)."""

    def __init__(self, max_attempts: int, max_seconds: float | None) -> None:
        self.max_attempts, self.max_seconds = max_attempts, max_seconds

    def reached(self, call: Call) -> GiveUp | None:
        """Which bound the attempts so far (every one failed) have reached, the time bound first."""
        if self.max_seconds is not None and time.monotonic() - call.started >= self.max_seconds:
            return "time"
        return "attempts" if len(call.tried) >= self.max_attempts else None


def flush_autograd_queue(device: torch.device) -> None:
    """Free the gradients a failed backward left queued in autograd's engine.

    When backward raises, the tasks it had queued but not run stay in the engine's per-device ready queue, each
    holding its input gradients, until the next backward on that device drains them. A tiny backward does it
    now, so memory is back to what it was before the attempt.
    """
    try:
        torch.zeros((), device=device, requires_grad=True).mul(1.0).backward()  # type: ignore[no-untyped-call]
    except Exception as exc:  # an OOM here only delays the release to the retry's own backward
        if not is_oom(exc):
            raise


def free_failed_attempt(
    runner: StepRunner, backend: MemoryBackend, device: torch.device, phase: Phase, base: int | None
) -> None:
    """Free what a failed attempt held: its gradients, autograd's queue, reference cycles, the allocator cache.

    ``base`` is the memory allocated when the attempt began, where the backend can tell (None: always run the
    full garbage collection). Best effort: what cannot be freed now, the retry finds out about.
    """
    runner.zero_grad()
    if phase == Phase.BACKWARD:
        flush_autograd_queue(device)
    # The failed attempt's error and frames may form reference cycles that hold its tensors: made as it
    # unwound, they are young, and collecting the young generations costs microseconds. The full pass
    # (~0.2 s with transformers loaded) only where memory is still above where the attempt began.
    gc.collect(1)
    if base is None or not backend.tracks_allocations or backend.memory_allocated() > base:
        gc.collect()
    try:
        backend.empty_cache()
    except Exception as exc:  # a device too full even to return its cache: nothing more was freed
        if not is_oom(exc):
            raise
    _settle(backend, base)


def _settle(backend: MemoryBackend, base: int | None) -> None:
    """Give what other threads still hold of the attempt a moment to go.

    A collective's work object keeps its tensors (gradients, under DDP) until the communication library's own
    thread lets it go, a little after the wait on it returned; on a loaded machine that thread may not have run
    yet. Only where memory is still above where the attempt began, and for at most a few tens of milliseconds.
    """
    if base is None or not backend.tracks_allocations:
        return
    for _ in range(_SETTLE_TRIES):
        if backend.memory_allocated() <= base:
            return
        time.sleep(_SETTLE_PAUSE)


_SETTLE_TRIES, _SETTLE_PAUSE = 20, 0.002


def device_telemetry(backend: MemoryBackend, requested: int | None, fix_fragmentation: bool) -> dict[str, Any] | None:
    """What the device looked like at the OOM (NVML, fragmentation), where the backend can tell; with
    ``fix_fragmentation``, a fragmented CUDA allocator is switched to expandable segments."""
    telemetry = backend.telemetry(requested)
    if fix_fragmentation and telemetry and telemetry.get("fragmentation"):
        apply_expandable_segments()
    return telemetry


def give_up_message(
    call: Call,
    reason: GiveUp,
    memory: MemorySnapshot,
    *,
    step: int,
    bounds: Bounds,
    rungs: str,
    unrestored: str | None = None,
    host_budget: int | None = None,
    host_refused: str | None = None,
    host_held: int | None = None,
    host_estimated: bool = False,
) -> str:
    """Why the guard gave up on ``call`` (``reason``: "ladder", "attempts", "time" or "host"), what it tried, the
    fix; ``unrestored`` says what of the model could not be put back, if anything; ``host_budget``, the guard's;
    ``host_refused``: the plans the ladder left because the host has no room for them (see ``Walk.host_refused``);
    ``host_held``, after a host failure: what the guard held on the host then (``host_estimated``: by the rungs)."""
    last = call.tried[-1][1]
    if reason == "host":
        host = host_figures(host_held, host_budget, host_estimated)
        return _host_message(call, step, memory, rungs, unrestored, host)
    headline = {
        "ladder": "every plan on the ladder ran out of memory",
        "attempts": f"the bound of {bounds.max_attempts} attempts was reached",
        "time": f"the bound of {bounds.max_seconds} s of recovery was reached",
    }[reason]
    tried = "\n".join(
        f"  {i}. {plan.describe(call.size)}: {summary.describe()}" for i, (plan, summary) in enumerate(call.tried, 1)
    )
    host = ""
    if reason == "ladder" and host_refused is not None:  # (the rungs left would fill the host past its budget)
        headline = "every plan the host memory (RAM) has room for ran out of device memory"
        host = f"\nHost memory: {host_refused}."
    fix = {
        "ladder": (
            f"lower the batch size or sequence length, add rungs to ladder= (in use: {rungs or 'none'}), or use "
            f"a smaller model or a larger GPU"
        ),
        "attempts": "raise max_attempts=, or lower the batch size so fewer fallbacks are needed",
        "time": "raise max_recovery_seconds=, or lower the batch size so fewer fallbacks are needed",
    }[reason]
    state = _state(unrestored)
    return (
        f"oomguard gave up on step {step} (a batch of {call.size} sample(s)): {headline}; {state}.\nTried:\n{tried}\n"
        f"Memory: capacity {format_bytes(last.memory.capacity)}, in use {format_bytes(last.memory.allocated)} "
        f"at the last failure, tried to allocate {format_bytes(last.requested_bytes)}; "
        f"{format_bytes(memory.allocated)} in use after freeing.{host}\nWhat you can do: {fix}."
    )


def _state(unrestored: str | None) -> str:
    if unrestored is None:
        return "the model, optimizer and scheduler are unchanged"
    return f"the optimizer and scheduler are unchanged, but {unrestored}"


def _host_message(call: Call, step: int, memory: MemorySnapshot, rungs: str, unrestored: str | None, host: str) -> str:
    """Why the guard gave up when host memory ran out: where, on which plan, what the host said, what the guard
    held there and its budget (``host``), the fix."""
    plan, last = call.tried[-1]
    after = "" if memory.host_allocated is None else f"; {format_bytes(memory.host_allocated)} after freeing"
    return (
        f"oomguard gave up on step {step} (a batch of {call.size} sample(s)): host memory (RAM) ran out "
        f"({last.describe()}) on the plan {plan.describe(call.size)}, not the device's memory, so the guard did not "
        f"move down the ladder (its next rungs offload more to the host); {_state(unrestored)}.\n"
        f"Host: {last.error_type}: {last.message}\nHost memory: {host}{after}. Device memory in use after freeing: "
        f"{format_bytes(memory.allocated)}.\nWhat you can do: give the job more host RAM, or set host_memory= to "
        f"what it may really use; put quantized_optimizer on the ladder (8-bit optimizer state: about a quarter "
        f"of Adam's host bytes) before optimizer_offload, offload fewer layers, prefer checkpointing to "
        f"activation_offload, or lower the batch size (ladder in use: {rungs or 'none'})."
    )


def relax_event(call: Call, outcome: str, next_try_after: int) -> RelaxEvent:
    """The event of a try at stepping back up (a plan one rung less degraded) that ``outcome`` ("held" or
    "failed")."""
    choice = call.choice
    if choice.fallback is None or choice.given_back is None:
        raise ValueError("a relax event needs the choice of a try at stepping back up")
    return RelaxEvent(
        step=call.step,
        plan=choice.plan.to_dict(),
        memory=snapshot(call.backend),
        rung=choice.given_back,
        previous_plan=choice.fallback.to_dict(),
        outcome=outcome,
        next_try_after=next_try_after,
        description=f"{choice.fallback.describe(call.size)} -> {choice.plan.describe(call.size)}",
    )


def held_back_event(
    step: int, choice: Choice, size: int, backend: MemoryBackend, budget: int | None, wait: int
) -> RelaxEvent:
    """The event of a step back up that was due and not tried, its plan past the host budget (``choice.held_back``:
    the rung, the plan, its host bytes); the call ran on ``choice.plan``, and the next try waits ``wait`` steps."""
    if choice.held_back is None:
        raise ValueError("a held-back relax event needs the choice of a step back up the host had no room for")
    rung, plan, needs = choice.held_back
    limit = "unknown" if budget is None else format_bytes(budget)
    return RelaxEvent(
        step=step,
        plan=plan.to_dict(),
        memory=snapshot(backend),
        rung=rung,
        previous_plan=choice.plan.to_dict(),
        outcome="host",
        next_try_after=wait,
        description=(
            f"{choice.plan.describe(size)} -> {plan.describe(size)}: it keeps about {format_bytes(needs)} on the "
            f"host, past the guard's host budget of {limit}"
        ),
    )
