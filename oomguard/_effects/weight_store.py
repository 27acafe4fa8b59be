"""What a held weight and every tensor derived from it share: its codes on the device, its exact original in host
memory, and which values each read of it gets.

A frozen weight that the ``quantized_weights`` rung holds in 8 or 4 bits, or the ``amp`` rung in half precision,
is a :class:`~oomguard._effects.qweight.QuantizedWeight` over a :class:`Store`; its views and casts are wrappers
over the same store (or over a copy's store, for a cast) with the :class:`Step` that made them. What a read
computes with (:meth:`Store.values`):

* low-bit codes: the dequantized weight, viewed and cast as the tensor read is;
* half precision: where the read is a cast of the weight to that precision (autocast's, for a matrix product),
  the held values themselves, viewed as the read is, with no copy: the cast of the exact original, bit for bit,
  as the cast of fp32 to bf16 or fp16 rounds each element to nearest. Every other read (a weight norm, a sum,
  ``.float()``, a cast to another precision) gets the exact original, brought from host memory for it: what it
  would have read had the weight not been held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from oomguard._backends.memory import current_backend
from oomguard._effects.codec import Codes, Form

__all__ = ["Step", "Store", "replay"]

_aten = torch.ops.aten
_REINTERPRETS = {_aten.view.dtype}  # views that read the bits of the values, not the values: not exact across a cast


@dataclass(frozen=True, eq=False)
class Step:
    """How a derived tensor is made from the one it came from: a view op (``op`` with its other arguments;
    ``index``: which of its outputs), or, without ``op``, a cast to ``dtype``."""

    op: torch._ops.OpOverload | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    index: int | None = None
    dtype: torch.dtype | None = None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.op is None:
            cast_to: torch.Tensor = _aten._to_copy.default(tensor, dtype=self.dtype)
            return cast_to
        out = self.op(tensor, *self.args, **self.kwargs)
        return out if self.index is None else out[self.index]  # type: ignore[no-any-return]


def replay(steps: tuple[Step, ...], tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` after ``steps``."""
    for step in steps:
        tensor = step(tensor)
    return tensor


def _held_read(steps: tuple[Step, ...], codes: Codes) -> torch.Tensor | None:
    """The values ``steps`` make of a weight held in half precision, read from the held values where the first cast
    among them is to that precision after views only (the held values are that cast of the exact original); None
    where the read needs the exact original."""
    for index, step in enumerate(steps):
        if step.op in _REINTERPRETS:
            return None
        if step.op is None:
            if step.dtype != codes.half:
                return None
            return replay(steps[index + 1 :], replay(steps[:index], codes.codes))
    return None


@dataclass(eq=False)
class Store:
    """What a held tensor and all its views share. A weight's store has its exact original in ``host``; a copy's
    (a cast, made lazily) has none but knows the weight's store it was made from (``source``: its exact values are
    the original's, cast), and once written to holds its own values in ``dense``."""

    codes: Codes | None
    steps: tuple[Step, ...]  # from the weight's values to this store's values (a copy's views and cast)
    host: torch.Tensor | None
    source: Store | None = None
    dense: torch.Tensor | None = None
    #: The rung's effect puts the weight back whole (as a plain parameter) when called with it.
    give_back: Callable[[torch.Tensor], None] | None = None

    @property
    def device(self) -> torch.device:
        return self.dense.device if self.dense is not None else self.codes.codes.device  # type: ignore[union-attr]

    def values(self) -> torch.Tensor:
        """What computations see: the dequantized weight, or for a weight held in half precision the held values
        or the exact original (see the module); a copy's own values once written to."""
        if self.dense is not None:
            return self.dense
        codes = cast(Codes, self.codes)  # (a store without codes has dense values)
        if codes.half is None:
            return replay(self.steps, codes.decode())
        held = _held_read(self.steps, codes)
        if held is not None:
            return held
        weight = cast(Store, self if self.host is not None else self.source)  # (a cast's knows the weight's)
        return replay(self.steps, current_backend(self.device).to_device(cast(torch.Tensor, weight.host)))

    def meta(self, steps: tuple[Step, ...]) -> torch.Tensor:
        """A meta tensor with the shape, strides and dtype of this store's values after ``steps``."""
        if self.dense is not None:
            dense = self.dense
            return replay(steps, torch.empty_strided(dense.shape, dense.stride(), dtype=dense.dtype, device="meta"))
        codes = self.codes
        return replay(self.steps + steps, torch.empty(codes.shape, dtype=codes.dtype, device="meta"))  # type: ignore[union-attr]

    def writable(self) -> torch.Tensor:
        """A dense tensor a write can land in: a device copy of a weight's exact original (see :meth:`commit`),
        or a copy's own values (made plain for good; never the held values, which other reads share)."""
        if self.host is not None:
            return current_backend(self.device).to_device(self.host)
        if self.dense is None:
            half = self.codes is not None and self.codes.half is not None
            self.dense, self.codes = self.values().clone() if half else self.values(), None
        return self.dense

    def commit(self, exact: torch.Tensor) -> None:
        """After a write to :meth:`writable`'s tensor: a weight's new exact original, kept and held again."""
        if self.host is None:
            return  # a copy's values were written in place
        codes = Codes.encode(exact, self.codes.form)  # type: ignore[union-attr]  # (may run out of memory: unchanged)
        backend = current_backend(self.device)
        self.host = backend.to_host(exact, self.host)
        backend.synchronize()
        self.codes = codes

    def recode(self, form: Form) -> None:
        """The weight held again in ``form``, from its exact original."""
        exact = current_backend(self.device).to_device(self.host)  # type: ignore[arg-type]
        self.codes = Codes.encode(exact, form)
