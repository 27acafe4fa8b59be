"""The amp rung's effect: each micro-batch's forward runs under ``torch.autocast`` in the plan's precision.

(The fp16 gradient scaler is the step's business: :meth:`oomguard._effects.effects.Effects.scaler`.)
"""

from __future__ import annotations

import contextlib

import torch

from oomguard._effects.base import Effect
from oomguard._ladder.plan import Plan, Precision

__all__ = ["AutocastEffect"]

_DTYPES: dict[Precision, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class AutocastEffect(Effect):
    """Autocast around the forward of a plan with a ``precision``."""

    def forward(self, plan: Plan) -> contextlib.AbstractContextManager[None] | None:
        if plan.precision is None:
            return None
        # autocast caches the half-precision copy of every weight until the forward ends, which would keep each
        # streamed block's weights on the device: no cache while layers are offloaded.
        cache = not self.target.streamed
        return torch.autocast(device_type=self.target.device_type, dtype=_DTYPES[plan.precision], cache_enabled=cache)
