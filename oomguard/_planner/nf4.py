"""A LoRA base loaded in NF4 for the planner: what bitsandbytes holds and computes, on fake tensors, without it.

bitsandbytes cannot build its ``Params4bit`` under ``FakeTensorMode`` (it quantizes real values on the first move),
so the planner models a QLoRA base analytically: every linear layer but the output head becomes an
:class:`NF4Linear` holding the tensors bitsandbytes 0.50 keeps for a weight of ``n`` elements quantized as
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`` does:

- the 4-bit codes, two a byte: ``(n + 1) // 2`` bytes (uint8, ``[(n + 1) // 2, 1]``);
- an absmax per block of 64 weights, itself quantized (``compress_statistics``, nested): one uint8 code a block,
  an fp32 absmax per 256 of those codes, their 256-entry fp32 code table and an fp32 offset (their mean);
- the 16-entry fp32 NF4 code table.

About 0.516 bytes a weight (:func:`nf4_bytes`). Its compute is bitsandbytes' ``MatMul4Bit``: the forward is one fused
kernel that reads the codes (no dequantized weight); the backward dequantizes the weight (the fp32 absmax of every
block, then the weight in the dtype it was quantized from) for the input's gradient, and frees it. Nothing larger
than the codes is saved for backward. ``tests/test_planner.py`` checks the bytes against a real ``Params4bit``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BLOCK", "NESTED_BLOCK", "NF4Linear", "linear_sides", "nf4_bytes", "quantize_linears"]

#: Weights per absmax (bitsandbytes' default 4-bit blocksize).
BLOCK = 64
#: Absmax codes per fp32 absmax of the nested statistics (bitsandbytes' ``state2``, fixed at 256).
NESTED_BLOCK = 256
_NF4_CODES = 16  # the NF4 code table: 16 fp32 values
_NESTED_CODES = 256  # the nested statistics' 8-bit dynamic code table: 256 fp32 values


def nf4_bytes(elements: int) -> int:
    """The bytes bitsandbytes holds for a weight of ``elements`` quantized to NF4 with nested statistics.

    >>> nf4_bytes(2048 * 2048)  # 0.516 bytes a weight
    2164804
    """
    blocks = -(-elements // BLOCK)
    return (elements + 1) // 2 + blocks + 4 * -(-blocks // NESTED_BLOCK) + 4 * (_NESTED_CODES + _NF4_CODES + 1)


class NF4Linear(torch.nn.Module):
    """A frozen linear layer (``nn.Linear``, or transformers' ``Conv1D``) stored in NF4 as bitsandbytes stores it,
    computing in ``dtype``, the dtype its weight was quantized from (see the module's docstring)."""

    def __init__(self, linear: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        weight = linear.weight
        assert isinstance(weight, torch.Tensor)
        self.out_features, self.in_features = linear_sides(linear)
        elements = self.in_features * self.out_features
        self.blocks = blocks = -(-elements // BLOCK)
        empty = weight.new_empty
        self.weight = torch.nn.Parameter(empty(((elements + 1) // 2, 1), dtype=torch.uint8), requires_grad=False)
        self.register_buffer("absmax", empty(blocks, dtype=torch.uint8))  # the blocks' absmax, 8-bit codes
        self.register_buffer("absmax_scale", empty(-(-blocks // NESTED_BLOCK), dtype=torch.float32))
        self.register_buffer("absmax_code", empty(_NESTED_CODES, dtype=torch.float32))
        self.register_buffer("absmax_offset", empty((), dtype=torch.float32))
        self.register_buffer("code", empty(_NF4_CODES, dtype=torch.float32))
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _MatMulNF4.apply(x, self.weight, self)  # type: ignore[no-untyped-call]
        return out if self.bias is None else out + self.bias.to(out.dtype)


class _MatMulNF4(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` as it allocates: see the module's docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, layer: NF4Linear) -> torch.Tensor:
        ctx.layer = layer
        # The fused kernel reads the codes: a weight of no bytes (expanded from one element) stands for them, so
        # that the output and the matrix FLOPs are those of the product.
        weight = x.new_zeros(()).expand(layer.out_features, layer.in_features)
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        layer: NF4Linear = ctx.layer
        absmax = grad.new_empty(layer.blocks, dtype=torch.float32)  # every block's absmax, dequantized
        weight = grad.new_empty((layer.out_features, layer.in_features), dtype=layer.dtype)
        del absmax
        return torch.matmul(grad, weight.to(grad.dtype)), None, None


def linear_sides(module: torch.nn.Module) -> tuple[int, int]:
    """A linear layer's (out, in) features: ``nn.Linear`` stores its weight as (out, in), transformers' ``Conv1D``
    (GPT-2's projections) as (in, out)."""
    if isinstance(module, NF4Linear):
        return module.out_features, module.in_features
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    rows, columns = weight.shape
    return (rows, columns) if isinstance(module, torch.nn.Linear) else (columns, rows)


def quantize_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace every linear layer of ``model`` but its output head with an :class:`NF4Linear` computing in
    ``dtype``, as transformers loads a model in 4 bits (``lm_head`` is kept); returns how many were replaced."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if module is not head
        and (
            isinstance(module, torch.nn.Linear)
            or (type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None)
        )
    ]
    for name, module in chosen:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, NF4Linear(module, dtype))
    return len(chosen)
