"""Hooks an effect puts on the user's model that stay with the guard when the model is copied.

A module's hooks live in its hook dictionaries, so ``copy.deepcopy(model)`` and ``torch.save(model)`` copy them,
and everything they refer to: the effect, its memory backend, that backend's lock (which cannot be pickled at
all). A :class:`GuardHook` is copied as :func:`released`, a function that does nothing: the copy is the user's
model without the guard. Its :class:`Copying` (the master level's) decides beforehand what the copy of each
parameter is: ``deepcopy`` hands it the memo, in which it puts the copies it makes; pickling hands the loader
a function to call with what it needs (see :meth:`Copying.pickled`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["Autocasting", "Copying", "GuardHook", "aside", "released", "step_replaced"]


@contextlib.contextmanager
def step_replaced(optimizer: Any, step: Callable[..., Any]) -> Iterator[None]:
    """``optimizer.step`` is ``step`` for a while (an instance attribute, over the class's method or a scheduler's
    wrapper), and then as it was: the wrapper put back, or the instance attribute gone."""
    had, previous = "step" in vars(optimizer), vars(optimizer).get("step")
    optimizer.step = step
    try:
        yield
    finally:
        if had:
            optimizer.step = previous
        else:
            del optimizer.step


@contextlib.contextmanager
def aside(handles: Iterable[RemovableHandle]) -> Iterator[None]:
    """The hooks of ``handles`` out of their tables for a while (the planner's dry run must not fire an effect's
    hooks on its fakes), and each table back as it was, in its order, after."""
    tables: dict[int, tuple[dict[Any, Any], list[tuple[Any, Any]]]] = {}
    for handle in handles:
        table = handle.hooks_dict_ref()  # (a with_kwargs flag stays: keyed by an id no table holds meanwhile)
        if table is not None:
            tables.setdefault(id(table), (table, list(table.items())))
            table.pop(handle.id, None)
    try:
        yield
    finally:
        for table, items in tables.values():
            table.clear()
            table.update(items)


def released(*args: Any, **kwargs: Any) -> None:
    """A guard's hook in a copy of the model: it does nothing (the copy has no guard)."""


def _released() -> Callable[..., None]:
    """What an unpickled guard's hook becomes."""
    return released


class Copying(Protocol):
    """What an effect decides about the copies of the model it changed."""

    def deepcopied(self, memo: dict[int, Any]) -> None:
        """``copy.deepcopy`` of the model is under way: put in ``memo`` what the copy of each changed object is."""

    def pickled(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """How an unpickled copy is mended: a function of the module's top level and its arguments (the objects
        pickle restores, the model's parameters among them); it returns :func:`released`."""


class GuardHook:
    """A hook of the model that calls ``call`` and is copied as :func:`released`; the one hook given ``copying``
    also has it decide what a copy's parameters are."""

    def __init__(self, call: Callable[..., Any], copying: Copying | None = None) -> None:
        self._call = call
        self._copying = copying

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        if self._copying is not None:
            self._copying.deepcopied(memo)
        return released

    def __reduce_ex__(self, protocol: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return self._copying.pickled() if self._copying is not None else (_released, ())


class Autocasting:
    """Forwards of modules that hold the master level's bf16 weights (the model, a layer called on its own) run
    under bf16 autocast where none is on (an evaluation outside the guard's step), as the step's own do: the weights
    they meet are bf16. Inside any autocast (the step's), nothing changes. Per thread, the contexts entered."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._local = threading.local()

    def _entered(self) -> list[tuple[torch.nn.Module, Any]]:
        entered: list[tuple[torch.nn.Module, Any]] = self._local.__dict__.setdefault("entered", [])
        return entered

    def enter(self, module: torch.nn.Module) -> None:
        """``module``'s forward begins (a forward pre-hook)."""
        context = None
        if not torch.is_autocast_enabled(self.device_type):
            context = torch.autocast(self.device_type, dtype=torch.bfloat16)
            context.__enter__()  # type: ignore[no-untyped-call]
        self._entered().append((module, context))

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """``module``'s forward ended, or raised (a forward hook called always)."""
        entered = self._entered()
        if entered and entered[-1][0] is module:  # (not when a hook before ours raised before it entered)
            _, context = entered.pop()
            if context is not None:
                context.__exit__(None, None, None)

    def unwind(self) -> None:
        """An attempt begins: no autocast left entered by a forward that was interrupted."""
        entered = self._entered()
        while entered:
            _, context = entered.pop()
            if context is not None:
                context.__exit__(None, None, None)
