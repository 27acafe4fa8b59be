"""Optimizers that remember what they were stepped with."""

from __future__ import annotations

import torch


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it was stepped with, to compare accumulation exactly."""

    def __init__(self, params, lr: float = 0.1) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor | None]] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        self.seen.append(
            [None if p.grad is None else p.grad.detach().clone() for g in self.param_groups for p in g["params"]]
        )
        return super().step(closure)
