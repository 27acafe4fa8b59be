"""LoRA for the planner: freeze a model and add low-rank adapters, as a PEFT LoRA job does, on fake tensors.

PEFT itself cannot wrap a model made of fake tensors (moving its adapters to the base layer's device swaps
fake parameters, which torch refuses), so the planner adds its own: each adapted layer keeps its frozen base
module and gains ``A`` (rank x in) and ``B`` (out x rank), trainable, with ``base(x) + B(A(dropout(x))) *
alpha / rank`` as its output: PEFT's ``lora.Linear`` computation, so the same tensors are allocated and saved.
Everything else (embeddings, norms, the output head) is frozen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ALL_LINEAR", "add_lora"]

#: The targets that adapt every linear layer but the output head (QLoRA's choice; PEFT's ``"all-linear"``).
ALL_LINEAR = "all-linear"


class LoRALayer(torch.nn.Module):
    """A frozen linear layer (``nn.Linear`` or transformers' ``Conv1D``) with a trainable low-rank adapter."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        weight = base.weight
        assert isinstance(weight, torch.Tensor)
        # Conv1D (GPT-2) stores its weight as (in, out), nn.Linear as (out, in)
        features_in, features_out = weight.shape[::-1] if isinstance(base, torch.nn.Linear) else weight.shape
        self.base = base
        self.lora_a = torch.nn.Linear(features_in, rank, bias=False, dtype=weight.dtype)
        self.lora_b = torch.nn.Linear(rank, features_out, bias=False, dtype=weight.dtype)
        torch.nn.init.zeros_(self.lora_b.weight)
        self.dropout = torch.nn.Dropout(dropout)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapted: torch.Tensor = self.base(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scaling
        return adapted


def add_lora(
    model: torch.nn.Module,
    rank: int,
    targets: str | Sequence[str] = ALL_LINEAR,
    *,
    alpha: float | None = None,
    dropout: float = 0.05,
) -> int:
    """Freeze ``model`` and adapt its ``targets`` with rank-``rank`` LoRA adapters, in place; returns how many
    layers were adapted.

    ``targets`` is ``"all-linear"`` (every linear layer but the output head) or the names of the layers to adapt
    as PEFT's ``target_modules`` lists them (the last part of a module's name: ``["q_proj", "v_proj"]``).
    ``alpha`` defaults to ``2 * rank``. Raises ``ValueError`` when no layer of the model matches ``targets``.

    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> add_lora(net, 2, ["0"]), [n for n, p in net.named_parameters() if p.requires_grad]
    (1, ['0.lora_a.weight', '0.lora_b.weight'])
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"the LoRA rank must be a positive int, got {rank!r}")
    names = None if targets == ALL_LINEAR else {targets} if isinstance(targets, str) else set(targets)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if _linear(module) and module is not head and (names is None or name.rsplit(".", 1)[-1] in names)
    ]
    if not chosen:
        wanted = "no linear layer but the output head" if names is None else f"no layer named {sorted(names)}"
        raise ValueError(f"LoRA: the model has {wanted}; name its attention or MLP projections as targets")
    narrowest, side = min(((name, min(module.weight.shape)) for name, module in chosen), key=lambda item: item[1])
    if rank > side:  # (an adapter of rank min(in, out) is already full rank: more only adds parameters)
        raise ValueError(
            f"the LoRA rank {rank} is larger than the layer {narrowest} it adapts allows ({side}, the smaller side "
            f"of its weight); choose a rank of at most {side}"
        )
    model.requires_grad_(False)
    for name, module in chosen:
        parent, _, leaf = name.rpartition(".")
        layer = LoRALayer(module, rank, float(alpha if alpha is not None else 2 * rank), dropout)
        setattr(model.get_submodule(parent), leaf, layer)
    return len(chosen)


def _linear(module: torch.nn.Module) -> bool:
    """A layer LoRA adapts: ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2's projections)."""
    return isinstance(module, torch.nn.Linear) or (
        type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None
    )
