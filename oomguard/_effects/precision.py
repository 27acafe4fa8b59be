"""The amp rung's effect: each micro-batch's forward runs under ``torch.autocast`` in the plan's precision, and the
frozen fp32 weights of linear layers are held in that precision on the device meanwhile.

Autocast casts every fp32 operand of a matrix product to bf16 (or fp16) for each product; a frozen weight's cast is
the same every time, yet its fp32 original stayed on the device beside it, and each layer's cast was kept for its
backward too. So while the plan has a precision, each frozen fp32 weight and bias of a linear layer (``nn.Linear``,
transformers' ``Conv1D``: read through ``F.linear`` and ``addmm``, which autocast casts) is held on the device in
that precision, its exact original in host memory (:class:`~oomguard._effects.weights.HeldWeightsEffect`, the
machinery of the ``quantized_weights`` rung): half its size, nothing cast per product, and the same operands
reach every product bit for bit (the cast of fp32 to bf16 or fp16 rounds each element to nearest, so the held
values *are* autocast's cast). A read that is not that cast (PEFT DoRA's weight norm, ``weight.norm()``, a cast to
another precision, ``state_dict()``, ``copy.deepcopy``) gets the exact fp32 original, as it would have without the
rung (:mod:`oomguard._effects.weight_store`): brought from host memory for it, a copy and a transfer per read. So
are reads outside autocast: a forward outside the guarded step (an evaluation) computes in fp32 as before, reading
each held weight from the host; run it under ``torch.autocast`` as the step does, where it reads nothing.

Left as they are: trainable parameters; parameters of another dtype (a base loaded in bf16 has nothing to halve);
parameters shared with another module (a tied output head: the embedding's lookup would read its fp32 original
from the host at every forward); parameters under 1,024 values or holding a gradient; tensor subclasses (FSDP2's
DTensors, bitsandbytes' quantized weights); the output head while the plan has the chunked loss (that rung's
patch reads it whole); the weights the ``quantized_weights`` rung holds in low bits; and the blocks layer offload
streams, which go to the host whole: a weight in a block about to be offloaded is given back first, and held
again once the block is back. Undo (the amp rung relaxed, ``guard.close()``, giving up) puts every original back
bit for bit. The master level of ``optimizer_offload`` halves trainable weights only: the two hold disjoint sets.

(The fp16 gradient scaler is the step's business: :meth:`oomguard._effects.effects.Effects.scaler`.)
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import is_fake

from oomguard._effects.codec import Form
from oomguard._effects.qweight import QuantizedWeight
from oomguard._effects.weights import MIN_VALUES, Held, HeldWeightsEffect, chunked_head, frozen_linears
from oomguard._ladder.plan import Plan, Precision

__all__ = ["AutocastEffect", "half_candidates", "held_bytes"]

_DTYPES: dict[Precision, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _linear(module: torch.nn.Module) -> bool:
    """Whether autocast casts what ``module`` computes with: ``nn.Linear`` (``F.linear``) and transformers'
    ``Conv1D`` (``addmm``)."""
    kind = type(module)
    return isinstance(module, torch.nn.Linear) or (
        kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers.")
    )


def half_candidates(model: torch.nn.Module) -> list[Held]:
    """The parameters the amp rung may hold in half precision: each linear layer's frozen fp32 weight and bias, a
    plain parameter (a fake one in a dry run; one held already), used by that module alone, of at least 1,024
    values, holding no gradient (see the module)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return [
        (module, name)
        for module in model.modules()
        if _linear(module)
        for name, param in module._parameters.items()
        if param is not None
        and (type(param) in (torch.nn.Parameter, QuantizedWeight) or is_fake(param))
        and not param.requires_grad
        and param.dtype == torch.float32
        and param.numel() >= MIN_VALUES
        and param.grad is None
        and uses.get(id(param)) == 1
    ]


def held_bytes(params: list[Held]) -> int:
    """The bytes of ``params`` as the user's model has them (what their originals keep in host memory, held)."""
    found = (module._parameters[name] for module, name in params)
    return sum(param.numel() * param.element_size() for param in found if param is not None)


class AutocastEffect(HeldWeightsEffect):
    """Autocast around the forward of a plan with a ``precision``; frozen linear weights held in it (see the
    module)."""

    rung = "amp"
    holding = "frozen weight(s) held in half precision"

    def forward(self, plan: Plan) -> contextlib.AbstractContextManager[None] | None:
        if plan.precision is None:
            return None
        # autocast caches the half-precision copy of every weight until the forward ends, which would keep each
        # streamed block's weights on the device: no cache while layers are offloaded.
        cache = not self.target.streamed
        return torch.autocast(device_type=self.target.device_type, dtype=_DTYPES[plan.precision], cache_enabled=cache)

    def wanted(self, plan: Plan) -> tuple[Form | None, list[Held]]:
        if plan.precision is None:
            return None, []
        model = self.target.model
        head = chunked_head(model, plan)
        whole = [module for block in self.target.blocks[: plan.offload_layers] for module in block.modules()]
        besides = {id(module) for module in whole} | ({id(head)} if head is not None else set())
        quantized = {id(module) for module in frozen_linears(model, head)} if plan.quantized_weights else set()
        params = [
            (module, name)
            for module, name in half_candidates(model)
            if id(module) not in besides and not (name == "weight" and id(module) in quantized)
        ]
        return _DTYPES[plan.precision], params
