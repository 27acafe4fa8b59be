"""The ``quantized_weights`` rung's effect: frozen linear weights in 8 or 4 bits on the device, the exact originals
on the host.

For models whose frozen parameters dominate (a PEFT LoRA job: the base model is frozen, the adapters train), each
frozen ``nn.Linear`` weight on the device is kept as int8 codes with one fp32 scale per output channel
(symmetric, weight-only: ``weight ~ codes * scale``), about a quarter of its fp32 size; one level deeper, as
4-bit codes of the 16 NF4 levels (quantiles of a normal distribution, as QLoRA stores its base model, one exact
zero among them) with one fp32 absolute maximum per 64 values, 0.56 bytes a value, two codes to a byte. The
layer's forward dequantizes it for the product and its backward dequantizes it again, so no full-precision copy
outlives the operation (a plain linear layer would keep its weight for backward). Trainable parameters are never
quantized; weights shared with another module (tied embeddings) and weights of fewer than 1,024 values are left
as they are. The exact original of each weight is kept in host memory: undo (relaxing, ``guard.close()``, giving up)
puts it back bit for bit, ``model.state_dict()`` gives it, and ``load_state_dict`` writes it (and quantizes the
layer again).

The weight's parameter keeps its shape and dtype with its device storage freed (resized to zero, as layer
offload does): code that reads a quantized weight's values while the rung is engaged gets an error, not stale
numbers. Layer offload ends the rung (an offloaded block's weights go to the host whole).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from oomguard._backends.memory import MemoryBackend, current_backend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._ladder.plan import Plan

__all__ = ["QuantizedWeightsEffect", "frozen_linears"]

MIN_VALUES = 1024
GROUP = 64  # values per scale in 4 bits


def frozen_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` layers whose weight the rung may quantize: frozen, floating point, not shared with
    another module, at least 1,024 values."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
        and not module.weight.requires_grad
        and module.weight.is_floating_point()
        and module.weight.numel() >= MIN_VALUES
        and uses.get(id(module.weight)) == 1
    ]


@dataclass(eq=False)
class _Layer:
    module: torch.nn.Linear
    host: torch.Tensor  # the exact original weight, in host memory
    codes: torch.Tensor  # on the device: int8 (one per value), or uint8 (two 4-bit codes)
    scales: torch.Tensor  # fp32, on the device: one per output channel (8 bits), per 64 values (4 bits)
    table: torch.Tensor | None  # 4 bits: each byte's two values, on the device (see _encode); None in 8 bits
    hooks: list[RemovableHandle] = field(default_factory=list)
    reloading: bool = False  # a load_state_dict is writing its weight

    @property
    def bits(self) -> int:
        return 8 if self.table is None else 4

    def saving(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
        """``state_dict()`` (of this layer or any module above it) gives the exact original (a host copy)."""
        if prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = self.host.clone()

    def loading(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A weight ``load_state_dict`` writes gets its device storage back for the copy (quantized again after)."""
        if prefix + "weight" in state_dict:
            weight = self.module.weight
            current_backend(weight.device).resize_storage(weight, self.host.numel() * self.host.element_size())
            self.reloading = True

    def loaded(self, module: torch.nn.Module, incompatible: Any) -> None:
        if not self.reloading:
            return
        self.reloading = False
        weight = self.module.weight.detach()
        backend = current_backend(weight.device)
        self.codes, self.scales, self.table = _encode(weight, self.bits)
        self.host = backend.to_host(weight, self.host)
        backend.synchronize()
        backend.resize_storage(self.module.weight, 0)


class QuantizedWeightsEffect(Effect):
    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._layers: dict[int, _Layer] = {}  # id(module) -> its quantized weight

    @property
    def holds(self) -> bool:
        return bool(self._layers)

    def before_apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Every weight back where ``plan`` has none quantized, before layer offload may take a block whole."""
        if plan.quantized_weights or not self._layers:
            return False
        self.close()
        return True

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        if not plan.quantized_weights:
            return False
        bits = 4 if plan.quantized_weights == "4bit" else 8
        changed = False
        for module in frozen_linears(self.target.model):  # one layer at a time: an OOM part-way leaves whole layers
            layer = self._layers.get(id(module))
            if layer is not None and layer.bits != bits:  # to the other width, from the exact original
                self._restore(layer)
                layer, changed = None, True
            if layer is None and backend.is_device(module.weight):
                self._quantize(module, backend, bits)
                changed = True
        return changed

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        return self._plain_forwards() if self._layers else None

    @contextlib.contextmanager
    def _plain_forwards(self) -> Iterator[None]:
        """Each quantized layer's own forward for a while (the planner fakes its weight in its shape and dtype)."""
        forwards = {id(layer.module): vars(layer.module).pop("forward", None) for layer in self._layers.values()}
        try:
            yield
        finally:
            for layer in self._layers.values():
                forward = forwards.get(id(layer.module))
                if forward is not None:
                    layer.module.forward = forward  # type: ignore[method-assign]

    def _quantize(self, module: torch.nn.Linear, backend: MemoryBackend, bits: int) -> None:
        weight = module.weight
        encoded = _encode(weight.detach(), bits)  # (may run out of memory: the layer is then left as it was)
        host = backend.to_host(weight.detach())
        backend.synchronize()  # the host copy has landed before the device memory is let go
        backend.resize_storage(weight, 0)
        layer = self._layers[id(module)] = _Layer(module, host, *encoded)
        module.forward = types.MethodType(functools.partial(_forward, layer=layer), module)  # type: ignore[method-assign]
        layer.hooks = [  # (partials: torch marks the hook it is given, which a bound method cannot take)
            module.register_state_dict_post_hook(functools.partial(layer.saving)),  # type: ignore[no-untyped-call]
            module.register_load_state_dict_pre_hook(functools.partial(layer.loading)),  # type: ignore[no-untyped-call]
            module.register_load_state_dict_post_hook(functools.partial(layer.loaded)),  # type: ignore[no-untyped-call]
        ]

    def _restore(self, layer: _Layer) -> None:
        weight = layer.module.weight
        backend = current_backend(weight.device)  # (the one in use now: a guard may be closed outside a simulator)
        backend.resize_storage(weight, layer.host.numel() * layer.host.element_size())  # (may run out of memory)
        backend.upload(weight.data, layer.host)
        del layer.module.forward
        for hook in layer.hooks:
            hook.remove()
        del self._layers[id(layer.module)]

    def close(self) -> None:
        """Every original weight back on the device, bit for bit (may run out of memory: the rest stay
        quantized, the rung still engaged)."""
        for layer in list(self._layers.values()):
            self._restore(layer)


def nf4_levels() -> list[float]:
    """The 16 NF4 levels, ascending, in [-1, 1]: quantiles of a normal distribution, 8 positive and 7 negative
    with an exact zero between them (QLoRA's construction: equal-probability bins of N(0, 1), the outermost
    quantile taken at 0.9677 rather than at 1, where it is infinite), scaled so that the extremes are -1 and 1.

    >>> levels = nf4_levels()
    >>> len(levels), levels[0], levels[7], levels[-1]
    (16, -1.0, 0.0, 1.0)
    """
    outermost = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))  # halfway between the two halves' outermost bin centres
    positive = torch.special.ndtri(torch.linspace(outermost, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(outermost, 0.5, 8, dtype=torch.float64)[:-1])
    return sorted([*(negative / positive.max()).tolist(), 0.0, *(positive / positive.max()).tolist()])


_LEVELS = nf4_levels()
_BOUNDS = [(low + high) / 2 for low, high in itertools.pairwise(_LEVELS)]  # nearest level's edges


def _encode(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``weight``'s codes, scales and (4 bits) the table that decodes a byte of codes; see :func:`_decode`.

    8 bits: symmetric int8 codes with one fp32 scale per output channel (row). 4 bits: each run of 64 values
    (the weight read row after row, zero-padded to whole runs) divided by its absolute maximum and stored as the
    index of the nearest NF4 level, two to a byte (the first in the low half).
    """
    if bits == 8:
        scales = weight.float().abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        return (weight.float() / scales).round_().clamp_(-127, 127).to(torch.int8), scales, None
    values = weight.detach().float().reshape(-1)
    groups = torch.nn.functional.pad(values, (0, -values.numel() % GROUP)).view(-1, GROUP)
    scales = groups.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=weight.device)
    index = torch.bucketize(groups / scales, bounds, out_int32=True).to(torch.uint8)
    codes = index[:, 0::2] | (index[:, 1::2] << 4)
    del index
    levels = torch.tensor(_LEVELS, dtype=torch.float32, device=weight.device)
    table = torch.stack((levels.repeat(16), levels.repeat_interleave(16)), dim=1)  # byte b: (low half, high half)
    return codes, scales, table


def _decode(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """The fp32 weight of ``shape`` from its codes (see :func:`_encode`)."""
    if table is None:
        return codes * scales
    pairs = table.index_select(0, codes.view(-1).int())  # (faster than indexing with a tensor)
    values = pairs.view(scales.shape[0], GROUP).mul_(scales).view(-1)  # (in place: one fp32 copy)
    return values[: shape.numel()].view(shape)


def _forward(module: torch.nn.Linear, x: torch.Tensor, *, layer: _Layer) -> torch.Tensor:
    weight = module.weight  # (its storage freed: its shape and dtype)
    output: torch.Tensor = _QuantizedLinear.apply(  # type: ignore[no-untyped-call]
        x, layer.codes, layer.scales, layer.table, module.bias, weight.shape, weight.dtype
    )
    return output


class _QuantizedLinear(torch.autograd.Function):
    """``F.linear`` with the weight dequantized for the product, in forward and again in backward: autograd keeps
    the 8- or 4-bit codes, not a full-precision weight."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor | None,
        bias: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(codes, scales, table)
        ctx.shape, ctx.x_dtype, ctx.bias_dtype = shape, x.dtype, None if bias is None else bias.dtype
        return torch.nn.functional.linear(x, _decode(codes, scales, table, shape).to(dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        codes, scales, table = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(_decode(codes, scales, table, ctx.shape).to(grad.dtype)).to(ctx.x_dtype)
        grad_bias = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, None, grad_bias, None, None
