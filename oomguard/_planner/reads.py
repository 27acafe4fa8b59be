"""Planning steps that read tensor values: fake tensors hold none, so each read gets a placeholder.

A step that reads a value (``loss.item()`` for a metric, ``float(x)``, ``if mask.any():``) cannot run on fake
tensors as it is: the read raises, and the planner could not plan the step at all. Trainers read values all
the time for their logs (TRL's SFT, DPO and GRPO trainers in ``compute_loss``), so the guard's jump fell back to
walking the ladder one OOM at a time for exactly the jobs it is for. :class:`PlaceholderReads` answers every read
of a fake tensor's value with a placeholder: ``1.0``, ``1`` or ``False`` (one, not zero, so that the counts
metrics divide by stay divisors). A metric then logs a placeholder (the
Trainer integration takes what the dry run recorded back), and a branch on a value follows the placeholder's
way: the plan is of that path, a prediction the real step confirms or, by running out of memory, corrects. Indexing
with a boolean mask (whose result's size is the count of its true values) takes every element: the most memory
the real mask can need. A read whose placeholder breaks the step (a size made of it, a check that raises)
leaves the step unplannable, as before.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MAX_READS", "DryRunLimit", "PlaceholderReads"]

#: Reads of fake values one dry-run step may make: far more than any trainer's metrics, far fewer than a loop on a
#: tensor condition makes before it is noticed (``while not done.all():`` reads False for ever).
MAX_READS = 10_000
_CLOCK_EVERY = 256  # operations between two looks at the clock


class DryRunLimit(RuntimeError):
    """A dry run went past its bound on reads per step or on time: the step cannot be planned (the guard walks
    the ladder instead)."""


_READ = torch.ops.aten._local_scalar_dense.default  # what .item(), float(), int() and bool() of a tensor run
_NONZERO = torch.ops.aten.nonzero.default
_INDEX = torch.ops.aten.index.Tensor  # x[mask]: the mask's true positions (its nonzero) index x
_DEVICE = torch.ops.prim.device.default  # what C++ (the autograd engine) asks a fake tensor for its device


class Counter(Protocol):
    """What counts the operations dispatched (:class:`~oomguard._planner.speed.FlopCount`)."""

    def note(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None: ...


class PlaceholderReads(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Answers each read of a fake tensor's value with ``1.0``, ``1`` or ``False`` (by its dtype), and a boolean
    mask's ``nonzero`` with every index; counts them.

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode(), PlaceholderReads() as reads:
    ...     values = torch.ones(3).sum().item(), int(torch.ones(2, dtype=torch.long).sum()), bool(torch.ones(1) > 0)
    ...     taken = torch.ones(4, 2)[torch.zeros(4, 2) > 0].shape
    >>> values, taken, reads.count
    ((1.0, 1, False), torch.Size([8]), 4)
    """

    def __init__(self, deadline: float | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0
        self.deadline = deadline  # a time.monotonic() past which every operation raises DryRunLimit
        self._step_reads = self._ops = 0
        self._over: str | None = None  # why the bound was reached: every later operation raises too
        self._counter: Counter | None = None

    @contextlib.contextmanager
    def counting(self, counter: Counter) -> Iterator[None]:
        """``counter`` told every operation dispatched inside, as a mode of its own entered inside this one would
        be, without the cost of one more mode: each costs about as much as the operation itself on fake tensors."""
        self._counter = counter
        try:
            yield
        finally:
            self._counter = None

    def new_step(self) -> None:
        """A new dry-run step begins: its reads are counted from zero."""
        self._step_reads = 0

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE and isinstance(args[0], FakeTensor):
            # Half of a fake step's dispatches are the autograd engine asking a fake tensor's device: answered here,
            # as FakeTensorMode would answer it, not passed down through the modes below (each costs about what the
            # question does), which have nothing to do with it: the accounting allocates nothing for it, and it is
            # no operation a device runs (a real tensor's device is read without a dispatch), so none is counted.
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        kwargs = kwargs or {}
        out = self._answer(func, args, kwargs)
        if self._counter is not None:
            self._counter.note(func, args, kwargs, out)
        return out

    def _answer(self, func: torch._ops.OpOverload, args: Any, kwargs: dict[str, Any]) -> Any:
        self._ops += 1
        late = self.deadline is not None and self._ops % _CLOCK_EVERY == 0 and time.monotonic() > self.deadline
        if self._over is None and late:
            self._over = "the dry run ran past its time limit"
        if self._over is not None:  # (raised again at every operation: a step that catches it still unwinds)
            raise DryRunLimit(self._over)
        if func is _READ and is_fake(args[0]):
            self.count += 1
            self._step_reads += 1
            if self._step_reads > MAX_READS:
                self._over = (
                    f"the step read more than {MAX_READS} values of fake tensors in one dry-run step: a loop on a "
                    f"tensor condition (while not done.all(): ...) never ends on placeholder values"
                )
                raise DryRunLimit(self._over)
            dtype = args[0].dtype
            return False if dtype == torch.bool else 1.0 if dtype.is_floating_point or dtype.is_complex else 1
        if func is _NONZERO and is_fake(args[0]):  # every element taken: the most memory the real mask can need
            self.count += 1
            mask = args[0]
            return torch.empty((mask.numel(), mask.dim()), dtype=torch.long, device=mask.device)
        if func is _INDEX and is_fake(args[0]) and any(_is_mask(index) for index in args[1]):
            self.count += 1  # (each mask as that many positions, one index per dim it covers, as ATen expands it)
            indices = []
            for index in args[1]:
                if _is_mask(index):
                    indices += [torch.zeros(index.numel(), dtype=torch.long, device=index.device)] * index.dim()
                else:
                    indices.append(index)
            return func(args[0], indices)
        return func(*args, **kwargs)


def _is_mask(index: torch.Tensor | None) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8)
