"""The ``quantized_weights`` rung's effect: frozen linear weights in 8 or 4 bits on the device, the exact originals
on the host.

For models whose frozen parameters dominate (a PEFT LoRA job: the base model is frozen, the adapters train), each
frozen ``nn.Linear`` weight on the device is kept as int8 codes with one fp32 scale per output channel, about a
quarter of its fp32 size; one level deeper, as 4-bit NF4 codes with one fp32 absolute maximum per 64 values,
0.56 bytes a value (:mod:`oomguard._effects.codec`). Trainable parameters are never quantized; weights shared
with another module (tied embeddings), weights of fewer than 1,024 values, weights that hold a gradient and, while
the plan has the chunked loss, the output head (:func:`chunked_head`) are left as they are. The exact original of
each weight is kept in host memory: undo (relaxing, ``guard.close()``, giving up) puts it back bit for bit,
``model.state_dict()`` gives it, and ``load_state_dict`` writes it (and the layer is quantized again).

The weight stays the same parameter object, the one the user's optimizer may hold (``AdamW(model.parameters())``
holds the frozen ones too): its contents are swapped (``torch.utils.swap_tensors``; a weight that cannot be, for
weak references to it or a C++ holder, is left whole). While quantized it is a
:class:`~oomguard._effects.qweight.QuantizedWeight`, a valid tensor that dequantizes
itself for any op that uses it (the layer's forward is not touched), and that autograd saves for backward as
the codes, so no full-precision copy waits between forward and backward. A layer whose weight the user unfreezes
is given back whole (its exact original, as the same object) before it is used, and the rung no longer
quantizes it. Layer offload ends the rung (an offloaded block's weights go to the host whole).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import cast

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.hooks import RemovableHandle

from oomguard._backends.memory import MemoryBackend, current_backend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._effects.chunked_loss import causal_lm
from oomguard._effects.codec import Codes
from oomguard._effects.qweight import QuantizedWeight, Store, exact_originals, user_attributes
from oomguard._ladder.plan import Plan

__all__ = ["QuantizedWeightsEffect", "chunked_head", "frozen_linears", "lm_head"]

MIN_VALUES = 1024


def frozen_linears(model: torch.nn.Module, besides: torch.nn.Module | None = None) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` layers whose weight the rung may quantize: frozen, floating point, not shared with
    another module, at least 1,024 values, holding no gradient; never ``besides`` (see :func:`chunked_head`)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
        and module is not besides
        and not module.weight.requires_grad
        and module.weight.is_floating_point()
        and module.weight.numel() >= MIN_VALUES
        and module.weight.grad is None
        and uses.get(id(module.weight)) == 1
    ]


def chunked_head(model: torch.nn.Module, plan: Plan) -> torch.nn.Module | None:
    """The output head the chunked_loss rung holds in ``plan``, which this rung leaves whole: the chunked loss
    reads the head's weight once per chunk, so a quantized head would be dequantized in full for every chunk (in
    the forward, and again for the input's gradient), and the rung's patch refuses a head whose weight is not a
    plain tensor. The head stays exact, the rest of the frozen weights are quantized as ever."""
    return lm_head(model) if plan.level("chunked_loss") else None


def lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output head the chunked_loss rung would patch (the causal LM's ``lm_head``), if the model has one."""
    target = causal_lm(model)
    head = None if target is None else getattr(target, "lm_head", None)
    return head if isinstance(head, torch.nn.Module) else None


@dataclass(eq=False)
class _Layer:
    module: torch.nn.Linear
    #: What the module holds now: the user's own parameter object, now quantized (``swapped``); or, for a fake
    #: tensor (the planner's, which fake mode holds weak references to and cannot be swapped), a stand-in.
    weight: QuantizedWeight
    #: The object that now holds the original tensor (its storage emptied): swapped back, refilled, on undo.
    original: torch.Tensor
    swapped: bool
    hook: RemovableHandle
    store: Store  # its codes and exact original (kept here: swapping back moves them off ``weight``)


class QuantizedWeightsEffect(Effect):
    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._layers: dict[int, _Layer] = {}  # id(module) -> its quantized weight

    @property
    def holds(self) -> bool:
        return bool(self._layers)

    @property
    def held(self) -> str:
        return f"{len(self._layers)} quantized frozen weight(s)"

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        """What the planner's dry run asks of an effect that holds the model: nothing needs to step aside here. No
        method is patched, and the planner's fakes replace each quantized weight in its module's parameter table,
        in the weight's shape and logical dtype."""
        return None

    def before_apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Every weight back where ``plan`` has none quantized, before layer offload may take a block whole; the
        head back where ``plan`` has the chunked loss, before its patch reads the head's weight."""
        if not self._layers:
            return False
        if not plan.quantized_weights:
            self.close()
            return True
        head = self._layers.get(id(chunked_head(self.target.model, plan)))
        if head is None:
            return False
        self._restore(head)
        return True

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        changed = self._let_go()
        if not plan.quantized_weights:
            return changed
        bits = 4 if plan.quantized_weights == "4bit" else 8
        besides = chunked_head(self.target.model, plan)  # (the chunked loss's, while the plan has it)
        for module in frozen_linears(self.target.model, besides):  # one at a time: an OOM part-way leaves whole layers
            layer = self._layers.get(id(module))
            if layer is not None:
                if layer.weight.bits != bits:  # to the other width, from the exact original
                    layer.store.recode(bits)
                    changed = True
            elif backend.is_device(module.weight) and not isinstance(module.weight, QuantizedWeight):
                changed = self._quantize(module, backend, bits) or changed
        return changed

    def _let_go(self) -> bool:
        """Layers the user has changed since: a weight unfrozen is given back whole (it trains, exactly); a weight
        converted (``model.half()``) is quantized again from its exact original, converted; a weight replaced
        (``module.weight = ...``, ``load_state_dict(assign=True)``) is no longer the rung's."""
        changed = False
        for layer in list(self._layers.values()):
            if not _held(layer):
                self._forget(layer)
            elif layer.weight.requires_grad:
                self._restore(layer)
            elif layer.weight._qstore is not layer.store:
                self._rebase(layer)
            else:
                continue
            changed = True
        return changed

    def _rebase(self, layer: _Layer) -> None:
        """A converted weight (``model.half()`` swaps every parameter's contents for a cast of it: here a lazy
        cast of the quantized weight) as a quantized weight again, whose exact original is the original cast."""
        weight, previous = layer.weight, layer.store
        host = weight.exact(on_host=True)  # (a cast: a new tensor in host memory)
        codes = Codes.encode(current_backend(weight.device).to_device(host), weight.bits)
        layer.store = Store(codes, (), host, give_back=previous.give_back)
        weight._qstore, weight._qsteps = layer.store, ()
        previous.give_back = None

    def _quantize(self, module: torch.nn.Linear, backend: MemoryBackend, bits: int) -> bool:
        weight = module.weight
        codes = Codes.encode(weight, bits)  # (may run out of memory: the layer is then left as it was)
        host = backend.to_host(weight.detach())
        backend.synchronize()  # the host copy has landed before the device memory is let go
        quantized = QuantizedWeight.weight(codes, host, user_attributes(weight))
        held: QuantizedWeight
        original: torch.Tensor
        try:  # the user's parameter object becomes the quantized one; ``quantized`` now holds the original
            torch.utils.swap_tensors(weight, quantized)  # type: ignore[no-untyped-call]
            held, original, swapped = cast(QuantizedWeight, weight), quantized, True
        except RuntimeError:  # referenced from elsewhere (weak references, a C++ holder): it cannot change
            if not is_fake(weight):
                return False  # (left whole: the rung relieves less, nothing is wrong)
            # (the planner's fake weights, which fake mode holds weakly: a fake's identity means nothing)
            module._parameters["weight"] = cast(torch.nn.Parameter, quantized)
            held, original, swapped = quantized, weight, False
        original.data = torch.empty(0, dtype=original.dtype, device=original.device)  # its device memory freed
        hook = module.register_state_dict_post_hook(exact_originals)  # type: ignore[no-untyped-call]
        layer = self._layers[id(module)] = _Layer(module, held, original, swapped, hook, held._qstore)
        layer.store.give_back = functools.partial(_give_back, weakref.ref(self), layer)
        return True

    def _restore(self, layer: _Layer) -> None:
        """The layer's weight back as it was, the same object, with its exact original (may run out of memory:
        the layer is then left quantized)."""
        weight, original = layer.weight, layer.original
        original.data = current_backend(weight.device).to_device(weight.exact(on_host=True))
        original.requires_grad_(weight.requires_grad)  # (unfrozen while quantized: it trains now)
        vars(original).update(user_attributes(weight))  # attributes set on the parameter while it was quantized
        if layer.swapped:
            try:  # the user's object back to its own class and tensor
                torch.utils.swap_tensors(weight, original)  # type: ignore[no-untyped-call]
            except RuntimeError as error:
                original.data = torch.empty(0, dtype=original.dtype, device=original.device)
                raise RuntimeError(
                    f"oomguard: the quantized_weights rung cannot give back a {tuple(weight.shape)} weight while "
                    f"something still holds it ({error}): an autograd graph that saved it (a loss or output kept "
                    f"from a forward that never ran backward), or a view of it kept. Drop those and call "
                    f"guard.close() again"
                ) from None
        else:
            layer.module._parameters["weight"] = cast(torch.nn.Parameter, original)
        self._forget(layer)

    def _forget(self, layer: _Layer) -> None:
        layer.hook.remove()
        layer.store.give_back = None
        del self._layers[id(layer.module)]

    def close(self) -> None:
        """Every original weight back on the device, bit for bit (may run out of memory: the rest stay
        quantized, the rung still engaged)."""
        for layer in list(self._layers.values()):
            if _held(layer):
                self._restore(layer)
            else:
                self._forget(layer)  # (replaced by the user: what is there now stays)


def _held(layer: _Layer) -> bool:
    """Whether the layer's module still holds the rung's weight: the same object, holding the rung's store or a
    cast of it (``model.half()``), not one written to since."""
    weight = layer.module.weight
    store = weight._qstore if isinstance(weight, QuantizedWeight) and weight is layer.weight else None
    return store is not None and (store is layer.store or (store.source is layer.store and store.dense is None))


def _give_back(effect: weakref.ref[QuantizedWeightsEffect], layer: _Layer, tensor: torch.Tensor) -> None:
    """What a quantized weight calls when it is about to be unfrozen or replaced: the weight given back whole."""
    owner = effect()
    if owner is not None and tensor is layer.weight and owner._layers.get(id(layer.module)) is layer:
        owner._restore(layer)
