"""Issue 27's benchmark model: an MLP of bias-free square linear layers, guarded on a forced plan."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from oomguard import OOMGuard, Plan


def guarded_mlp(plan: Plan, width: int, layers: int, **options: Any) -> tuple[OOMGuard, torch.nn.Module]:
    """A fresh MLP of ``layers`` bias-free ``width`` x ``width`` layers (seeded), AdamW (lr 1e-3) as a user would
    configure it, and a guard on ``plan`` with no ladder (the plan is what is measured) and ``options``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    guard = OOMGuard(step, model=model, optimizer=optimizer, ladder=[], **options)
    guard.plan = plan
    return guard, model


def interleaved(guards: dict[str, OOMGuard], batch: Any, rounds: int) -> dict[str, list[float]]:
    """Each guard's call times: 3 warm-up calls each (the plan applied, the state made, the first step journaled),
    then ``rounds`` rounds of one call each, in alternating order (the machine's drift moves them alike)."""
    for guard in guards.values():
        for _ in range(3):
            guard(batch)
    seconds: dict[str, list[float]] = {name: [] for name in guards}
    for index in range(rounds):
        for name in list(guards) if index % 2 == 0 else list(reversed(guards)):
            started = time.perf_counter()
            guards[name](batch)
            seconds[name].append(time.perf_counter() - started)
    return seconds


def ratio(seconds: dict[str, list[float]], mine: str, theirs: str) -> dict[str, Any]:
    """The median time of each, the median of the per-round ratios (``mine`` / ``theirs``) and their range."""
    ratios = [a / b for a, b in zip(seconds[mine], seconds[theirs], strict=True)]
    return {
        f"{mine}_seconds": statistics.median(seconds[mine]),
        f"{theirs}_seconds": statistics.median(seconds[theirs]),
        "median_ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }


def report(result: dict[str, Any], path: Path | None) -> int:
    """``result`` printed a line a figure, and written as JSON to ``path`` where given; the exit status."""
    for key, value in result.items():
        print(f"{key}: {value}")
    if path is not None:
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0
