"""The ``quantized_weights`` rung's effect: frozen linear weights in 8 bits on the device, the exact originals on
the host.

For models whose frozen parameters dominate (a PEFT LoRA job: the base model is frozen, the adapters train), each
frozen ``nn.Linear`` weight on the device is kept as int8 codes with one fp32 scale per output channel
(symmetric, weight-only: ``weight ~ codes * scale``), about a quarter of its fp32 size. The layer's forward
dequantizes it for the product and its backward dequantizes it again, so no full-precision copy outlives the
operation (a plain linear layer would keep its weight for backward). Trainable parameters are never quantized;
weights shared with another module (tied embeddings) and weights of fewer than 1,024 values are left as they
are. The exact original of each weight is kept in host memory: undo (relaxing, ``guard.close()``, giving up)
puts it back bit for bit, ``model.state_dict()`` gives it, and ``load_state_dict`` writes it (and quantizes the
layer again).

The weight's parameter keeps its shape and dtype with its device storage freed (resized to zero, as layer
offload does): code that reads a quantized weight's values while the rung is engaged gets an error, not stale
numbers. Layer offload ends the rung (an offloaded block's weights go to the host whole).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from oomguard._backends.memory import MemoryBackend, current_backend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._ladder.plan import Plan

__all__ = ["QuantizedWeightsEffect", "frozen_linears"]

MIN_VALUES = 1024


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
    codes: torch.Tensor  # int8, on the device
    scales: torch.Tensor  # fp32, one per output channel, on the device
    hooks: list[RemovableHandle] = field(default_factory=list)
    reloading: bool = False  # a load_state_dict is writing its weight

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
        self.codes, self.scales = _codes(weight)
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
        changed = False
        for module in frozen_linears(self.target.model):  # one layer at a time: an OOM part-way leaves whole layers
            if id(module) not in self._layers and backend.is_device(module.weight):
                self._quantize(module, backend)
                changed = True
        return changed

    def _quantize(self, module: torch.nn.Linear, backend: MemoryBackend) -> None:
        weight = module.weight
        codes, scales = _codes(weight.detach())  # (may run out of memory: the layer is then left as it was)
        host = backend.to_host(weight.detach())
        backend.synchronize()  # the host copy has landed before the device memory is let go
        backend.resize_storage(weight, 0)
        layer = self._layers[id(module)] = _Layer(module, host, codes, scales)
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


def _codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``weight`` with one fp32 scale per output channel (row)."""
    scales = weight.float().abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    codes = (weight.float() / scales).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scales


def _forward(module: torch.nn.Linear, x: torch.Tensor, *, layer: _Layer) -> torch.Tensor:
    output: torch.Tensor = _QuantizedLinear.apply(  # type: ignore[no-untyped-call]
        x, layer.codes, layer.scales, module.bias, module.weight.dtype
    )
    return output


class _QuantizedLinear(torch.autograd.Function):
    """``F.linear`` with the weight dequantized for the product, in forward and again in backward: autograd keeps
    the 8-bit codes, not a full-precision weight."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(codes, scales)
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return torch.nn.functional.linear(x, (codes * scales).to(dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        codes, scales = ctx.saved_tensors
        grad_x = grad.matmul((codes * scales).to(grad.dtype)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None
