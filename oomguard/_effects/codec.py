"""The forms a frozen weight is held in on the device: the ``quantized_weights`` rung's per-channel int8 and NF4
packed two to a byte, and the ``amp`` rung's half precision.

8 bits: symmetric, weight-only codes with one fp32 scale per output channel (``weight ~ codes * scale``), about a
quarter of an fp32 weight's size. 4 bits: the 16 NF4 levels (quantiles of a normal distribution, as QLoRA stores
its base model, one exact zero among them) with one fp32 absolute maximum per 64 values, 0.56 bytes a value.
Half precision (bf16 or fp16): the weight cast to it, half an fp32 weight's size, which is exactly what autocast's
cast of the weight computes (round to nearest, element by element): that cast reads the held values, every other
read the exact original (see :meth:`oomguard._effects.weight_store.Store.values`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

import torch

__all__ = ["GROUP", "Codes", "Form", "nf4_levels"]

GROUP = 64  # values per scale in 4 bits

#: What :meth:`Codes.encode` makes: 8 or 4 (bits of codes), or a half-precision dtype (``torch.bfloat16``,
#: ``torch.float16``) to hold the weight cast to.
Form = int | torch.dtype


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


@dataclass(frozen=True, eq=False)
class Codes:
    """One weight in its held form, on its device; never changed (a write to the weight makes new codes).

    ``codes``: int8 (one per value), uint8 (two 4-bit codes), or the weight cast to half precision, contiguous;
    ``scales``: fp32, one per output channel (8 bits) or per 64 values (4 bits), None in half precision;
    ``table``: 4 bits only, each byte's two values (see :meth:`encode`). ``shape`` and ``dtype``: the weight's.
    """

    codes: torch.Tensor
    scales: torch.Tensor | None
    table: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype

    @property
    def bits(self) -> int:
        return 16 if self.scales is None else 8 if self.table is None else 4

    @property
    def half(self) -> torch.dtype | None:
        """The half-precision dtype the weight is held in; None for low-bit codes."""
        return self.codes.dtype if self.scales is None else None

    @property
    def form(self) -> Form:
        """What :meth:`encode` was asked for."""
        return self.bits if self.half is None else self.half

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The device tensors, by name."""
        found = {"codes": self.codes} if self.scales is None else {"codes": self.codes, "scales": self.scales}
        return found if self.table is None else {**found, "table": self.table}

    @classmethod
    def encode(cls, weight: torch.Tensor, form: Form) -> Codes:
        """``weight``'s codes. 8 bits: symmetric int8 codes with one fp32 scale per row. 4 bits: each run of 64
        values (the weight read row after row, zero-padded to whole runs) divided by its absolute maximum and
        stored as the index of the nearest NF4 level, two to a byte (the first in the low half). A dtype: the
        weight cast to it, contiguous."""
        weight = weight.detach()
        if isinstance(form, torch.dtype):
            return cls(weight.to(form, memory_format=torch.contiguous_format), None, None, weight.shape, weight.dtype)
        if form == 8:
            scales = weight.float().abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
            codes = (weight.float() / scales).round_().clamp_(-127, 127).to(torch.int8)
            return cls(codes, scales, None, weight.shape, weight.dtype)
        values = weight.float().reshape(-1)
        groups = torch.nn.functional.pad(values, (0, -values.numel() % GROUP)).view(-1, GROUP)
        scales = groups.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=weight.device)
        index = torch.bucketize(groups / scales, bounds, out_int32=True).to(torch.uint8)
        codes = index[:, 0::2] | (index[:, 1::2] << 4)
        del index
        levels = torch.tensor(_LEVELS, dtype=torch.float32, device=weight.device)
        table = torch.stack((levels.repeat(16), levels.repeat_interleave(16)), dim=1)  # byte b: (low, high half)
        return cls(codes, scales, table, weight.shape, weight.dtype)

    def decode(self) -> torch.Tensor:
        """The weight these low-bit codes stand for, contiguous, in its own dtype (computed in fp32). (Half
        precision is not decoded: its reads are :meth:`oomguard._effects.weight_store.Store.values`'.)"""
        scales = cast(torch.Tensor, self.scales)
        if self.table is None:
            values = self.codes * scales
        else:
            pairs = self.table.index_select(0, self.codes.view(-1).int())  # (faster than indexing with a tensor)
            values = pairs.view(scales.shape[0], GROUP).mul_(scales).view(-1)  # (in place: one fp32 copy)
            values = values[: self.shape.numel()].view(self.shape)
        return values.to(self.dtype)
