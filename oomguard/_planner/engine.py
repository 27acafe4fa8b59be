"""The dry-run planner: which plan a training step needs on a device, from one step on fake tensors.

The planner runs the guard's own step (forward, backward, clipping, the optimizer step, with each plan's
effects applied exactly as in training) on PyTorch fake tensors (``FakeTensorMode``: shapes and dtypes, no
data, no memory), under an unlimited simulated device that accounts every tensor the way
:class:`~oomguard.testing.SimulatedGPU` does. So a plan's predicted peak is what SimulatedGPU, or
``torch.cuda.max_memory_allocated``, would measure for it, without a GPU and without the memory.

It walks the guard's ladder from the plain step: a plan that does not fit is followed by the plan the guard
would try next after an OOM in the same phase, with micro-batch sizes predicted from the peaks measured so
far, until one fits; that one, the first fitting plan in the ladder's order, is the recommendation. Each
measured step runs after a warm-up step, so the optimizer state is resident as in any step but the first.

On a real CUDA device more memory is used than tensors hold; :func:`device_overhead` models it with the
documented constants below, and a plan fits only if its peak plus that overhead fits the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten

from oomguard._backends.accounting import AccountedDevice
from oomguard._backends.units import MiB, format_bytes
from oomguard._distributed.agreement import unwrap
from oomguard._effects.blocks import find_blocks
from oomguard._effects.checkpointing import user_checkpointing
from oomguard._guard.buckets import grad_bytes, items_per_sample
from oomguard._guard.guard import OOMGuard
from oomguard._ladder.plan import Plan
from oomguard._ladder.predict import PeakModel
from oomguard._ladder.rungs import Rung, RungContext, resolve_ladder
from oomguard._step.batch import batch_size, split_batch

__all__ = [
    "ALLOCATOR_SLACK",
    "CUDA_CONTEXT_BYTES",
    "CUDA_WORKSPACE_BYTES",
    "Candidate",
    "PlanReport",
    "Target",
    "device_overhead",
    "dry_run",
]

#: The CUDA context and the kernel images loaded into it (CUDA 12 with lazy loading, torch 2.x): typically
#: 300-500 MiB; taken at the upper middle. Not calibrated on a GPU yet.
CUDA_CONTEXT_BYTES = 448 * MiB
#: cuBLAS workspace of the default stream (32 MiB on Hopper, less on older GPUs).
CUDA_WORKSPACE_BYTES = 32 * MiB
#: The caching allocator's rounding and fragmentation at the peak, as a share of the tensor peak.
ALLOCATOR_SLACK = 0.10
_UNLIMITED = 2**62

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
    phase: str | None

    def to_dict(self, size: int) -> dict[str, Any]:
        return {
            "plan": _plan_dict(self.plan, size),
            "peak_bytes": self.peak_bytes,
            "device_overhead_bytes": self.device_overhead_bytes,
            "fits": self.fits,
            "phase": self.phase,
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
            "candidates": [c.to_dict(self.batch_size) for c in self.candidates],
            "seconds": round(self.seconds, 2),
        }

    def table(self) -> str:
        """A readable report: every plan measured, and the recommendation."""
        shape = f"{self.batch_size} x {self.seq_len} tokens" if self.seq_len else f"{self.batch_size} samples"
        device = "simulated device" if self.target == "simulated" else "CUDA device"
        lines = [
            f"{self.model}: batch of {shape}, {self.optimizer}, on a {format_bytes(self.capacity_bytes)} {device}",
            "",
            "| plan | tensor peak | with device overhead | fits |",
            "|---|---|---|---|",
        ]
        for index, c in enumerate(self.candidates):
            name = c.plan.describe(self.batch_size) + (" (baseline)" if index == 0 else "")
            verdict = "yes" if c.fits else f"no (runs out in {c.phase})"
            total = format_bytes(c.peak_bytes + c.device_overhead_bytes)
            lines.append(f"| {name} | {format_bytes(c.peak_bytes)} | {total} | {verdict} |")
        lines.append("")
        chosen = self.chosen
        if self.recommended is None:
            lines.append(
                f"Nothing on the ladder fits: the last plan tried needs {format_bytes(chosen.peak_bytes)} of tensors. "
                f"Use a smaller batch or sequence, a smaller model, or a larger device."
            )
        else:
            rungs = ", ".join(self.recommended.rungs(self.batch_size)) or "none"
            lines.append(
                f"Recommended: {self.recommended.describe(self.batch_size)} (rungs: {rungs}); predicted peak "
                f"{format_bytes(chosen.peak_bytes)} + {format_bytes(chosen.device_overhead_bytes)} device overhead "
                f"of {format_bytes(self.capacity_bytes)}."
            )
        lines.append(f"(planned in {self.seconds:.1f} s on fake tensors)")
        return "\n".join(lines)


def _plan_dict(plan: Plan, size: int) -> dict[str, Any]:
    return {
        **plan.to_dict(),
        "micro_batch_size": plan.effective_micro_batch_size(size),
        "micro_batches": plan.micro_batches(size),
        "rungs": list(plan.rungs(size)),
    }


class _Probe(AccountedDevice):
    """An unlimited simulated device that notes in which phase usage first passed ``budget``, and the peak of
    each phase."""

    def __init__(self, budget: int, phase: Callable[[], str]) -> None:
        super().__init__(_UNLIMITED, name="planner", on_allocate=self._note)
        self.budget = budget
        self.crossed: str | None = None
        self.phase_peaks: dict[str, int] = {}
        self._phase_of = phase

    def start(self) -> int:
        """Measure a new step from here; returns what is resident now."""
        self.reset_peak_memory_stats()
        self.crossed, self.phase_peaks = None, {}
        return self.memory_allocated()

    def failing_phase(self, base: int) -> str:
        """The phase a plan that does not fit fails in, as far as the rungs are concerned.

        What is resident before the step (weights, optimizer state) or needed by the optimizer step cannot be
        relieved by rungs that shrink activations: that is an optimizer-phase failure, whichever allocation
        would have been the first to fail.
        """
        late = max(self.phase_peaks.get(phase, 0) for phase in ("clip", "optimizer", "scheduler"))
        if base > self.budget or late > self.budget:
            return "optimizer"
        return self.crossed or "forward"

    def _note(self, allocated: int) -> None:
        """The ``on_allocate`` observer: after every allocation, and every resize of a tracked storage."""
        phase = self._phase_of()
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), allocated)
        if self.crossed is None and allocated > self.budget:
            self.crossed = phase


def dry_run(
    step_fn: Callable[[Any], Any],
    batch: Any,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    capacity: int,
    target: Target,
    label: str,
    ladder: Iterable[str | Rung] | None = None,
    max_grad_norm: float | None = None,
    bf16: bool = True,
    seq_len: int | None = None,
    optimizer_name: str | None = None,
    plans: Sequence[Plan] | None = None,
) -> PlanReport:
    """Walk the ladder for ``batch`` on fake tensors (or measure just ``plans``, in order, if given).

    Everything passed in must already be fake: call it inside the ``FakeTensorMode`` that made the model, the
    optimizer and the batch. The model's effects are undone before it returns.
    """
    started = time.perf_counter()
    size = batch_size(batch)
    core = unwrap(model)
    guard = OOMGuard(
        step_fn, model=model, optimizer=optimizer, ladder=[], max_grad_norm=max_grad_norm, relax_after=None,
        predictive=False, log_every=None, count_items=batch_size,
    )  # fmt: skip
    steps = resolve_ladder(ladder)
    context = RungContext(
        batch_size=size, num_blocks=len(find_blocks(core)), checkpointed=user_checkpointing(core), can_offload=True
    )
    budget = tensor_budget(capacity, target)
    probe = _Probe(budget, lambda: guard._runner.phase)
    peaks = PeakModel(margin=0.0)  # the measurements are exact: no safety margin on top of the overhead
    per_sample, fixed = items_per_sample(batch, size), grad_bytes(core)
    candidates: list[Candidate] = []

    def measure(plan: Plan) -> tuple[Candidate, int]:
        guard.plan = plan
        guard.effects.apply(plan, probe)  # as in any step but the plan's first: offloaded state already moved
        base = probe.start()
        guard(_two_micro_batches(batch, plan, size))
        peak = probe.max_memory_allocated()
        overhead = device_overhead(peak, target)
        fits = peak + overhead <= capacity
        candidates.append(Candidate(plan, peak, overhead, fits, None if fits else probe.failing_phase(base)))
        return candidates[-1], base

    try:
        with probe, _unpadded_masks():
            probe.adopt(model, _tensors(batch))
            guard.plan = Plan()
            guard(split_batch(batch, 1)[0])  # a one-sample warm-up step creates the optimizer state
            for given in plans or ():
                measure(given)
            plan: Plan | None = None if plans else Plan()
            while plan is not None and plan not in {c.plan for c in candidates}:
                measured, base = measure(plan)
                if measured.fits:
                    _grow(plan, size, candidates, measure)
                    break
                items = round(plan.effective_micro_batch_size(size) * per_sample)
                peaks.record_success(plan, items, measured.peak_bytes - base, fixed)
                sized = peaks.max_micro_batch(plan, budget, base, per_sample, fixed)
                failing = dataclasses.replace(context, phase=candidates[-1].phase or "forward", max_micro_batch=sized)
                step = steps.next(plan, failing)
                plan = step[1] if step is not None else None
    finally:
        guard.close()
    if not bf16:  # measured in bf16; fp16 autocast keeps activations the same size (the scaler's state is tiny)
        candidates = [dataclasses.replace(c, plan=_fp16(c.plan)) for c in candidates]
    fitting = [c.plan for c in candidates if c.fits]
    if not plans:  # the walk's fits share one configuration: the largest micro-batch is the cheapest
        fitting.sort(key=lambda p: -p.effective_micro_batch_size(size))
    return PlanReport(
        model=label, capacity_bytes=capacity, target=target, batch_size=size, seq_len=seq_len,
        optimizer=optimizer_name or type(optimizer).__name__, candidates=tuple(candidates),
        recommended=fitting[0] if fitting else None, seconds=time.perf_counter() - started,
    )  # fmt: skip


def _grow(fitting: Plan, size: int, tried: list[Candidate], measure: Callable[[Plan], Any]) -> None:
    """Find the largest micro-batch that fits in ``fitting``'s configuration, among the sizes halving visits
    (size/2, size/4...), by bisection between the one that fits and the smallest one known not to."""
    config = fitting.replace(micro_batch_size=None)
    same = [c for c in tried if c.plan.replace(micro_batch_size=None) == config]
    failed = [c.plan.effective_micro_batch_size(size) for c in same if not c.fits]
    low, high = fitting.effective_micro_batch_size(size), min(failed, default=size + 1)
    sizes = sorted({-(-size // 2**k) for k in range(size.bit_length() + 1)} & set(range(low + 1, high)))
    while sizes:
        middle = sizes[len(sizes) // 2]
        candidate, _ = measure(config.replace(micro_batch_size=None if middle >= size else middle))
        sizes = [s for s in sizes if (s > middle if candidate.fits else s < middle)]


def _two_micro_batches(batch: Any, plan: Plan, size: int) -> Any:
    """The first two micro-batches of ``batch`` on ``plan``: the same peak as all of them, in less time.

    The first micro-batch runs without gradients resident, the second with them, and every later one exactly
    like the second; the optimizer step does not depend on the batch at all.
    """
    micro = plan.effective_micro_batch_size(size)
    return split_batch(batch, 2 * micro)[0] if 2 * micro < size else batch


@contextlib.contextmanager
def _unpadded_masks() -> Iterator[None]:
    """Let transformers skip the attention mask on fake tensors as it does on real unpadded, unpacked batches.

    With real data, transformers checks that the attention mask pads nothing and that the position ids pack
    no second sequence, and then lets SDPA run causal without materialising a (batch, 1, seq, seq) mask. On
    fake tensors it cannot read those values and builds the full mask, which costs memory a real run would not
    spend. The planner plans full-length single sequences, so it answers both checks itself. A real batch that
    is padded or packed needs that mask on top.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    patches: dict[str, Callable[..., Any]] = {}
    skip_mask, find_packed = (
        getattr(masking_utils, name, None) for name in ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices")
    )
    if skip_mask is not None:
        patches["_ignore_causal_mask_sdpa"] = lambda padding, *args, **kwargs: skip_mask(
            None if padding is not None and is_fake(padding) else padding, *args, **kwargs
        )
    if find_packed is not None:
        patches["find_packed_sequence_indices"] = lambda ids: None if is_fake(ids) else find_packed(ids)
    originals = {name: getattr(masking_utils, name) for name in patches}
    try:
        for name, patch in patches.items():
            setattr(masking_utils, name, patch)
        yield
    finally:
        for name, original in originals.items():
            setattr(masking_utils, name, original)


def _fp16(plan: Plan) -> Plan:
    return plan.replace(precision="fp16") if plan.precision is not None else plan


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, torch.Tensor)]
