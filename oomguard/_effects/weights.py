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

The machinery is :class:`HeldWeightsEffect`, which the ``amp`` rung's effect shares
(:class:`~oomguard._effects.precision.AutocastEffect`: frozen linear weights in half precision); a subclass says
which parameters a plan holds, and in what form.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.hooks import RemovableHandle

from oomguard._backends.memory import MemoryBackend, current_backend
from oomguard._bitsandbytes import is_4bit
from oomguard._effects.base import Effect, EffectTarget
from oomguard._effects.chunked_loss import causal_lm
from oomguard._effects.codec import Codes, Form
from oomguard._effects.qweight import QuantizedWeight, exact_originals, user_attributes
from oomguard._effects.weight_store import Store
from oomguard._ladder.plan import Plan

__all__ = [
    "MIN_VALUES",
    "Held",
    "HeldWeightsEffect",
    "QuantizedWeightsEffect",
    "chunked_head",
    "frozen_linears",
    "lm_head",
]

MIN_VALUES = 1024

#: A parameter an effect may hold: its module, and its name there.
Held = tuple[torch.nn.Module, str]


def frozen_linears(model: torch.nn.Module, besides: torch.nn.Module | None = None) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` layers whose weight the rung may quantize: frozen, floating point, not bitsandbytes' 4-bit
    codes already, not shared with another module, at least 1,024 values, holding no gradient; never ``besides``
    (see :func:`chunked_head`)."""
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
        and not is_4bit(module.weight)  # (bitsandbytes' own 4-bit codes, whatever dtype stores them)
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
    """One held parameter: ``module``'s ``name``."""

    module: torch.nn.Module
    name: str
    #: What the module holds now: the user's own parameter object, now held (``swapped``); or, for a fake tensor
    #: (the planner's, which fake mode holds weak references to and cannot be swapped), a stand-in.
    weight: QuantizedWeight
    #: The object that now holds the original tensor (its storage emptied): swapped back, refilled, on undo.
    original: torch.Tensor
    swapped: bool
    hook: RemovableHandle
    store: Store  # its codes and exact original (kept here: swapping back moves them off ``weight``)

    @property
    def key(self) -> tuple[int, str]:
        return id(self.module), self.name


class HeldWeightsEffect(Effect):
    """Frozen parameters held on the device in a smaller form (:class:`~oomguard._effects.codec.Codes`), their exact
    originals in host memory (see the module). A subclass says which parameters a plan holds, and in what form
    (:meth:`wanted`); each is held, held again in another form, or given back as plans change."""

    #: The rung whose effect this is, and how :attr:`held` words what it holds (for messages).
    rung: ClassVar[str]
    holding: ClassVar[str]

    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._layers: dict[tuple[int, str], _Layer] = {}  # (id(module), name) -> its held parameter

    def wanted(self, plan: Plan) -> tuple[Form | None, list[Held]]:
        """The form in which ``plan`` holds frozen parameters (None: it holds none), and which ones."""
        return None, []

    @property
    def holds(self) -> bool:
        return bool(self._layers)

    @property
    def held(self) -> str:
        return f"{len(self._layers)} {self.holding}"

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        """What the planner's dry run asks of an effect that holds the model: nothing needs to step aside here. No
        method is patched, and the planner's fakes replace each held weight in its module's parameter table, in
        the weight's shape and logical dtype."""
        return None

    def before_apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        """Every parameter ``plan`` does not hold given back whole, before another effect may take it: layer
        offload a block whole, the chunked loss's patch the head, the quantized_weights rung a weight held in half
        precision."""
        if not self._layers:
            return False
        form, params = self.wanted(plan)
        keep = set() if form is None else {(id(module), name) for module, name in params}
        let_go = [key for key in self._layers if key not in keep]
        self._release(let_go)
        return bool(let_go)

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        changed = self._let_go()
        form, params = self.wanted(plan)
        if form is None:
            return changed
        for module, name in params:  # one at a time: an OOM part-way leaves whole parameters
            layer, param = self._layers.get((id(module), name)), module._parameters[name]
            if layer is not None:
                if layer.store.codes.form != form:  # type: ignore[union-attr]  # (another form, from the original)
                    layer.store.recode(form)
                    changed = True
            elif param is not None and backend.is_device(param) and not isinstance(param, QuantizedWeight):
                changed = self._hold(module, name, backend, form) or changed
        return changed

    def _let_go(self) -> bool:
        """Parameters the user has changed since: one unfrozen is given back whole (it trains, exactly); one
        converted (``model.half()``) is held again from its exact original, converted; one replaced
        (``module.weight = ...``, ``load_state_dict(assign=True)``) is no longer the effect's."""
        changed = False
        for key in list(self._layers):  # (by key: see _release)
            layer = self._layers[key]
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
        cast of the held weight) as a held weight again, whose exact original is the original cast."""
        weight, previous = layer.weight, layer.store
        host = weight.exact(on_host=True)  # (a cast: a new tensor in host memory)
        codes = Codes.encode(current_backend(weight.device).to_device(host), previous.codes.form)  # type: ignore[union-attr]
        layer.store = Store(codes, (), host, give_back=previous.give_back)
        weight._qstore, weight._qsteps = layer.store, ()
        previous.give_back = None

    def _hold(self, module: torch.nn.Module, name: str, backend: MemoryBackend, form: Form) -> bool:
        weight = cast(torch.nn.Parameter, module._parameters[name])
        codes = Codes.encode(weight, form)  # (may run out of memory: the parameter is then left as it was)
        host = backend.to_host(weight.detach())
        backend.synchronize()  # the host copy has landed before the device memory is let go
        held = QuantizedWeight.weight(codes, host, user_attributes(weight))
        holder: QuantizedWeight
        original: torch.Tensor
        try:  # the user's parameter object becomes the held one; ``held`` now holds the original
            torch.utils.swap_tensors(weight, held)  # type: ignore[no-untyped-call]
            holder, original, swapped = cast(QuantizedWeight, weight), held, True
        except RuntimeError:  # referenced from elsewhere (weak references, a C++ holder): it cannot change
            if not is_fake(weight):
                return False  # (left whole: the rung relieves less, nothing is wrong)
            # (the planner's fake weights, which fake mode holds weakly: a fake's identity means nothing)
            module._parameters[name] = cast(torch.nn.Parameter, held)
            holder, original, swapped = held, weight, False
        original.data = torch.empty(0, dtype=original.dtype, device=original.device)  # its device memory freed
        hook = module.register_state_dict_post_hook(exact_originals)  # type: ignore[no-untyped-call]
        layer = _Layer(module, name, holder, original, swapped, hook, holder._qstore)
        self._layers[layer.key] = layer
        layer.store.give_back = functools.partial(_give_back, weakref.ref(self), layer)
        return True

    def _restore(self, layer: _Layer) -> None:
        """The parameter back as it was, the same object, with its exact original (may run out of memory: it is
        then left held)."""
        weight, original = layer.weight, layer.original
        original.data = current_backend(weight.device).to_device(weight.exact(on_host=True))
        original.requires_grad_(weight.requires_grad)  # (unfrozen while held: it trains now)
        vars(original).update(user_attributes(weight))  # attributes set on the parameter while it was held
        if layer.swapped:
            try:  # the user's object back to its own class and tensor
                torch.utils.swap_tensors(weight, original)  # type: ignore[no-untyped-call]
            except RuntimeError as error:
                original.data = torch.empty(0, dtype=original.dtype, device=original.device)
                raise RuntimeError(
                    f"oomguard: the {self.rung} rung cannot give back a {tuple(weight.shape)} weight while "
                    f"something still holds it ({error}): an autograd graph that saved it (a loss or output kept "
                    f"from a forward that never ran backward), or a view of it kept. Drop those and call "
                    f"guard.close() again"
                ) from None
        else:
            layer.module._parameters[layer.name] = cast(torch.nn.Parameter, original)
        self._forget(layer)

    def _forget(self, layer: _Layer) -> None:
        layer.hook.remove()
        layer.store.give_back = None
        del self._layers[layer.key]

    def _release(self, keys: list[tuple[int, str]]) -> None:
        """The parameters of ``keys`` back whole, one at a time (a layer in hand keeps its held values alive: only
        one is, so each one's are freed before the next original comes back)."""
        for key in keys:
            layer = self._layers[key]
            if _held(layer):
                self._restore(layer)
            else:
                self._forget(layer)  # (replaced by the user: what is there now stays)

    def close(self) -> None:
        """Every original back on the device, bit for bit (may run out of memory: the rest stay held, the rung
        still engaged)."""
        self._release(list(self._layers))


class QuantizedWeightsEffect(HeldWeightsEffect):
    """The frozen ``nn.Linear`` weights of :func:`frozen_linears` in 8 or 4 bits, where the plan asks for them."""

    rung = "quantized_weights"
    holding = "quantized frozen weight(s)"

    def wanted(self, plan: Plan) -> tuple[Form | None, list[Held]]:
        if not plan.quantized_weights:
            return None, []
        besides = chunked_head(self.target.model, plan)  # (the chunked loss's, while the plan has it)
        form = 4 if plan.quantized_weights == "4bit" else 8
        return form, [(module, "weight") for module in frozen_linears(self.target.model, besides)]


def _held(layer: _Layer) -> bool:
    """Whether the layer's module still holds the effect's parameter: the same object, holding the effect's store
    or a cast of it (``model.half()``), not one written to since."""
    weight = layer.module._parameters.get(layer.name)
    store = weight._qstore if isinstance(weight, QuantizedWeight) and weight is layer.weight else None
    return store is not None and (store is layer.store or (store.source is layer.store and store.dense is None))


def _give_back(effect: weakref.ref[HeldWeightsEffect], layer: _Layer, tensor: torch.Tensor) -> None:
    """What a held weight calls when it is about to be unfrozen or replaced: the weight given back whole."""
    owner = effect()
    if owner is not None and tensor is layer.weight and owner._layers.get(layer.key) is layer:
        owner._restore(layer)
