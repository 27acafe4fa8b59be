"""Rungs of the fallback ladder: each one is a policy over one part of the plan.

A rung knows which phases of a step it relieves, how far down it a plan is (its level: 0 when it is not
engaged), how to make a plan cheaper (:meth:`Rung.escalate`) and how to give itself back one step
(:meth:`Rung.relax`). Rungs are pure: they only compute plans. What a plan does to torch state is the business of
the rung's effect (:mod:`oomguard._effects`); a rung that is not built in names its own (:meth:`Rung.effect`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from oomguard._ladder.plan import ACTIVATION_PHASES, EVERY_PHASE, Phase, Plan, Precision, keeps_master_weights

__all__ = [
    "ActivationOffload",
    "Amp",
    "Checkpointing",
    "LayerOffload",
    "MicroBatch",
    "OptimizerOffload",
    "QuantizedOptimizer",
    "QuantizedWeights",
    "Rung",
    "RungContext",
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
    phase: Phase = Phase.FORWARD
    #: Whether host memory is distinct from device memory (offloading cannot help a CPU-only run).
    can_offload: bool = True
    #: Whether the user already checkpoints every block (the checkpointing rung has nothing to add).
    checkpointed: bool = False
    #: The largest micro-batch predicted to fit on the failing configuration (predictive sizing), if known.
    max_micro_batch: int | None = None
    #: False when mixed precision is someone else's (Accelerate's): the amp rung then has nothing to give.
    amp_available: bool = True
    #: False when the optimizer cannot step on the host (its state must stay on the device: capturable Adam).
    optimizer_offloadable: bool = True
    #: Whether the ranks of a torch.distributed job train together (DDP's buckets fix the parameters' dtype).
    distributed: bool = False
    #: Whether the optimizer's state can be kept in 8 bits (torch's Adam and AdamW).
    optimizer_quantizable: bool = True
    #: Whether the model has frozen linear weights the quantized_weights rung can keep in 8 bits.
    frozen_linears: bool = False


class Rung:
    """One step down the ladder. ``name`` appears in events, in ``StepResult.rungs`` and in the report.

    Subclass it for a rung of your own: give it a ``name``, the phases it ``relieves`` and how deep it goes
    (``max_level``), and return the class of its effect from :meth:`effect` (a subclass of
    ``oomguard._effects.Effect``, called with the model's effect target). Its level lives in the plan's
    ``extras``; each out-of-memory error that it answers takes it one level down, each relaxation one level up.
    Built-in rungs keep their level in a plan field of their own instead.

    >>> class Quiet(Rung):
    ...     name = "quiet"
    >>> plan = Quiet().escalate(Plan(), RungContext(batch_size=8))
    >>> plan.rungs(8), Quiet().relax(plan, 8) == Plan()
    (('quiet',), True)
    """

    name: str
    #: The phases of a step whose memory this rung reduces; after an OOM in another phase, the ladder prefers
    #: rungs that relieve it.
    relieves: frozenset[Phase] = EVERY_PHASE
    #: How many levels down this rung goes (the default :meth:`escalate` stops there).
    max_level: int = 1

    def level(self, plan: Plan, batch_size: int) -> int:
        """How far down this rung ``plan`` is: 0 when the rung is not engaged, deeper is larger."""
        return plan.level(self.name)

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        """``plan`` with this rung at ``level`` (what every rank of a distributed job agrees on)."""
        return plan.with_level(self.name, level)

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        """A plan that needs less memory than ``plan``, or None if this rung has nothing more to give."""
        level = self.level(plan, context.batch_size)
        return self.at_level(plan, level + 1, context.batch_size) if level < self.max_level else None

    def relax(self, plan: Plan, batch_size: int) -> Plan | None:
        """One step back up this rung: the plan before its last escalation; None when it is not engaged."""
        level = self.level(plan, batch_size)
        return self.at_level(plan, level - 1, batch_size) if level > 0 else None

    def effect(self) -> Callable[[Any], Any] | None:
        """The class (or factory) of this rung's effect on torch state, if it has one of its own."""
        return None

    def reaches(self, plan: Plan, context: RungContext) -> bool:
        """Whether this rung, in ``context``, could take a plan to where ``plan`` has it: what a plan another job
        remembered must meet for this guard to take it (see :meth:`~oomguard._ladder.ladder.Ladder.beyond`).

        The default walks down as escalation does, from ``plan`` without this rung, until it meets ``plan``'s
        level (True) or can go no deeper (False). So a level deeper than the rung goes is out of reach, and so is
        one whose preconditions this model, optimizer or device lacks (bf16, an optimizer whose state can be kept
        in 8 bits, frozen weights to quantize, blocks to checkpoint...): each rung's :meth:`escalate` knows them.
        """
        size = context.batch_size
        wanted, level, current = self.level(plan, size), 0, self.at_level(plan, 0, size)
        while level < wanted:
            deeper = self.escalate(current, context)
            if deeper is None or self.level(deeper, size) <= level:
                return False  # (a rung that cannot go deeper, or would not: no walk of this ladder gets there)
            current, level = deeper, self.level(deeper, size)
        return level == wanted

    def setting(self, plan: Plan, batch_size: int) -> str:
        """How ``plan`` sets this rung, in words for a message (``offload_layers=5``)."""
        return f"{self.name} at level {self.level(plan, batch_size)}"


@dataclass(frozen=True)
class MicroBatch(Rung):
    """Halve the micro-batch size: 2, 4, 8 ... micro-batches with exact gradient accumulation.

    Stops at ``min_size`` samples per micro-batch (1 by default). An uneven last micro-batch is fine. Its level
    is how many samples fewer than the batch a micro-batch holds.
    """

    min_size: int = 1
    name: str = "micro_batch"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    def level(self, plan: Plan, batch_size: int) -> int:
        return batch_size - plan.effective_micro_batch_size(batch_size)

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        return plan.replace(micro_batch_size=None if level <= 0 else batch_size - level)

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        current = plan.effective_micro_batch_size(context.batch_size)
        if current <= self.min_size:
            return None
        target = -(-current // 2)
        if context.max_micro_batch is not None:  # jump past halvings the peak model says cannot fit
            target = min(target, context.max_micro_batch)
        return plan.replace(micro_batch_size=max(self.min_size, target))

    def relax(self, plan: Plan, batch_size: int) -> Plan | None:
        """Micro-batches twice as large, up to the whole batch."""
        current = plan.effective_micro_batch_size(batch_size)
        if current >= batch_size:
            return None
        doubled = 2 * current
        return plan.replace(micro_batch_size=None if doubled >= batch_size else doubled)

    def smallest(self, plan: Plan, batch_size: int) -> Plan:
        """``plan`` at the smallest micro-batch this rung allows: where halving ended before a deeper rung."""
        return plan.replace(micro_batch_size=min(self.min_size, batch_size))

    def floor(self, batch_size: int) -> int:
        """The smallest micro-batch this rung allows for a batch of ``batch_size``."""
        return min(self.min_size, batch_size)

    def reaches(self, plan: Plan, context: RungContext) -> bool:
        """Micro-batches of any size down to ``min_size`` (predictive sizing picks sizes halving never visits)."""
        return plan.micro_batch_size is None or plan.micro_batch_size >= self.min_size

    def setting(self, plan: Plan, batch_size: int) -> str:
        return f"micro_batch_size={plan.micro_batch_size}"


class _OneField(Rung):
    """A rung whose part of the plan is one field that takes a few values, the shallowest (not engaged) first."""

    _FIELD: ClassVar[str]
    _LEVELS: ClassVar[tuple[Any, ...]]

    def level(self, plan: Plan, batch_size: int) -> int:
        return self._LEVELS.index(getattr(plan, self._FIELD))

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        return plan.replace(**{self._FIELD: self._LEVELS[level]})

    def setting(self, plan: Plan, batch_size: int) -> str:
        return f"{self._FIELD}={getattr(plan, self._FIELD)!r}"


@dataclass(frozen=True)
class Amp(_OneField):
    """Mixed precision: bf16 autocast where the device supports it, else fp16 with a gradient scaler.

    ``dtype`` forces one of the two.
    """

    dtype: Precision | None = None
    name: str = "amp"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    _FIELD = "precision"
    _LEVELS = (None, "bf16", "fp16")  # fp16 the deeper: where ranks disagree, the one every device runs

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.precision is not None or not context.amp_available:
            return None
        dtype: Precision = self.dtype or ("bf16" if context.bf16_supported else "fp16")
        return plan.replace(precision=dtype)

    def relax(self, plan: Plan, batch_size: int) -> Plan | None:
        return plan.replace(precision=None) if plan.precision is not None else None

    def reaches(self, plan: Plan, context: RungContext) -> bool:
        if plan.precision == "fp16" and self.dtype is None and context.distributed and context.amp_available:
            return True  # ranks on devices that differ agree on fp16, which every device runs
        return super().reaches(plan, context)


@dataclass(frozen=True)
class Checkpointing(_OneField):
    """Activation checkpointing of the repeated blocks: every other block first, then every block."""

    name: str = "checkpointing"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    _FIELD = "checkpointing"
    _LEVELS = (None, "partial", "full")

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if context.num_blocks == 0 or context.checkpointed or plan.checkpointing == "full":
            return None
        if plan.checkpointing is None and context.num_blocks > 1:
            return plan.replace(checkpointing="partial")
        return plan.replace(checkpointing="full")


@dataclass(frozen=True)
class ActivationOffload(_OneField):
    """Keep the tensors saved for backward in host memory, bringing them back for backward."""

    name: str = "activation_offload"
    relieves: frozenset[Phase] = ACTIVATION_PHASES

    _FIELD = "activation_offload"
    _LEVELS = (False, True)

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.activation_offload or not context.can_offload:
            return None
        return plan.replace(activation_offload=True)


@dataclass(frozen=True)
class OptimizerOffload(_OneField):
    """Keep the optimizer's state (Adam's moments) in host memory and run the optimizer step there: the device
    keeps the parameters and gradients only. Each step copies the gradients and parameters to the host and the
    updated parameters back; the maths is the optimizer's own, on the host.

    Its second level, where the plan runs bf16 and offloads no layer (and not under ``torch.distributed``, whose
    gradient buckets are made for the parameters' dtype), also keeps the fp32 master weights on the host and only
    a bf16 copy on the device: weights and gradients take half the device memory, a step moves 4 bytes per
    parameter, and the maths is bf16 training with fp32 master weights (within amp's tolerance)."""

    name: str = "optimizer_offload"
    relieves: frozenset[Phase] = EVERY_PHASE  # the state is resident in every phase; the master level halves weights

    _FIELD = "optimizer_offload"
    _LEVELS = (False, True, "master")

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if not context.can_offload or not context.optimizer_offloadable:
            return None
        if not plan.optimizer_offload:
            return plan.replace(optimizer_offload=True, quantized_optimizer=False)  # (state on the host: in fp32)
        if plan.optimizer_offload is True and keeps_master_weights(plan.precision, plan.offload_layers):
            return None if context.distributed else plan.replace(optimizer_offload="master")
        return None

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        """``plan`` at ``level``; the master level only where ``plan`` can keep master weights (see
        :func:`~oomguard._ladder.plan.keeps_master_weights`), the first level elsewhere: what would run."""
        if level == 2 and not keeps_master_weights(plan.precision, plan.offload_layers):
            level = 1
        return super().at_level(plan, level, batch_size)


@dataclass(frozen=True)
class QuantizedOptimizer(_OneField):
    """Keep Adam's moments in block-wise 8-bit storage on the device (2 bytes of state per parameter instead of
    8); the optimizer runs its own algorithm on them, dequantized a few parameters at a time. Changes the maths
    like ``amp``: each moment keeps about 3 significant bits. Only for torch's Adam and AdamW; offloading the
    optimizer's state supersedes it (those rungs end it)."""

    name: str = "quantized_optimizer"
    relieves: frozenset[Phase] = EVERY_PHASE  # the state is resident in every phase

    _FIELD = "quantized_optimizer"
    _LEVELS = (False, True)

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        offloaded = plan.optimizer_offload or plan.offload_layers
        if plan.quantized_optimizer or offloaded or not context.optimizer_quantizable:
            return None
        return plan.replace(quantized_optimizer=True)


@dataclass(frozen=True)
class QuantizedWeights(_OneField):
    """Keep frozen ``nn.Linear`` weights (a LoRA job's base model) in 8 bits on the device, per output channel,
    then, one level deeper, in 4 bits (NF4 codes with one scale per 64 values), and their exact originals on the
    host; trainable parameters are never quantized. Changes the maths like ``amp``. Inapplicable to a model with
    no frozen linear weight; layer offload ends it."""

    name: str = "quantized_weights"
    relieves: frozenset[Phase] = EVERY_PHASE  # the weights are resident in every phase

    _FIELD = "quantized_weights"
    _LEVELS = (False, True, "4bit")

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.quantized_weights == "4bit" or plan.offload_layers or not context.frozen_linears:
            return None
        return plan.replace(quantized_weights="4bit" if plan.quantized_weights else True)


@dataclass(frozen=True)
class LayerOffload(Rung):
    """Keep the parameters, gradients and optimizer state of 1, 2, 4 ... blocks (up to all) in host memory."""

    name: str = "layer_offload"
    relieves: frozenset[Phase] = EVERY_PHASE

    def level(self, plan: Plan, batch_size: int) -> int:
        return plan.offload_layers

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        return plan.replace(offload_layers=level)

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        if plan.offload_layers >= context.num_blocks or not context.can_offload:
            return None
        layers = min(context.num_blocks, max(1, 2 * plan.offload_layers))
        # (offloaded blocks keep fp32 weights and state on the host: master weights and 8-bit storage end)
        offload = True if plan.optimizer_offload == "master" else plan.optimizer_offload
        return plan.replace(
            offload_layers=layers, optimizer_offload=offload, quantized_optimizer=False, quantized_weights=False
        )

    def reaches(self, plan: Plan, context: RungContext) -> bool:
        """Any number of blocks up to all (stepping back up halves what escalation doubled: 6 -> 3), where host
        memory is distinct from the device's."""
        return not plan.offload_layers or (context.can_offload and plan.offload_layers <= context.num_blocks)

    def setting(self, plan: Plan, batch_size: int) -> str:
        return f"offload_layers={plan.offload_layers}"

    def relax(self, plan: Plan, batch_size: int) -> Plan | None:
        """Half as many blocks offloaded (4 -> 2 -> 1 -> 0), as escalation doubled them."""
        return plan.replace(offload_layers=plan.offload_layers // 2) if plan.offload_layers else None
