"""The benchmark's scenarios: a small Llama, fixed data, and a SimulatedGPU budget calibrated from measured peaks.

Every contender trains the same initial weights on the same batches under the same budget. Each budget is set
between two peaks that the dry-run planner measures on fake tensors for this model and batch (the planner's
peaks match SimulatedGPU's accounting to within 5 %, most to the byte), so a scenario means what its title
says on any torch version: "4x too large" really is a batch whose largest fitting micro-batch is a quarter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import Plan
from oomguard.planner import dry_run
from oomguard.testing import DemoConfig, demo_model, format_bytes, stdlib_text, text_batches

__all__ = ["LR", "Batch", "Scenario", "ScenarioSpec", "build_scenario", "specs"]

Batch = dict[str, torch.Tensor]
LR = 1e-3  # AdamW, constant: every contender runs the same optimizer settings
_UNLIMITED = 2**40
_EVAL_SAMPLES = 16


@dataclass(frozen=True)
class ScenarioSpec:
    """Sizes of one scenario. ``long_at`` is the (1-based) step of the one long batch, if any."""

    key: str
    title: str
    hidden: int
    layers: int
    batch_size: int
    seq_len: int
    steps: int
    long_at: int | None = None
    long_factor: int = 4

    @property
    def max_len(self) -> int:
        return self.seq_len * (self.long_factor if self.long_at else 1)

    def describe(self) -> str:
        shape = f"{self.batch_size} x {self.seq_len} tokens"
        if self.long_at:
            shape += f", one {self.batch_size} x {self.max_len} batch at step {self.long_at}"
        return f"Llama {self.hidden} x {self.layers} layers; {shape}; {self.steps} steps"


def specs(quick: bool) -> list[ScenarioSpec]:
    """The five scenarios, in full size or (``quick``) shrunk to run in seconds."""
    if quick:
        return [
            ScenarioSpec("4x", "batch 4x too large", 32, 1, 8, 32, 3),
            ScenarioSpec("40x", "batch 40x too large", 32, 1, 40, 16, 2),
            ScenarioSpec("long", "rare long batch", 32, 1, 4, 16, 3, long_at=2),
            ScenarioSpec("fp32", "batch 1 does not fit in fp32", 32, 1, 2, 512, 2),
            ScenarioSpec("weights", "weights + Adam state exceed the budget", 128, 2, 2, 16, 2),
        ]
    return [
        ScenarioSpec("4x", "batch 4x too large", 64, 2, 16, 128, 8),
        ScenarioSpec("40x", "batch 40x too large", 64, 2, 40, 64, 6),
        ScenarioSpec("long", "rare long batch", 64, 2, 8, 64, 12, long_at=4),
        ScenarioSpec("fp32", "batch 1 does not fit in fp32", 64, 2, 4, 1024, 6),
        ScenarioSpec("weights", "weights + Adam state exceed the budget", 256, 4, 4, 32, 6),
    ]


@dataclass
class Scenario:
    """A scenario ready to run: the initial model, the batches, a held-out batch and the budget."""

    spec: ScenarioSpec
    template: torch.nn.Module
    batches: list[Batch]
    eval_batch: Batch
    capacity: int
    #: How the budget was set: the peaks it lies between (name -> bytes) and the rule, in words.
    peaks: dict[str, int] = field(default_factory=dict)
    rule: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.spec.key,
            "title": self.spec.title,
            "setup": self.spec.describe(),
            "batch_size": self.spec.batch_size,
            "parameters": sum(p.numel() for p in self.template.parameters()),
            "capacity_bytes": self.capacity,
            "calibration_peaks_bytes": self.peaks,
            "rule": self.rule,
        }


def model_config(spec: ScenarioSpec) -> DemoConfig:
    """The demo's Llama builder (byte tokens, vocabulary 256, random init, seed 0) at this scenario's size."""
    return DemoConfig(hidden_size=spec.hidden, layers=spec.layers, heads=4, seq_len=spec.max_len, seed=0)


@functools.cache
def _text() -> torch.Tensor:
    return stdlib_text()


def _batches(spec: ScenarioSpec) -> list[Batch]:
    short = text_batches(_text(), spec.batch_size, spec.seq_len, seed=1)
    long = text_batches(_text(), spec.batch_size, spec.max_len, seed=2)
    return [next(long) if step == spec.long_at else next(short) for step in range(1, spec.steps + 1)]


def build_scenario(spec: ScenarioSpec) -> Scenario:
    """Build the model and data of ``spec`` and calibrate its budget."""
    template = demo_model(model_config(spec))
    eval_batch = next(text_batches(_text(), _EVAL_SAMPLES, spec.seq_len, seed=99))
    capacity, peaks, rule = _CALIBRATIONS[spec.key](spec, template)
    return Scenario(spec, template, _batches(spec), eval_batch, capacity, peaks, rule)


def planned_peaks(spec: ScenarioSpec, samples: int, seq_len: int, plans: list[Plan]) -> list[int]:
    """Tensor peaks of one training step per plan, from the planner's dry run on fake tensors."""
    with FakeTensorMode():
        model = demo_model(model_config(spec))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        ids = torch.zeros((samples, seq_len), dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        report = dry_run(
            lambda b: model(**b), batch, model=model, optimizer=optimizer, capacity=_UNLIMITED,
            target="simulated", label=spec.key, plans=plans,
        )  # fmt: skip
    return [candidate.peak_bytes for candidate in report.candidates]


def _between(low_name: str, low: int, high_name: str, high: int) -> tuple[int, dict[str, int], str]:
    """A budget midway between a peak that must fit and one that must not."""
    if not low < high:
        raise RuntimeError(f"calibration failed: {low_name} ({low} B) should need less than {high_name} ({high} B)")
    rule = f"midway between {low_name} ({format_bytes(low)}, must fit) and {high_name} ({format_bytes(high)}, must not)"
    return (low + high) // 2, {low_name: low, high_name: high}, rule


def _micro_batches(spec: ScenarioSpec, fits: int, fails: int) -> tuple[int, dict[str, int], str]:
    low, high = planned_peaks(
        spec, spec.batch_size, spec.seq_len, [Plan(micro_batch_size=fits), Plan(micro_batch_size=fails)]
    )
    return _between(f"micro-batches of {fits}", low, f"micro-batches of {fails}", high)


def _four_times(spec: ScenarioSpec, template: torch.nn.Module) -> tuple[int, dict[str, int], str]:
    return _micro_batches(spec, spec.batch_size // 4, spec.batch_size // 2)


def _forty_times(spec: ScenarioSpec, template: torch.nn.Module) -> tuple[int, dict[str, int], str]:
    return _micro_batches(spec, 1, 2)


def _long_batch(spec: ScenarioSpec, template: torch.nn.Module) -> tuple[int, dict[str, int], str]:
    (short,) = planned_peaks(spec, spec.batch_size, spec.seq_len, [Plan()])
    (long,) = planned_peaks(spec, spec.batch_size, spec.max_len, [Plan()])
    return _between("the whole short batch", short, "the whole long batch", long)


def _fp32_floor(spec: ScenarioSpec, template: torch.nn.Module) -> tuple[int, dict[str, int], str]:
    fp32, bf16 = planned_peaks(
        spec, spec.batch_size, spec.seq_len, [Plan(micro_batch_size=1), Plan(micro_batch_size=1, precision="bf16")]
    )
    # A whole batch of one sample accumulates nothing, so it can need less than micro-batches of 1: neither fits.
    (single,) = planned_peaks(spec, 1, spec.seq_len, [Plan()])
    return _between("micro-batches of 1 in bf16", bf16, "one sample in fp32, alone or accumulated", min(fp32, single))


def _weights(spec: ScenarioSpec, template: torch.nn.Module) -> tuple[int, dict[str, int], str]:
    (offloaded,) = planned_peaks(spec, spec.batch_size, spec.seq_len, [Plan(offload_layers=spec.layers)])
    # Weights plus Adam's two moments, rounded per tensor as the device allocator rounds them.
    resident = 3 * sum(-(-p.numel() * p.element_size() // 512) * 512 for p in template.parameters())
    return _between(
        f"the whole batch with all {spec.layers} layers offloaded", offloaded, "weights + Adam state", resident
    )


_CALIBRATIONS = {
    "4x": _four_times,
    "40x": _forty_times,
    "long": _long_batch,
    "fp32": _fp32_floor,
    "weights": _weights,
}
