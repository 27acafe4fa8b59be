"""The logits the ``chunked_loss`` rung's head returns instead of computing them: a promise of ``lm_head(hidden)``.

:class:`LazyLogits` is a tensor with the logits' shape, dtype and device and no storage
(``torch.Tensor._make_wrapper_subclass``). It holds what the head was called with (:class:`HeadCall`) and the
element-wise steps the model's forward applied to the logits between the head and the loss (:class:`Step`):
Gemma 2/3's softcap (``/ cap``, ``tanh``, ``* cap``), Cohere's ``* logit_scale``, Granite's ``/ logits_scaling``,
a ``.float()``. Each such step is recorded, not run (``__torch_function__``), so the loss can replay them on one
chunk of rows at a time (:mod:`oomguard._effects.chunked_ce`): the steps act on each logit alone, so a chunk's
rows come out exactly as the full tensor's would.

Anything else that meets the tensor (a token-accuracy metric's ``argmax``, a distillation loss, a slice,
``print``) gets the real logits: they are computed once, with gradient history when grad mode is on (a loss built
from them trains exactly as without the rung), kept for the next read, and the op runs on them; made under
``no_grad`` (a metric), they are computed again, with history, for the first use that needs it. Recording happens
at the torch-function level, before any dispatch mode (the simulated GPU, the planner's fake tensors) sees an op,
so the wrapper itself never reaches a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_map

__all__ = ["HeadCall", "LazyLogits", "Step", "compute_dtype"]

_T = torch.Tensor
#: Functions that read only the tensor's metadata, answered from the wrapper without computing anything.
_PROPERTIES = (
    "shape",
    "dtype",
    "device",
    "ndim",
    "layout",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "is_sparse",
    "is_quantized",
)
_METADATA: frozenset[Any] = frozenset(
    {_T.size, _T.dim, _T.numel, _T.is_floating_point, _T.is_complex, _T.element_size, _T.get_device, _T.__len__}
    | {getattr(_T, name).__get__ for name in (*_PROPERTIES, "requires_grad", "itemsize", "is_nested")}
)
#: Element-wise functions of the logits and constants: recorded, then replayed on each chunk of rows. None is on
#: autocast's cast lists (unlike ``exp`` or ``log_softmax``), so replayed with autocast off they give what they
#: gave under it.
_ELEMENTWISE: frozenset[Any] = frozenset(
    {_T.__mul__, _T.__rmul__, _T.__truediv__, _T.__rtruediv__, _T.__add__, _T.__radd__, _T.__sub__, _T.__rsub__}
    | {_T.__neg__, _T.mul, _T.div, _T.add, _T.sub, _T.tanh, _T.neg, _T.float, _T.to}
    | {torch.mul, torch.div, torch.add, torch.sub, torch.tanh, torch.neg, torch.true_divide, _T.true_divide}
)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype ``F.linear(hidden, weight)`` computes in here and now: autocast's where it is on (it casts both
    operands), else the operands' own; None where they differ without autocast (the head would raise: the rung
    then leaves the call to the original head, which raises its own error)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and weight.dtype.is_floating_point:
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype if hidden.dtype == weight.dtype else None


@dataclass(frozen=True, eq=False)
class HeadCall:
    """One call of the output head: its input and parameters as they were, and the dtype it computes in."""

    hidden: torch.Tensor  # (..., hidden size), with its gradient history
    weight: torch.Tensor  # (vocabulary, hidden size)
    bias: torch.Tensor | None
    dtype: torch.dtype  # autocast's dtype at the call, or the operands' own

    def logits(self) -> torch.Tensor:
        """The real logits, exactly as the head computes them (autocast's casts made explicit, so the result does
        not depend on whether autocast is still on when they are asked for)."""
        bias = None if self.bias is None else self.bias.to(self.dtype)
        with torch.autocast(self.hidden.device.type, enabled=False):
            return torch.nn.functional.linear(self.hidden.to(self.dtype), self.weight.to(self.dtype), bias)


@dataclass(frozen=True, eq=False)
class Step:
    """One recorded element-wise step: ``func`` with the logits at position ``index`` of ``args``."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    index: int = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The step on ``logits`` (all of them, or one chunk of rows)."""
        args = (*self.args[: self.index], logits, *self.args[self.index + 1 :])
        result: torch.Tensor = self.func(*args, **self.kwargs)
        return result


def _constant(value: Any) -> bool:
    """Whether ``value`` can be an operand of a recorded step: a number, a dtype, or a 0-dim tensor that needs no
    gradient (a trainable scale would need one, which replaying a chunk under a local autograd would not give)."""
    if isinstance(value, torch.Tensor):
        return not isinstance(value, LazyLogits) and value.dim() == 0 and not value.requires_grad
    return value is None or isinstance(value, (bool, int, float, torch.dtype))


class LazyLogits(torch.Tensor):
    """The head's logits, not computed: see the module docstring."""

    head: HeadCall
    steps: tuple[Step, ...]
    _real: torch.Tensor | None
    __slots__: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def __new__(cls, head: HeadCall, steps: tuple[Step, ...] = (), dtype: torch.dtype | None = None) -> LazyLogits:
        shape = (*head.hidden.shape[:-1], head.weight.shape[0])
        # The real logits would need grad exactly when one of the head's operands does (and grad mode is on).
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (head.hidden, head.weight, head.bias)
        )
        made = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype or head.dtype, device=head.hidden.device, requires_grad=needs_grad
        )
        lazy: LazyLogits = made
        lazy.head, lazy.steps, lazy._real = head, steps, None
        return lazy

    def __init__(self, head: HeadCall, steps: tuple[Step, ...] = (), dtype: torch.dtype | None = None) -> None:
        """Everything is set by ``__new__`` (a wrapper subclass is made there)."""

    @property
    def materialized(self) -> bool:
        """Whether the real logits were asked for (then every later use, the loss too, reads them)."""
        return self._real is not None

    def materialize(self) -> torch.Tensor:
        """The real logits: computed on first use (with gradient history where grad mode is on), then kept. Made
        without history (a metric read them under ``no_grad``) where a use now needs it (a loss term built from
        them after), they are computed again, with it, and those are kept."""
        history = self.requires_grad and torch.is_grad_enabled()
        if self._real is None or (history and not self._real.requires_grad):
            with torch._C.DisableTorchFunctionSubclass():
                logits = self.head.logits()
                for step in self.steps:
                    logits = step(logits)
            self._real = logits
        return self._real

    def _then(self, step: Step) -> LazyLogits:
        """These logits with ``step`` recorded after the others; its dtype found by running it on a meta tensor."""
        probe = step(torch.empty((1,), dtype=self.dtype, device="meta"))
        return LazyLogits(self.head, (*self.steps, step), probe.dtype)

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:  # a shape or dtype question: the wrapper has the answer, no logits needed
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        step = _as_step(func, args, kwargs)
        if step is not None:
            return args[step.index]._then(step)
        # Any other use needs the values: run it on the real logits (``_real`` makes in-place ops stick).
        real_args, real_kwargs = tree_map(lambda a: a.materialize() if isinstance(a, LazyLogits) else a, (args, kwargs))
        return func(*real_args, **real_kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # Only C++ code that skips torch functions gets here, below autograd: real logits made here would have no
        # gradient history, so a loss built from them would train on something else. Say so instead.
        raise RuntimeError(
            f"{func} met the chunked loss's lazy logits below autograd (C++ code that does not dispatch torch "
            f"functions to tensor subclasses); leave the chunked_loss rung out of the ladder for this model"
        )


def _as_step(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step | None:
    """``func(*args, **kwargs)`` as a step to record, if it is element-wise in exactly one not yet materialized
    :class:`LazyLogits` and constants (else None: it is run on the real logits)."""
    if func not in _ELEMENTWISE:
        return None
    lazy = [i for i, a in enumerate(args) if isinstance(a, LazyLogits)]
    if len(lazy) != 1 or args[lazy[0]].materialized:
        return None
    others = [a for i, a in enumerate(args) if i != lazy[0]] + list(kwargs.values())
    if not all(_constant(a) for a in others):  # another tensor (a mask, logits of a teacher): compute the values
        return None
    if func is _T.to and not all(isinstance(a, torch.dtype) for a in others):
        return None  # ``to`` a device, or with ``copy=``: not only a dtype cast
    return Step(func, args, kwargs, lazy[0])
