"""The plan: a small immutable description of how one training step is run.

A plan says how the batch is split and which memory-saving techniques are engaged. Rungs turn a plan into a
cheaper one; the effects module applies it to the model; nothing else changes it. Being frozen, a plan can be
logged, compared, used as a dict key and stored on disk as it is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["RUNG_ORDER", "CheckpointingMode", "Plan", "Precision"]

Precision = Literal["bf16", "fp16"]
CheckpointingMode = Literal["partial", "full"]

#: The canonical order of rung names, cheapest effect on the training maths first.
RUNG_ORDER = ("micro_batch", "amp", "checkpointing", "activation_offload", "layer_offload")


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
        offload_layers: how many repeated blocks keep their parameters, gradients and optimizer state in host
            memory, streamed to the device only while in use.

    >>> Plan().micro_batches(8), Plan(micro_batch_size=3).micro_batches(8)
    (1, 3)
    >>> Plan(micro_batch_size=2, precision="bf16").rungs(8)
    ('micro_batch', 'amp')
    """

    micro_batch_size: int | None = None
    precision: Precision | None = None
    checkpointing: CheckpointingMode | None = None
    activation_offload: bool = False
    offload_layers: int = 0

    def __post_init__(self) -> None:
        size = self.micro_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"Plan.micro_batch_size must be a positive int or None (the whole batch), got {size!r}")
        if self.precision not in (None, "bf16", "fp16"):
            raise ValueError(f"Plan.precision must be None, 'bf16' or 'fp16', got {self.precision!r}")
        if self.checkpointing not in (None, "partial", "full"):
            raise ValueError(f"Plan.checkpointing must be None, 'partial' or 'full', got {self.checkpointing!r}")
        if isinstance(self.offload_layers, bool) or not isinstance(self.offload_layers, int) or self.offload_layers < 0:
            raise ValueError(f"Plan.offload_layers must be an int >= 0, got {self.offload_layers!r}")

    def effective_micro_batch_size(self, batch_size: int) -> int:
        """The micro-batch size this plan uses for a batch of ``batch_size`` samples."""
        if self.micro_batch_size is None:
            return batch_size
        return min(self.micro_batch_size, batch_size)

    def micro_batches(self, batch_size: int) -> int:
        """How many micro-batches a batch of ``batch_size`` samples is split into."""
        return max(1, math.ceil(batch_size / max(1, self.effective_micro_batch_size(batch_size))))

    def rungs(self, batch_size: int) -> tuple[str, ...]:
        """Names of the rungs in effect for a batch of this size (``"micro_batch"`` only if it is split)."""
        engaged = {
            "micro_batch": self.micro_batches(batch_size) > 1,
            "amp": self.precision is not None,
            "checkpointing": self.checkpointing is not None,
            "activation_offload": self.activation_offload,
            "layer_offload": self.offload_layers > 0,
        }
        return tuple(name for name in RUNG_ORDER if engaged[name])

    def replace(self, **changes: Any) -> Plan:
        """A copy of this plan with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The inverse of :meth:`to_dict`; unknown keys are an error."""
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown plan field(s) {sorted(unknown)}")
        return cls(**data)

    def describe(self, batch_size: int | None = None) -> str:
        """A short human-readable form, e.g. ``"micro-batches of 4 (x2), bf16, full checkpointing"``."""
        if self.micro_batch_size is None or (batch_size is not None and self.micro_batch_size >= batch_size):
            parts = ["whole batch"]
        elif batch_size is None:
            parts = [f"micro-batches of {self.micro_batch_size}"]
        else:
            parts = [f"micro-batches of {self.micro_batch_size} (x{self.micro_batches(batch_size)})"]
        if self.precision is not None:
            parts.append(self.precision)
        if self.checkpointing is not None:
            parts.append(f"{self.checkpointing} checkpointing")
        if self.activation_offload:
            parts.append("activations offloaded")
        if self.offload_layers:
            parts.append(f"{self.offload_layers} layer(s) offloaded")
        return ", ".join(parts)
