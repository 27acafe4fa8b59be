"""LoRA for the planner: freeze a model and add low-rank adapters, as a PEFT LoRA job does, on fake tensors.

PEFT itself cannot wrap a model made of fake tensors (moving its adapters to the base layer's device swaps
fake parameters, which torch refuses), so the planner adds its own: each adapted layer keeps its frozen base
module and gains ``A`` (rank x in) and ``B`` (out x rank), trainable, with ``base(x) + B(A(dropout(x))) *
alpha / rank`` as its output: PEFT's ``lora.Linear`` computation, so the same tensors are allocated and saved.
Everything else (embeddings, norms, the output head) is frozen. The adapters are fp32 whatever the base's dtype, as
PEFT makes them (``autocast_adapter_dtype``): over a bf16 or NF4 base, the input is cast to fp32 for them and the sum
cast back to the base's output dtype, as ``lora.Linear`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oomguard._planner.nf4 import NF4Linear, linear_sides

__all__ = ["ALL_LINEAR", "add_lora"]

#: The targets that adapt every linear layer but the output head (QLoRA's choice; PEFT's ``"all-linear"``).
ALL_LINEAR = "all-linear"


class LoRALayer(torch.nn.Module):
    """A frozen linear layer (``nn.Linear``, transformers' ``Conv1D`` or an :class:`NF4Linear`) with a trainable
    low-rank adapter (fp32: see the module's docstring)."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        features_out, features_in = linear_sides(base)
        self.base = base
        self.lora_a = torch.nn.Linear(features_in, rank, bias=False, dtype=torch.float32)
        self.lora_b = torch.nn.Linear(rank, features_out, bias=False, dtype=torch.float32)
        torch.nn.init.zeros_(self.lora_b.weight)
        self.dropout = torch.nn.Dropout(dropout)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.base(x)
        # (both casts return their input where the dtypes agree: an fp32 base)
        update: torch.Tensor = self.lora_b(self.lora_a(self.dropout(x.to(self.lora_a.weight.dtype))))
        adapted = result + update * self.scaling
        return adapted.to(dtype=result.dtype)


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
    narrowest, side = min(((name, min(linear_sides(module))) for name, module in chosen), key=lambda item: item[1])
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
    """A layer LoRA adapts: ``nn.Linear``, transformers' ``Conv1D`` (GPT-2's projections), or an NF4 one."""
    return isinstance(module, torch.nn.Linear | NF4Linear) or (
        type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None
    )
