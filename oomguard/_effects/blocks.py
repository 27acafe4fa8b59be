"""Finding a model's repeated blocks: the unit that checkpointing and layer offload work on.

For a transformers model these are its decoder layers; for any other model, the largest ``nn.ModuleList`` (or
``nn.Sequential``) whose children all have the same type, by parameter count.
"""

from __future__ import annotations

import torch

__all__ = ["find_blocks", "is_transformers_model"]


def is_transformers_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` that supports activation checkpointing."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and hasattr(model, "config")


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: torch.nn.Module, least: int = 2) -> list[torch.nn.Module]:
    """The model's repeated blocks, in order; empty if it has none (fewer than ``least`` same-typed children: a
    transformers model with one decoder layer has its layer list of one, any other model its largest module).

    >>> mlp = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    >>> len(find_blocks(mlp))
    3
    """
    best: list[torch.nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < least or len({type(child) for child in children}) != 1:
            continue
        size = sum(_param_count(child) for child in children)
        if size > best_size:
            best, best_size = children, size
    return best
