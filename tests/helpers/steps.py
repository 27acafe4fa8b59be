"""Step functions for the guard, and whole training runs, guarded or not, to compare."""

from __future__ import annotations

from typing import Any

import torch

from oomguard.testing import SimulatedGPU

# The default ladder before optimizer_offload joined it: for tests of what other rungs, the journal or the
# agreement do after an optimizer-phase OOM (optimizer_offload would answer it first, and step on the host).
LADDER_WITHOUT_OPTIMIZER_OFFLOAD = ["micro_batch", "amp", "checkpointing", "activation_offload", "layer_offload"]


def mse_step(model: torch.nn.Module):  # type: ignore[no-untyped-def]
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)

    return step


def train_unguarded(model: torch.nn.Module, batches: list[Any], lr: float = 1e-3) -> torch.nn.Module:
    """``model`` (a transformers LM) trained on ``batches`` with AdamW, no guard: the reference runs compare to."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def train_on(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    plan: Any = None,
    budget: int | str = "1GiB",
    ladder: list[str] | None = None,
) -> tuple[Any, list[Any], int]:
    """Train ``model`` (a transformers LM) on ``batches``, guarded, under a SimulatedGPU of ``budget``: on ``plan``
    with no ladder, or from the plain plan down ``ladder``; no tuning. The guard, each step's StepResult and the
    last step's peak."""
    from oomguard import OOMGuard

    guard = OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer,
                     ladder=[] if ladder is None else ladder, tune_after=None)  # fmt: skip
    if plan is not None:
        guard.plan = plan
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        results = []
        for batch in batches:
            gpu.reset_peak_memory_stats()
            results.append(guard(batch))
        peak = gpu.max_memory_allocated()
    return guard, results, peak


def model_step(model: torch.nn.Module) -> Any:
    return lambda batch: model(**batch)


def forward_backward_peak(gpu: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """The peak over what is resident of one forward and backward on ``gpu`` (simulated or the planner's)."""
    gpu.adopt(model, batch.values())
    base = gpu.memory_allocated()
    gpu.reset_peak_memory_stats()
    model(**batch).loss.backward()
    return int(gpu.max_memory_allocated() - base)
