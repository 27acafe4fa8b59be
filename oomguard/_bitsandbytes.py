"""bitsandbytes' 4-bit weights (``Params4bit``, QLoRA's NF4 base model), as the guard meets them: in one place.

A 4-bit weight is a frozen parameter of packed codes (two weights a byte, ``uint8`` unless the model was loaded
with another ``quant_storage``) with its quantization state beside it, ``weight.quant_state``: an absolute maximum
per block of 64 weights (with double quantization those are 8-bit codes themselves, with an fp32 maximum per 256 of
them), the code tables and an offset. Those tensors are on the device and belong to no module's parameters or
buffers. What follows for the guard:

* They are device memory: :func:`quant_state_tensors` are counted wherever the model's resident tensors are
  (``SimulatedGPU.adopt``, the planner's resident bytes).
* ``Params4bit.to(device)`` quantizes on its first move, and afterwards moves the *shared* quant state in place and
  returns a parameter with ``module=None``: nothing of the guard moves or copies a 4-bit weight through it. Layer
  offload streams the packed codes through ``.data``, as it streams every weight, and the quant state stays on the
  device; optimizer offload steps trainable parameters only, which a 4-bit weight never is.
* The guard's ``quantized_weights`` leaves them as they are (:func:`is_4bit`), and so does ``amp``: autocast casts no
  4-bit weight, and a 4-bit layer computes in its ``compute_dtype`` (bf16, QLoRA's: the same bits with and without
  autocast; fp32: a bf16 product under autocast, as any fp32 linear layer's).
* bitsandbytes cannot make a ``Params4bit`` of a fake tensor: the planner's fake of one (:func:`fake_parameter`) is a
  plain frozen parameter of the packed shape with the weight's attributes and a copy of its quant state made of
  fakes, with which the real ``Linear4bit`` computes through bitsandbytes' registered fake kernels.

bitsandbytes is never imported here: a 4-bit weight is known by the attribute every ``Params4bit`` has.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch

__all__ = ["fake_parameter", "four_bit_weights", "is_4bit", "quant_state_tensors", "tell_once"]

logger = logging.getLogger("oomguard")

#: Models already told what the rungs do with their 4-bit weights (once per model: the planner's contexts too).
_TOLD: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def is_4bit(tensor: object) -> bool:
    """Whether ``tensor`` is a bitsandbytes 4-bit weight: a ``Params4bit`` (quantized or not yet), or the planner's
    fake of one."""
    return isinstance(tensor, torch.Tensor) and "bnb_quantized" in vars(tensor)


def four_bit_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The 4-bit weights among ``model``'s parameters."""
    return [param for param in model.parameters() if is_4bit(param)]


def quant_state_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a 4-bit weight's quantization state, its nested state's included; none for any other tensor."""
    return _state_tensors(getattr(tensor, "quant_state", None)) if is_4bit(tensor) else []


def _state_tensors(state: object) -> list[torch.Tensor]:
    if state is None:
        return []
    found: list[torch.Tensor] = []
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value) is type(state):  # (the nested state of double quantization: a state of its own kind)
            found += _state_tensors(value)
    return found


def fake_parameter(
    weight: torch.nn.Parameter, codes: torch.Tensor, fake: Callable[[torch.Tensor], torch.Tensor]
) -> torch.nn.Parameter:
    """The planner's fake of the parameter ``weight``: ``codes`` (a fake of its data) as a parameter that requires
    grad as it does. For a 4-bit weight, a frozen one with the weight's attributes and a copy of its quant state
    whose tensors are their fakes (``fake``): the layer reads the weight's quant state before its own
    (``Linear4bit.quant_state``, the same object as the real weight's), so nothing real is computed with; nothing of
    the real weight is held but its plain attributes."""
    if not is_4bit(weight):
        return torch.nn.Parameter(codes, requires_grad=weight.requires_grad)
    made = torch.nn.Parameter(codes, requires_grad=False)
    vars(made).update({key: value for key, value in vars(weight).items() if key not in ("quant_state", "module")})
    made.quant_state = _faked_state(getattr(weight, "quant_state", None), fake)  # type: ignore[attr-defined]
    made.module = None  # type: ignore[attr-defined]
    return made


def _faked_state(state: Any, fake: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of the quant state ``state`` (None: None) with every tensor, the nested state's too, a fake."""
    if state is None:
        return None
    copied = object.__new__(type(state))
    for key, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            value = fake(value)
        elif type(value) is type(state):
            value = _faked_state(value, fake)
        vars(copied)[key] = value
    return copied


def tell_once(model: torch.nn.Module, rungs: Collection[str], others_frozen: bool) -> None:
    """Say once per model, where it holds 4-bit weights, what the rungs of the ladder (``rungs``, by name) do with
    them; ``others_frozen``: whether the model has other frozen linear weights, which ``quantized_weights`` takes."""
    if model in _TOLD:
        return
    _TOLD.add(model)
    weights = four_bit_weights(model)
    if not weights:
        return
    held = sum(t.numel() * t.element_size() for w in weights for t in [w, *quant_state_tensors(w)])
    said = []
    if "amp" in rungs:
        said.append(
            "amp runs the forward under autocast and casts none of them: each 4-bit layer computes in its "
            "compute_dtype (bf16: the same product with or without amp; fp32: in bf16 under amp, as any fp32 layer)"
        )
    if "quantized_weights" in rungs:
        said.append(
            "quantized_weights leaves them as they are and quantizes the other frozen linear weights"
            if others_frozen
            else "quantized_weights does not apply: they are 4-bit already and no other linear weight is frozen"
        )
    if "layer_offload" in rungs:
        said.append("layer_offload streams their packed codes; their quantization state stays on the device")
    logger.info(
        "oomguard: the model holds %d bitsandbytes 4-bit weight(s) (%d bytes with their quantization state)%s",
        len(weights),
        held,
        "".join(f"; {line}" for line in said),
    )
