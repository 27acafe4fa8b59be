"""The dry-run planner's answers, recorded: a restart, or a second bucket of the same batch shape, plans nothing.

The planner's answer for a batch (the plan it recommends, or that none fits) depends on the model (its
fingerprint), the device (its identity), the optimizer (its class and the options that shape its state), the
batch's shapes and dtypes, the options the dry run takes (the ladder, ``max_grad_norm``, whether the device has
bf16), and the room it plans in: the device memory free for the model and the host budget. The first six make
an answer's key (:meth:`Answers.key`); the room is a range kept with the answer (:class:`Answer`): from what
its plan needs up to what the least demanding plan it measured that did not fit needs, on the device and on
the host. Within that range the plan still fits by the planner's own measurements, and no plan it measured
and found too large would fit: the answer is taken instead of a new dry run. Outside it, the guard plans again.

Answers live in the guard (every bucket's jump and preplan consult them) and, with ``state_file=``, in the
state file beside the plans (:class:`~oomguard._guard.persist.PlanStore`, bounded as the plans are), written
with the next save of the plans.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from oomguard._guard.persist import PlanStore
from oomguard._ladder.plan import Plan
from oomguard._options import GuardOptions
from oomguard._planner.report import PlanReport

__all__ = ["Answer", "Answers", "batch_signature"]

#: Optimizer options that change what its state holds (the others, a learning rate say, change no byte).
_SHAPING = ("amsgrad", "foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay")


@dataclass(frozen=True)
class Answer:
    """A dry run's answer, and the room over which it holds (see the module). ``need``: the device bytes its plan
    needs (its peak and the device's overhead; 0 where none fits); ``ceiling``: the least that a plan it found too
    large needs (None: it found none). ``host_need`` and ``host_ceiling``: the same on the host. ``fake_steps``
    and ``seconds``: what the dry run cost."""

    plan: Plan | None
    need: int
    ceiling: int | None
    host_need: int
    host_ceiling: int | None
    fake_steps: int
    seconds: float

    @classmethod
    def of(cls, report: PlanReport) -> Answer:
        """The answer of ``report``, with the room its measurements say it holds over."""
        candidates, chosen = report.candidates, report.chosen if report.recommended is not None else None
        too_large = [c.peak_bytes + c.device_overhead_bytes for c in candidates if c.phase is not None]
        host_short = [c.host_bytes for c in candidates if not c.host_fits]
        return cls(
            report.recommended,
            0 if chosen is None else chosen.peak_bytes + chosen.device_overhead_bytes,
            min(too_large, default=None),
            0 if chosen is None else chosen.host_bytes,
            min(host_short, default=None),
            report.fake_steps,
            report.seconds,
        )

    def holds(self, capacity: int, host_budget: int | None) -> bool:
        """Whether the answer holds for ``capacity`` bytes free for the model and ``host_budget`` (None:
        unlimited, where it holds only if no plan was short of host memory when it was planned)."""
        device = self.need <= capacity and (self.ceiling is None or capacity < self.ceiling)
        if host_budget is None:
            return device and self.host_ceiling is None
        host = self.host_need <= host_budget and (self.host_ceiling is None or host_budget < self.host_ceiling)
        return device and host

    def to_dict(self) -> dict[str, Any]:
        """As the state file keeps it: plain values, the plan flat (None where none fits)."""
        return {
            "plan": None if self.plan is None else self.plan.to_dict(),
            "need": self.need,
            "ceiling": self.ceiling,
            "host_need": self.host_need,
            "host_ceiling": self.host_ceiling,
            "fake_steps": self.fake_steps,
            "planning_seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Answer:
        """Read back what :meth:`to_dict` wrote; raises ``KeyError``, ``TypeError`` or ``ValueError`` where it
        cannot (a hand edit, another version's entry)."""
        plan = data["plan"]
        bytes_ = [data[name] for name in ("need", "ceiling", "host_need", "host_ceiling")]
        if not all(value is None or (isinstance(value, int) and not isinstance(value, bool)) for value in bytes_):
            raise TypeError("byte counts that are not whole numbers")
        if bytes_[0] is None or bytes_[2] is None:
            raise ValueError("no need given")
        seconds = float(data.get("planning_seconds", 0.0))
        return cls(
            None if plan is None else Plan.from_dict(plan),
            bytes_[0],
            bytes_[1],
            bytes_[2],
            bytes_[3],
            int(data.get("fake_steps", 0)),
            seconds if math.isfinite(seconds) else 0.0,
        )


def batch_signature(batch: Any) -> str:
    """The batch's structure, and each tensor's shape and dtype (a plain value's type and value): what a dry run
    of it sees, whose values are fake. A mapping, list or tuple torch's pytree takes for a leaf (a tokenizer's
    ``BatchEncoding``, a ``UserDict``) is walked inside as the dry run fakes it
    (:func:`~oomguard._step.batch.map_tensors`)."""
    leaves, spec = tree_flatten(batch)
    parts = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{leaf.dtype}{tuple(leaf.shape)}")
        elif isinstance(leaf, Mapping):
            parts.append(f"{type(leaf).__qualname__}{{{batch_signature(dict(leaf))}}}")
        elif isinstance(leaf, (list, tuple)):
            parts.append(f"{type(leaf).__qualname__}[{batch_signature(list(leaf))}]")
        elif isinstance(leaf, (bool, int, float, str, type(None))):
            parts.append(f"{type(leaf).__name__}:{leaf!r}"[:100])
        else:
            parts.append(type(leaf).__qualname__)
    return ";".join(parts)


class Answers:
    """The answers this guard's dry runs gave (and those its state file recorded), by key (see the module)."""

    def __init__(self, options: GuardOptions, bf16: bool) -> None:
        self.options, self.bf16 = options, bf16
        self.prefix = ""  # the model's fingerprint and the device's identity, set at the first call
        self.store: PlanStore | None = None
        self._known: dict[str, Answer] = {}

    def start(self, prefix: str, store: PlanStore | None) -> None:
        """At the first call: the model and device (``prefix``), and the state file's answers for them, if any
        (an entry that cannot be read is left out: the guard plans that batch again)."""
        self.prefix, self.store = prefix, store
        for key, data in ({} if store is None else store.answers).items():
            try:
                self._known.setdefault(key, Answer.from_dict(data))
            except (KeyError, TypeError, ValueError):
                continue

    def key(self, batch: Any) -> str:
        """What an answer for ``batch`` depends on besides the room (see the module), as one key."""
        optimizer = self.options.optimizer
        inner = getattr(optimizer, "optimizer", None)  # (a wrapper's, Accelerate's say: the one it steps)
        optimizer = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
        groups = [
            (len(group["params"]), sorted((k, v) for k, v in group.items() if k in _SHAPING))
            for group in optimizer.param_groups
        ]
        rungs = [(rung.name, type(rung).__qualname__) for rung in self.options.rungs.rungs]
        text = repr((type(optimizer).__qualname__, groups, rungs, self.options.max_grad_norm, self.bf16))
        digest = hashlib.sha256(f"{text}|{batch_signature(batch)}".encode()).hexdigest()[:16]
        return f"{self.prefix}{digest}"

    def get(self, batch: Any, capacity: int | None, host_budget: int | None) -> Answer | None:
        """The recorded answer for ``batch`` that holds for this room; None where there is none."""
        answer = self._known.get(self.key(batch))
        if answer is None or capacity is None or not answer.holds(capacity, host_budget):
            return None
        return answer

    def put(self, batch: Any, report: PlanReport) -> None:
        """Record the answer of a dry run of ``batch`` (kept in the state file from its next save)."""
        key, answer = self.key(batch), Answer.of(report)
        self._known[key] = answer
        if self.store is not None:
            self.store.answers[key] = answer.to_dict()
