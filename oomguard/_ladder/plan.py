"""The plan: a small immutable description of how one training step is run, and the phases of a step.

A plan says how the batch is split and which memory-saving rungs are engaged, and how far. Rungs turn a plan into
one that needs less memory; the effects apply it to the model; nothing else changes it. Being frozen, a plan can
be logged, compared, used as a dict key and stored on disk as it is.

The rungs the package was first built with each own a field; :meth:`Plan.rungs` and :meth:`Plan.describe` ask
the registered rungs (:mod:`oomguard._ladder.registry`), in their canonical order, how far down them the plan is
and how to word it. Any other rung keeps its level in ``extras`` (0, absent, when not engaged): a built-in rung
registered later (one module and a registration line, without a new field, which would change this public
constructor) and a user's own. A built-in rung there is still named in ``describe()`` by its own phrase, and
written in :meth:`Plan.to_dict` as a key of its own, like a field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from oomguard._ladder import registry

__all__ = [
    "ACTIVATION_PHASES",
    "BUILTIN_RUNGS",
    "EVERY_PHASE",
    "CheckpointingMode",
    "Phase",
    "Plan",
    "Precision",
    "keeps_master_weights",
]

Precision = Literal["bf16", "fp16"]
CheckpointingMode = Literal["partial", "full"]


class Phase(str, Enum):
    """Where in a step an attempt is: what an out-of-memory error is attributed to, and what a rung relieves.

    The values are the strings events and logs carry (``"forward"``...), and a phase compares equal to them.
    """

    APPLY = "apply"  # bringing the model to the plan (checkpointing, offloading layers)
    SPLIT = "split"  # splitting the batch and counting each micro-batch's items
    FORWARD = "forward"
    BACKWARD = "backward"
    CLIP = "clip"
    OPTIMIZER = "optimizer"  # the optimizer step, and the scheduler step with it
    DONE = "done"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: The phases whose memory is activations: what splitting, mixed precision, checkpointing and offloading
#: activations relieve.
ACTIVATION_PHASES = frozenset({Phase.SPLIT, Phase.FORWARD, Phase.BACKWARD})
EVERY_PHASE = frozenset(Phase)


@dataclass(frozen=True)
class Plan:
    """How a training step is run.

    Attributes:
        micro_batch_size: the largest number of samples run through forward and backward at once; ``None``
            runs the whole batch in one pass. A batch larger than this is split into
            ``ceil(batch_size / micro_batch_size)`` micro-batches whose gradients are accumulated exactly.
        precision: ``"bf16"`` or ``"fp16"`` to run the forward under ``torch.autocast`` (fp16 with a gradient
            scaler); ``None`` for full precision.
        checkpointing: ``"partial"`` checkpoints every other repeated block, ``"full"`` every block.
        activation_offload: keep tensors saved for backward in host memory.
        optimizer_offload: ``True`` keeps the optimizer's state in host memory and runs its step there; the
            parameters stay on the device. ``"master"`` also keeps the fp32 master weights on the host and only a
            bf16 copy of them on the device: it needs ``precision="bf16"`` and no offloaded layers (a plan that
            asks for it without them is refused; :meth:`replace` that takes them away gives ``True``).
        offload_layers: how many repeated blocks keep their parameters, gradients and optimizer state in host
            memory, streamed to the device only while in use.
        quantized_optimizer: keep Adam's moments in block-wise 8-bit storage on the device.
        quantized_weights: ``True`` keeps frozen ``nn.Linear`` weights in 8 bits on the device, their originals on
            the host; ``"4bit"`` in 4 bits (NF4 codes, one scale per 64 values).
        extras: the levels of rungs that are not built in, by rung name (see :class:`oomguard.Rung`); empty
            unless such a rung is engaged.

    >>> Plan().micro_batches(8), Plan(micro_batch_size=3).micro_batches(8)
    (1, 3)
    >>> Plan(micro_batch_size=2, precision="bf16").rungs(8)
    ('micro_batch', 'amp')
    """

    micro_batch_size: int | None = None
    precision: Precision | None = None
    checkpointing: CheckpointingMode | None = None
    activation_offload: bool = False
    optimizer_offload: bool | Literal["master"] = False
    offload_layers: int = 0
    quantized_optimizer: bool = False
    quantized_weights: bool | Literal["4bit"] = False
    extras: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        size = self.micro_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"Plan.micro_batch_size must be a positive int or None (the whole batch), got {size!r}")
        if self.precision not in (None, "bf16", "fp16"):
            raise ValueError(f"Plan.precision must be None, 'bf16' or 'fp16', got {self.precision!r}")
        if self.checkpointing not in (None, "partial", "full"):
            raise ValueError(f"Plan.checkpointing must be None, 'partial' or 'full', got {self.checkpointing!r}")
        for name in ("activation_offload", "quantized_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Plan.{name} must be True or False, got {getattr(self, name)!r}")
        for name, named in (("optimizer_offload", "master"), ("quantized_weights", "4bit")):
            value = getattr(self, name)
            if not isinstance(value, bool) and value != named:
                raise ValueError(f"Plan.{name} must be True, False or {named!r}, got {value!r}")
        if isinstance(self.offload_layers, bool) or not isinstance(self.offload_layers, int) or self.offload_layers < 0:
            raise ValueError(f"Plan.offload_layers must be an int >= 0, got {self.offload_layers!r}")
        for name, level in self.extras:
            if registry.in_field(name) or isinstance(level, bool) or not isinstance(level, int) or level < 1:
                raise ValueError(
                    f"Plan.extras holds (name, level >= 1) pairs of rungs without a plan field of their own, got "
                    f"{self.extras!r}"
                )
        if self.optimizer_offload == "master" and not keeps_master_weights(self.precision, self.offload_layers):
            raise ValueError(  # (it would run the first level and be described, logged and saved as the second)
                f"Plan.optimizer_offload='master' keeps fp32 master weights on the host only with precision='bf16' "
                f"and no offloaded layers, got precision={self.precision!r} and offload_layers={self.offload_layers}: "
                f"add precision='bf16' (and offload_layers=0), or write optimizer_offload=True, which is what it runs"
            )

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name != "extras"]
        return f"Plan({', '.join(shown + ([f'extras={self.extras!r}'] if self.extras else []))})"

    def effective_micro_batch_size(self, batch_size: int) -> int:
        """The micro-batch size this plan uses for a batch of ``batch_size`` samples."""
        if self.micro_batch_size is None:
            return batch_size
        return min(self.micro_batch_size, batch_size)

    def micro_batches(self, batch_size: int) -> int:
        """How many micro-batches a batch of ``batch_size`` samples is split into."""
        return max(1, math.ceil(batch_size / max(1, self.effective_micro_batch_size(batch_size))))

    def level(self, rung: str) -> int:
        """How far down the rung ``rung`` (not a built-in one) this plan is; 0 when it is not engaged."""
        return dict(self.extras).get(rung, 0)

    def with_level(self, rung: str, level: int) -> Plan:
        """This plan with the rung ``rung`` (not a built-in one) at ``level`` (0 disengages it)."""
        extras = dict(self.extras)
        extras[rung] = level
        return self.replace(extras=tuple((name, value) for name, value in extras.items() if value > 0))

    def rungs(self, batch_size: int) -> tuple[str, ...]:
        """Names of the rungs in effect for a batch of this size (``"micro_batch"`` only if it is split)."""
        engaged = (rung.name for rung in registry.entries() if rung.level(self, batch_size) > 0)
        return (*engaged, *(name for name, _ in self.extras if registry.find(name) is None))

    def replace(self, **changes: Any) -> Plan:
        """A copy of this plan with some fields changed.

        A change that takes away what optimizer offload's master level needs (bf16, no offloaded layer) takes that
        level back to ``True``, which is what the plan then runs: rungs, the ranks' agreement and the planner
        change one field at a time. Asking for the master level where it cannot run is refused, as in ``Plan()``.

        >>> Plan(precision="bf16", optimizer_offload="master").replace(precision=None).optimizer_offload
        True
        """
        if self.optimizer_offload == "master" and "optimizer_offload" not in changes:
            precision = changes.get("precision", self.precision)
            if not keeps_master_weights(precision, changes.get("offload_layers", self.offload_layers)):
                changes["optimizer_offload"] = True
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready data: every field; a built-in rung without a field, where engaged, under its
        own name; ``extras`` only where a rung that is not built in is engaged."""
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extras"}
        data.update((name, level) for name, level in self.extras if registry.find(name) is not None)
        others = {name: level for name, level in self.extras if registry.find(name) is None}
        if others:
            data["extras"] = others
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The inverse of :meth:`to_dict`; unknown keys are an error.

        Also reads a plan as ``oomguard plan --json`` writes it (its ``"plan"``), which adds what the plan makes of
        the batch planned: ``micro_batches`` and ``rungs`` are read over, except that one micro-batch is the whole
        batch (its ``micro_batch_size`` there is the batch's size).

        >>> Plan.from_dict({"micro_batch_size": 8, "micro_batches": 1, "rungs": []}) == Plan()
        True
        """
        if "micro_batches" in data:  # (planned: see above)
            whole = data["micro_batches"] == 1
            data = {key: value for key, value in data.items() if key not in ("micro_batches", "rungs")}
            data = {**data, "micro_batch_size": None} if whole else data
        names = {f.name for f in dataclasses.fields(cls)}
        # (a built-in rung without a field of its own is written under its name: its level goes to ``extras``)
        levels = {key: value for key, value in data.items() if _kept_in_extras(key) and key not in names}
        unknown = set(data) - names - set(levels)
        if unknown:
            raise ValueError(f"unknown plan field(s) {sorted(unknown)}")
        values = {key: value for key, value in data.items() if key in names}
        extras = {**levels, **dict(values.get("extras", {}))}
        if extras:
            values["extras"] = tuple(extras.items())
        return cls(**values)

    def describe(self, batch_size: int | None = None) -> str:
        """A short human-readable form, e.g. ``"micro-batches of 4 (x2), bf16, full checkpointing"``."""
        if self.micro_batch_size is None or (batch_size is not None and self.micro_batch_size >= batch_size):
            parts = ["whole batch"]
        elif batch_size is None:
            parts = [f"micro-batches of {self.micro_batch_size}"]
        else:
            parts = [f"micro-batches of {self.micro_batch_size} (x{self.micro_batches(batch_size)})"]
        rungs = (rung for rung in registry.entries() if not rung.sizing)
        parts += [phrase for rung in rungs if (phrase := rung.describe(self, batch_size)) is not None]
        extras = ((name, level) for name, level in self.extras if registry.find(name) is None)
        parts += [name if level == 1 else f"{name} (level {level})" for name, level in extras]
        return ", ".join(parts)


def keeps_master_weights(precision: Precision | None, offload_layers: int) -> bool:
    """Whether a plan of this precision and offloaded layers can run optimizer offload's master level: its bf16
    weights on the device are the autocast's own, and offloaded blocks keep their fp32 weights on the host whole."""
    return precision == "bf16" and not offload_layers


def _kept_in_extras(name: str) -> bool:
    return registry.find(name) is not None and not registry.in_field(name)


#: The built-in rungs' names, in canonical order (a live view of the registry).
BUILTIN_RUNGS = registry.BUILTIN_RUNGS
