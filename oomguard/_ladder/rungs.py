"""Rungs of the fallback ladder: each takes a plan and returns a cheaper one, or None when it has no more to give.

Rungs are pure: they only compute plans. What a plan does to torch state lives in :mod:`oomguard._effects.effects`.
Each rung says which phases of a step it relieves (``relieves``): after an OOM in the optimizer step, halving
the micro-batches would not help, so the ladder skips to the first rung that relieves the failing phase (and
falls back to the first rung that can escalate at all when none does).
Rungs accumulate: an engaged rung stays on while the next one is added. When a rung other than ``micro_batch``
engages, the micro-batch size goes back to the whole batch, since the memory it frees may let larger
micro-batches fit again; the ladder then halves it afresh, so the plan the guard settles on is the cheapest
that fits, not merely the first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan, Precision

__all__ = [
    "DEFAULT_LADDER",
    "ActivationOffload",
    "Amp",
    "Checkpointing",
    "Ladder",
    "LayerOffload",
    "MicroBatch",
    "Rung",
    "RungContext",
    "relax",
    "resolve_ladder",
]


@dataclass(frozen=True)
class RungContext:
    """What a rung may look at when it picks the next plan."""

    batch_size: int
    #: Repeated blocks found in the model (decoder layers); 0 when it has none.
    num_blocks: int = 0
    #: Whether the device runs bf16 autocast (CPU, CUDA Ampere and newer).
    bf16_supported: bool = True
    #: Where the last attempt ran out of memory: forward, backward, clip, optimizer, apply...
    phase: str = "forward"
    #: Whether host memory is distinct from device memory (offloading cannot help a CPU-only run).
    can_offload: bool = True
    #: Whether the user already checkpoints every block (the checkpointing rung has nothing to add).
    checkpointed: bool = False
    #: The largest micro-batch predicted to fit on the failing configuration (predictive sizing), if known.
    max_micro_batch: int | None = None
    #: False when mixed precision is someone else's (Accelerate's): the amp rung then has nothing to give.
    amp_available: bool = True


_ACTIVATIONS = frozenset({"split", "forward", "backward"})
_EVERYWHERE = frozenset({"apply", "split", "forward", "backward", "clip", "optimizer"})


@runtime_checkable
class Rung(Protocol):
    """One step down the ladder. ``name`` appears in events and in ``StepResult.rungs``."""

    @property
    def name(self) -> str: ...

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        """A plan that needs less memory than ``plan``, or None if this rung has nothing more to give."""
        ...


@dataclass(frozen=True)
class MicroBatch:
    """Halve the micro-batch size: 2, 4, 8 ... micro-batches with exact gradient accumulation.

    Stops at ``min_size`` samples per micro-batch (1 by default). An uneven last micro-batch is fine.
    """

    min_size: int = 1
    name: str = "micro_batch"
    relieves: frozenset[str] = _ACTIVATIONS

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        current = plan.effective_micro_batch_size(context.batch_size)
        if current <= self.min_size:
            return None
        target = -(-current // 2)
        if context.max_micro_batch is not None:  # jump past halvings the peak model says cannot fit
            target = min(target, context.max_micro_batch)
        return plan.replace(micro_batch_size=max(self.min_size, target))


@dataclass(frozen=True)
class Amp:
    """Mixed precision: bf16 autocast where the device supports it, else fp16 with a gradient scaler.

    ``dtype`` forces one of the two.
    """

    dtype: Precision | None = None
    name: str = "amp"
    relieves: frozenset[str] = _ACTIVATIONS

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.precision is not None or not context.amp_available:
            return None
        dtype: Precision = self.dtype or ("bf16" if context.bf16_supported else "fp16")
        return plan.replace(precision=dtype)


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing of the repeated blocks: every other block first, then every block."""

    name: str = "checkpointing"
    relieves: frozenset[str] = _ACTIVATIONS

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if context.num_blocks == 0 or context.checkpointed or plan.checkpointing == "full":
            return None
        if plan.checkpointing is None and context.num_blocks > 1:
            return plan.replace(checkpointing="partial")
        return plan.replace(checkpointing="full")


@dataclass(frozen=True)
class ActivationOffload:
    """Keep the tensors saved for backward in host memory, bringing them back for backward."""

    name: str = "activation_offload"
    relieves: frozenset[str] = _ACTIVATIONS

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.activation_offload or not context.can_offload:
            return None
        return plan.replace(activation_offload=True)


@dataclass(frozen=True)
class LayerOffload:
    """Keep the parameters, gradients and optimizer state of 1, 2, 4 ... blocks (up to all) in host memory."""

    name: str = "layer_offload"
    relieves: frozenset[str] = _EVERYWHERE

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.offload_layers >= context.num_blocks or not context.can_offload:
            return None
        return plan.replace(offload_layers=min(context.num_blocks, max(1, 2 * plan.offload_layers)))


_BUILTIN: dict[str, type[Rung]] = {
    "micro_batch": MicroBatch,
    "amp": Amp,
    "checkpointing": Checkpointing,
    "activation_offload": ActivationOffload,
    "layer_offload": LayerOffload,
}
DEFAULT_LADDER: tuple[str, ...] = ("micro_batch", "amp", "checkpointing", "activation_offload", "layer_offload")


class Ladder:
    """An ordered sequence of rungs; :meth:`next` finds the first rung that can still give something."""

    def __init__(self, rungs: Sequence[Rung]) -> None:
        self.rungs = tuple(rungs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(rung.name for rung in self.rungs)

    def next(self, plan: Plan, context: RungContext) -> tuple[Rung, Plan] | None:
        """The rung to engage after ``plan`` failed, and the plan it gives; None when the ladder is exhausted."""
        options = []
        for rung in self.rungs:
            cheaper = rung.escalate(plan, context)
            if cheaper is not None and cheaper != plan:
                options.append((rung, cheaper))
        relieving = [(r, p) for r, p in options if context.phase in getattr(r, "relieves", _EVERYWHERE)]
        if not options:
            return None
        rung, cheaper = (relieving or options)[0]
        if not isinstance(rung, MicroBatch) and "micro_batch" in self.names:
            cheaper = cheaper.replace(micro_batch_size=None)  # a deeper rung may let larger micro-batches fit
        return rung, cheaper


def relax(plan: Plan, batch_size: int, min_micro_batch: int = 1) -> Plan | None:
    """One step back up the ladder: the plan tried just before ``plan``; None for the plan of a whole batch.

    The reverse of escalation: first the micro-batches grow back (doubling) to the whole batch; then the
    deepest engaged rung is undone (fewer offloaded layers, then activation offload, then checkpointing, then
    amp), at the smallest micro-batch, as the ladder had it before that rung engaged.

    >>> relax(Plan(micro_batch_size=2), 8), relax(Plan(micro_batch_size=4), 8)
    (Plan(micro_batch_size=4, ...), Plan(micro_batch_size=None, ...))
    >>> relax(Plan(precision="bf16"), 8)
    Plan(micro_batch_size=1, precision=None, ...)
    """
    current = plan.effective_micro_batch_size(batch_size)
    if current < batch_size:
        doubled = 2 * current
        return plan.replace(micro_batch_size=None if doubled >= batch_size else doubled)
    smallest = min(min_micro_batch, batch_size)
    if plan.offload_layers:
        return plan.replace(offload_layers=plan.offload_layers // 2, micro_batch_size=smallest)
    if plan.activation_offload:
        return plan.replace(activation_offload=False, micro_batch_size=smallest)
    if plan.checkpointing is not None:
        return plan.replace(
            checkpointing="partial" if plan.checkpointing == "full" else None, micro_batch_size=smallest
        )
    if plan.precision is not None:
        return plan.replace(precision=None, micro_batch_size=smallest)
    return None


def resolve_ladder(spec: Iterable[str | Rung] | None) -> Ladder:
    """Build a ladder from rung names and rung objects; ``None`` gives the default order.

    >>> resolve_ladder(None).names
    ('micro_batch', 'amp', 'checkpointing', 'activation_offload', 'layer_offload')
    """
    if spec is None:
        spec = DEFAULT_LADDER
    if isinstance(spec, str):
        raise GuardConfigError(f"ladder= takes a list of rung names, not a string: write ladder=[{spec!r}]")
    rungs: list[Rung] = []
    for item in spec:
        if isinstance(item, str):
            factory = _BUILTIN.get(item)
            if factory is None:
                raise GuardConfigError(
                    f"unknown rung {item!r} in ladder=; the rungs are: {', '.join(DEFAULT_LADDER)} "
                    f"(or pass an object with a name and an escalate(plan, context) method)"
                )
            rungs.append(factory())
        elif isinstance(item, Rung):
            rungs.append(item)
        else:
            raise GuardConfigError(
                f"ladder= entries must be rung names or rung objects, got {type(item).__name__}: {item!r}"
            )
    names = [rung.name for rung in rungs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise GuardConfigError(f"ladder= names the rung(s) {duplicates} more than once; list each rung once")
    return Ladder(rungs)


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast runs natively on ``device`` (CPU: yes; CUDA: compute capability 8.0+)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return True
