"""The planner's answer: every plan it measured, the one it recommends, and what a real device adds.

On a real CUDA device more memory is used than tensors hold; :func:`device_overhead` models it with the
documented constants below, and a plan fits only if its peak plus that overhead fits the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from oomguard._backends.units import GiB, MiB, format_bytes
from oomguard._ladder.plan import Phase, Plan

__all__ = [
    "ALLOCATOR_SLACK",
    "CUDA_CONTEXT_BYTES",
    "CUDA_WORKSPACE_BYTES",
    "Candidate",
    "PlanReport",
    "Target",
    "device_overhead",
    "plan_code",
    "size_in_gib",
    "tensor_budget",
]

#: The CUDA context and the kernel images loaded into it (CUDA 12 with lazy loading, torch 2.x): typically
#: 300-500 MiB; taken at the upper middle. Not calibrated on a GPU yet.
CUDA_CONTEXT_BYTES = 448 * MiB
#: cuBLAS workspace of the default stream (32 MiB on Hopper, less on older GPUs).
CUDA_WORKSPACE_BYTES = 32 * MiB
#: The caching allocator's rounding and fragmentation at the peak, as a share of the tensor peak.
ALLOCATOR_SLACK = 0.10
Target = Literal["cuda", "simulated"]


def device_overhead(peak_bytes: int, target: Target = "cuda") -> int:
    """What a device adds to a tensor peak of ``peak_bytes``: nothing on a simulated device.

    >>> device_overhead(10 * 2**30, "simulated")
    0
    >>> format_bytes(device_overhead(4 * 2**30))
    '889.6 MiB'
    """
    if target == "simulated":
        return 0
    return CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES + int(ALLOCATOR_SLACK * peak_bytes)


def tensor_budget(capacity: int, target: Target) -> int:
    """The largest tensor peak whose peak plus :func:`device_overhead` fits ``capacity``."""
    if target == "simulated":
        return capacity
    return max(0, int((capacity - CUDA_CONTEXT_BYTES - CUDA_WORKSPACE_BYTES) / (1 + ALLOCATOR_SLACK)))


@dataclass(frozen=True)
class Candidate:
    """One plan the planner measured."""

    plan: Plan
    peak_bytes: int
    device_overhead_bytes: int
    fits: bool
    #: Where the step first ran past the budget (forward, backward, optimizer...); None if it fits.
    phase: Phase | None
    #: Host<->device bytes one optimizer step copies on this plan (offloaded layers and activations, the journal).
    transfer_bytes: int = 0
    #: One optimizer step's time by the planner's device model (:class:`~oomguard._planner.speed.DeviceSpeed`).
    predicted_seconds: float = 0.0
    #: The peak of host memory the guard's own allocations take in a steady step on this plan: offloaded optimizer
    #: state and masters, offloaded blocks, activation offload's saved tensors at their peak, staging buffers and
    #: the journal's copies (what :meth:`oomguard.testing.SimulatedGPU.max_host_memory_allocated` measures).
    host_bytes: int = 0
    #: Whether ``host_bytes`` is within the host budget planned for (True where none was given).
    host_fits: bool = True
    #: Whether the step journal's host copies are counted in ``host_bytes``: False where they would not fit the
    #: host budget, so the guard skips the journal on this plan (a step failing part-way cannot be undone then).
    journaled: bool = True

    def reason(self, host_budget: int | None) -> str | None:
        """Why the plan does not fit, in words (the device memory, the host memory or both); None where it fits."""
        short = [] if self.phase is None else [f"device memory runs out in {self.phase}"]
        if not self.host_fits:
            budget = "the host budget" if host_budget is None else f"the {format_bytes(host_budget)} host budget"
            short.append(f"host memory: needs {format_bytes(self.host_bytes)} of {budget}")
        return "; ".join(short) or None

    def to_dict(self, size: int, host_budget: int | None = None) -> dict[str, Any]:
        return {
            "plan": _plan_dict(self.plan, size),
            "peak_bytes": self.peak_bytes,
            "device_overhead_bytes": self.device_overhead_bytes,
            "fits": self.fits,
            "phase": None if self.phase is None else self.phase.value,
            "transfer_bytes": self.transfer_bytes,
            "predicted_seconds": round(self.predicted_seconds, 4),
            "host_bytes": self.host_bytes,
            "journaled": self.journaled,
            "reason": self.reason(host_budget),
        }


@dataclass(frozen=True)
class PlanReport:
    """The planner's answer: the plans it measured along the ladder and the one it recommends.

    ``baseline_peak_bytes`` and ``predicted_peak_bytes`` are tensor memory (what
    ``torch.cuda.max_memory_allocated`` would report); ``device_overhead_bytes`` is what the device adds on top
    for the recommended plan. ``recommended`` is None when no plan on the ladder fits.
    """

    model: str
    capacity_bytes: int
    target: Target
    batch_size: int
    seq_len: int | None
    optimizer: str
    candidates: tuple[Candidate, ...]
    recommended: Plan | None
    seconds: float
    #: The host memory planned for (the guard's host budget, ``--host-memory``); None: unlimited.
    host_budget_bytes: int | None = None
    #: Steps run on fake tensors (the warm-up included; a plan known from an earlier search is not run again).
    fake_steps: int = 0
    #: False: the search ran out of its time (``search_seconds``) before it measured every configuration.
    complete: bool = True
    #: True: the candidates' figures were composed from steps of shallow copies of the model
    #: (:mod:`oomguard._planner.compose`); False: every candidate was measured with a full step.
    composed: bool = False
    #: Of a composed report: the recommended plan was measured with a full step, as it came within
    #: :data:`~oomguard._planner.compose.CLEAR` of the device or the host budget (composed, it stands as it is).
    confirmed: bool = False

    @property
    def baseline_peak_bytes(self) -> int:
        """The peak of the plain step (the whole batch, no rung)."""
        return self.candidates[0].peak_bytes

    @property
    def chosen(self) -> Candidate:
        """The recommended plan's measurement, or the last plan tried when none fits."""
        return next((c for c in self.candidates if c.plan == self.recommended), self.candidates[-1])

    @property
    def fits(self) -> bool:
        return self.recommended is not None

    @property
    def reason(self) -> str | None:
        """Why nothing fits (None where a plan does): the last plan's reason, and where the host budget kept the
        walk from plans that relieve the device more, the least host memory one of them needs."""
        if self.fits:
            return None
        reason = self.chosen.reason(self.host_budget_bytes) or "no plan fits"
        refused = [c for c in self.candidates if not c.host_fits]
        if self.chosen.host_fits and refused and self.host_budget_bytes is not None:
            least = min(refused, key=lambda c: c.host_bytes)
            reason += (
                f"; host memory: the plans past the {format_bytes(self.host_budget_bytes)} host budget were not "
                f"taken (the least of them, {least.plan.describe(self.batch_size)}, needs "
                f"{format_bytes(least.host_bytes)})"
            )
        return reason

    @property
    def predicted_peak_bytes(self) -> int:
        return self.chosen.peak_bytes

    @property
    def device_overhead_bytes(self) -> int:
        return self.chosen.device_overhead_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields of ``oomguard plan --json``."""
        return {
            "model": self.model,
            "gpu_memory_bytes": self.capacity_bytes,
            "target": self.target,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "optimizer": self.optimizer,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "plan": _plan_dict(self.chosen.plan, self.batch_size),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "device_overhead_bytes": self.device_overhead_bytes,
            "fits": self.fits,
            "transfer_bytes_per_step": self.chosen.transfer_bytes,
            "predicted_seconds": round(self.chosen.predicted_seconds, 4),
            "host_bytes": self.chosen.host_bytes,
            "host_memory_bytes": self.host_budget_bytes,
            "reason": self.reason,
            "candidates": [c.to_dict(self.batch_size, self.host_budget_bytes) for c in self.candidates],
            "seconds": round(self.seconds, 2),
            "fake_steps": self.fake_steps,
            "composed": self.composed,
            "confirmed": self.confirmed,
        }

    def answer(self, host: str | None = None) -> str:
        """The answer first, in a few lines: whether a plan fits and which, its device and host peaks and predicted
        step, and the line that starts a guarded job on it (:meth:`table` lists every plan measured). Sizes are in
        GiB. ``host``: how the host budget was chosen, said beside it.

        >>> measured = Candidate(Plan(micro_batch_size=2), 4 * GiB, 960 * MiB, True, None, 0, 1.25, GiB)
        >>> report = PlanReport("gpt2", 6 * GiB, "cuda", 8, 1024, "AdamW", (measured,), measured.plan, 9.5,
        ...                     fake_steps=7)
        >>> print(report.answer())
        gpt2: a batch of 8 x 1024 tokens, AdamW, on a 6.00 GiB CUDA device
        Fits: micro-batches of 2 (x4)
        Device peak: 4.94 GiB of 6.00 GiB (4.00 GiB of tensors + 0.94 GiB CUDA context, workspace and allocator)
        Host peak: 1.00 GiB (no host budget)
        Predicted step: 1.25 s, the fastest fitting plan by the device model
        In your code: train_step.guard.plan = Plan(micro_batch_size=2)
          (train_step: the function you decorated with @oom_guard; from oomguard import Plan)
        (planned in 9.5 s on fake tensors: 7 steps)
        """
        chosen, device = self.chosen, "simulated device" if self.target == "simulated" else "CUDA device"
        shape = f"{self.batch_size} x {self.seq_len} tokens" if self.seq_len else f"{self.batch_size} samples"
        lines = [
            f"{self.model}: a batch of {shape}, {self.optimizer}, on a {size_in_gib(self.capacity_bytes)} {device}"
        ]
        if self.recommended is None:
            lines += [f"Does not fit: {self.reason}", f"Closest plan tried: {chosen.plan.describe(self.batch_size)}"]
        else:
            lines.append(f"Fits: {self.recommended.describe(self.batch_size)}")
        total, peak = chosen.peak_bytes + chosen.device_overhead_bytes, size_in_gib(chosen.peak_bytes)
        overhead = (
            f" ({peak} of tensors + {size_in_gib(chosen.device_overhead_bytes)} CUDA context, workspace and allocator)"
        )
        lines.append(
            f"Device peak: {size_in_gib(total)} of {size_in_gib(self.capacity_bytes)}"
            + overhead * (self.target == "cuda")
        )
        budget = "(no host budget)" if self.host_budget_bytes is None else f"of {size_in_gib(self.host_budget_bytes)}"
        lines.append(f"Host peak: {size_in_gib(chosen.host_bytes)} {budget}" + (f" ({host})" if host else ""))
        if self.recommended is None:
            lines.append(
                "What to do: a smaller batch or sequence, a smaller model or a larger device"
                + (" (or more host memory, or quantized_optimizer on the ladder)" * (not chosen.host_fits))
            )
        else:
            lines += [
                f"Predicted step: {chosen.predicted_seconds:.2f} s, the fastest fitting plan by the device model",
                f"In your code: train_step.guard.plan = {plan_code(self.recommended)}",
                "  (train_step: the function you decorated with @oom_guard; from oomguard import Plan)",
            ]
        lines.append(f"(planned in {self.seconds:.1f} s on fake tensors: {self.fake_steps} steps)")
        return "\n".join(lines)

    def table(self) -> str:
        """A readable report: every plan measured, and the recommendation."""
        shape = f"{self.batch_size} x {self.seq_len} tokens" if self.seq_len else f"{self.batch_size} samples"
        device = "simulated device" if self.target == "simulated" else "CUDA device"
        host = (
            "" if self.host_budget_bytes is None else f" beside {format_bytes(self.host_budget_bytes)} of host memory"
        )
        lines = [
            f"{self.model}: batch of {shape}, {self.optimizer}, on a {format_bytes(self.capacity_bytes)} {device}"
            f"{host}",
            "",
            "| plan | tensor peak | with device overhead | host memory | host<->device per step | predicted step "
            "| fits |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [self._row(index, c) for index, c in enumerate(self.candidates)]
        lines.append("")
        chosen = self.chosen
        if self.recommended is None:
            host_short = any(not c.host_fits for c in self.candidates)
            lines.append(
                f"Nothing on the ladder fits: the last plan tried needs {format_bytes(chosen.peak_bytes)} of tensors"
                f"{'' if chosen.host_fits else f' and {format_bytes(chosen.host_bytes)} of host memory'}"
                f" ({self.reason}). Use a smaller batch or sequence, a smaller model, or a larger device"
                f"{' (or more host memory, or quantized_optimizer on the ladder)' if host_short else ''}."
            )
        else:
            rungs = ", ".join(self.recommended.rungs(self.batch_size)) or "none"
            lines.append(
                f"Recommended: {self.recommended.describe(self.batch_size)} (rungs: {rungs}); predicted peak "
                f"{format_bytes(chosen.peak_bytes)} + {format_bytes(chosen.device_overhead_bytes)} device overhead "
                f"of {format_bytes(self.capacity_bytes)}, {format_bytes(chosen.host_bytes)} of host memory; the "
                f"fastest fitting plan by the device model ({chosen.predicted_seconds:.2f} s a step)."
            )
        how = (
            "full"
            if not self.composed
            else "composed from 1- to 4-block steps, the recommendation "
            + ("measured in full" if self.confirmed else "clear of the device and host by 3 % or more")
        )
        lines.append(f"(planned in {self.seconds:.1f} s on fake tensors: {self.fake_steps} steps, {how})")
        return "\n".join(lines)

    def _row(self, index: int, c: Candidate) -> str:
        """One candidate's row of :meth:`table`."""
        name = c.plan.describe(self.batch_size) + (" (baseline)" if index == 0 else "")
        verdict = "yes" if c.fits else f"no ({'runs out in ' + str(c.phase) if c.phase else 'host memory'})"
        if c.phase is not None and not c.host_fits:
            verdict = f"no (runs out in {c.phase}; host memory)"
        total = format_bytes(c.peak_bytes + c.device_overhead_bytes)
        moved, seconds, host = (
            format_bytes(c.transfer_bytes),
            f"{c.predicted_seconds:.2f} s",
            format_bytes(c.host_bytes),
        )
        return f"| {name} | {format_bytes(c.peak_bytes)} | {total} | {host} | {moved} | {seconds} | {verdict} |"


def plan_code(plan: Plan) -> str:
    """The Python that makes ``plan``: its fields that differ from ``Plan()``'s.

    >>> plan_code(Plan(micro_batch_size=2, precision="bf16"))
    "Plan(micro_batch_size=2, precision='bf16')"
    """
    default = Plan()
    shown = [
        f"{field.name}={getattr(plan, field.name)!r}"
        for field in dataclasses.fields(plan)
        if getattr(plan, field.name) != getattr(default, field.name)
    ]
    return f"Plan({', '.join(shown)})"


def size_in_gib(nbytes: int) -> str:
    """A size in GiB, as the answer states sizes (two decimals: 5.59 GiB is 6 GB); below a tenth of one (a simulated
    device's), as :func:`format_bytes` says it."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else format_bytes(nbytes)


def _plan_dict(plan: Plan, size: int) -> dict[str, Any]:
    return {
        **plan.to_dict(),
        "micro_batch_size": plan.effective_micro_batch_size(size),
        "micro_batches": plan.micro_batches(size),
        "rungs": list(plan.rungs(size)),
    }
