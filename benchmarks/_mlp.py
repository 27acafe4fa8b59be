"""Issue 27's benchmark model: an MLP of bias-free square linear layers, guarded on a forced plan."""

from __future__ import annotations

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
