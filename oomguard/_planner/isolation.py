"""A dry run leaves nothing behind: what user code keeps is put back after the planner ran the step on fakes.

The planner runs the user's own step function on the user's own model object, with fake tensors swapped in for
its parameters and buffers (:mod:`oomguard._planner.fakes`), as many times as it has plans to measure. Whatever the
step or the model *makes and keeps* meanwhile is fake, or a placeholder read from a fake: a buffer registered
lazily in ``forward``, a constant cached as an attribute, an entry of a cache keyed by batch shape, a metric
appended to a list, a counter advanced once per fake step. Real steps after it would compute on the fakes
without an error (NaN losses, gradients with no values, checkpoints full of FakeTensors).

:class:`Kept` records, before the dry run, every place of that kind the planner can reach, and puts each back
after it, in place (so that whoever holds a reference to a dict or a list sees it restored too):

* every module of the model: its attributes, its parameter, buffer and submodule tables, its hook tables;
* the step function: its closure cells, the object a bound method is bound to, a callable object's attributes, a
  ``functools.partial``'s arguments, and the module globals its code names (and so for every function it reaches
  that way: a decorator's wrapped step, a helper in a closure);
* and, within :data:`DEPTH` steps of those, the containers (dict, list, set, deque) and plain objects their values
  hold (a trainer's metrics, a user's cache object).

Containers and objects are recorded shallowly (their entries, by identity), so recording costs one pass over
what is reachable, not a copy of it. Tensors, classes, functions' code, Python modules and oomguard's own
objects are not entered. What lies beyond (a cache in another module's globals, say) is not put back:
:func:`leftovers` then finds the fake tensors still alive and says where they are, so the guard can stop dry runs
for that step, and a real step that computes on one never commits (its loss is a FakeTensor: ``LossError``).
"""

from __future__ import annotations

import collections
import functools
import gc
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["DEPTH", "Kept", "leftovers"]

#: How far from the model's modules and the step function the record reaches into containers and objects.
DEPTH = 4
#: Containers longer than this are recorded (their entries, by identity) but not walked into: a long history, a
#: data set kept as a list. And the record stops growing past this many objects.
_WALKED, _MOST = 1024, 200_000
_MISSING = object()
#: Types whose values are not containers of user state (or are recorded another way): never entered.
_OPAQUE = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType, torch.Tensor,
           torch.dtype, torch.device, types.CodeType, types.BuiltinFunctionType, range, slice)  # fmt: skip


class Kept:
    """The state reachable from ``model`` and ``step_fn`` as it is now; :meth:`restore` puts it back.

    >>> cache = {}
    >>> def step(x):
    ...     cache[x] = "fake"
    >>> kept = Kept(torch.nn.Linear(1, 1), step)
    >>> step(1); kept.restore(); cache
    {}
    """

    def __init__(self, model: torch.nn.Module, step_fn: Callable[..., Any]) -> None:
        self._dicts: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
        self._lists: list[tuple[list[Any], list[Any]]] = []
        self._sets: list[tuple[set[Any], set[Any]]] = []
        self._deques: list[tuple[collections.deque[Any], list[Any]]] = []
        self._globals: list[tuple[dict[str, Any], str, Any]] = []
        self._seen: set[int] = set()
        for module in model.modules():
            self._visit(module, DEPTH)
        self._visit_callable(step_fn, DEPTH)

    def restore(self) -> None:
        """Every recorded table, container and global back to what it held when recorded (entries by identity)."""
        for table, name, value in self._globals:
            if value is _MISSING:
                table.pop(name, None)
            elif table.get(name, _MISSING) is not value:
                table[name] = value
        for mapping, items in self._dicts:
            if len(mapping) != len(items) or any(mapping.get(key, _MISSING) is not value for key, value in items):
                mapping.clear()
                mapping.update(items)
        for sequence, entries in self._lists:
            if len(sequence) != len(entries) or any(a is not b for a, b in zip(sequence, entries, strict=True)):
                sequence[:] = entries
        for members, saved in self._sets:
            if members != saved:
                members.clear()
                members.update(saved)
        for queue, entries in self._deques:
            if len(queue) != len(entries) or any(a is not b for a, b in zip(queue, entries, strict=True)):
                queue.clear()
                queue.extend(entries)

    # -- recording ------------------------------------------------------------------------------------
    def _visit(self, value: Any, depth: int) -> None:
        """Record ``value`` if it is a container or a plain object, and what it holds, down to ``depth``."""
        if depth < 0 or isinstance(value, _OPAQUE) or id(value) in self._seen or len(self._seen) > _MOST:
            return
        self._seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            self._visit(vars(value), depth)  # (submodules: each of the model's is visited in its own right)
        elif isinstance(value, dict):
            self._dicts.append((value, list(value.items())))
            self._visit_all(value.values(), len(value), depth - 1)
        elif isinstance(value, list):
            self._lists.append((value, list(value)))
            self._visit_all(value, len(value), depth - 1)
        elif isinstance(value, set):
            self._sets.append((value, set(value)))
        elif isinstance(value, collections.deque):
            self._deques.append((value, list(value)))
            self._visit_all(value, len(value), depth - 1)
        elif isinstance(value, (tuple, frozenset)):
            self._visit_all(value, len(value), depth - 1)
        elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            self._visit_callable(value, depth - 1)
        elif _is_user_object(value):
            self._visit(vars(value), depth - 1)

    def _visit_all(self, values: Iterable[Any], count: int, depth: int) -> None:
        if depth >= 0 and count <= _WALKED:  # (a long container is recorded, not walked: a history, a data set)
            for value in list(values):
                self._visit(value, depth)

    def _visit_callable(self, fn: Any, depth: int) -> None:
        """A function's closure cells and the globals its code names, a bound method's object, a partial's function
        and arguments, a callable object's attributes."""
        if isinstance(fn, types.MethodType):
            self._visit(fn.__self__, depth)
            fn = fn.__func__
        if isinstance(fn, functools.partial):
            self._visit_all((fn.func, fn.args, fn.keywords), 3, depth)
            return
        if not isinstance(fn, types.FunctionType):
            self._visit(fn, depth)  # a callable object: its attributes
            return
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                continue
            self._visit(contents, depth)
        table = fn.__globals__
        for name in _names(fn.__code__):
            value = table.get(name, _MISSING)
            if not isinstance(value, (types.ModuleType, types.FunctionType, type)):
                self._globals.append((table, name, value))
                self._visit(value, depth)


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` (and the code nested in it: comprehensions, lambdas) reads or writes."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _is_user_object(value: Any) -> bool:
    """Whether ``value`` is an object whose attributes may hold user state: it has a ``__dict__`` and is not
    oomguard's or torch's own (a module is entered as a module; an optimizer is rebuilt for the dry run)."""
    kind = type(value).__module__ or ""
    if kind.startswith(("oomguard", "torch", "builtins")) and not isinstance(value, functools.partial):
        return False
    return isinstance(getattr(value, "__dict__", None), dict)


def leftovers(storages: Callable[[], set[int]]) -> list[str]:
    """Where fake tensors of a dry run are still held once it is over and collected (at most five places);
    empty when ``storages()`` (the identities of the dry run's storages still alive) says none is, as usual.

    Only when something did escape are all objects searched, for the message.
    """
    gc.collect(1)  # the dry run's own reference cycles (autograd graphs, tracebacks) are young
    if not storages():
        return []
    gc.collect()
    live = storages()
    if not live:
        return []
    fakes = [o for o in gc.get_objects() if type(o) is FakeTensor and _storage_id(o) in live]
    ignored = {id(fakes)}
    return sorted({_where(fake, ignored) for fake in fakes})[:5] or ["a place the planner cannot name"]


def _storage_id(tensor: torch.Tensor) -> int | None:
    try:
        return id(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _where(target: object, ignored: set[int], depth: int = 4) -> str:
    """A short name for where ``target`` is held: ``module.global``, ``Type.attribute``, or an entry of one."""
    referrers = gc.get_referrers(target)
    ignored = {*ignored, id(referrers)}  # (this list refers to every holder too)
    for holder in referrers:
        if id(holder) in ignored or isinstance(holder, types.FrameType):
            continue
        if isinstance(holder, dict):
            key = next((k for k, v in holder.items() if v is target), None)
            if key is None:
                continue
            owner = _owner_of(holder)
            if owner is not None:
                return f"{owner}.{key}"
            if depth > 1:
                return f"{_where(holder, ignored, depth - 1)}[{key!r}]"
        elif isinstance(holder, (list, tuple, collections.deque, set)) and depth > 1:
            return f"an entry of {_where(holder, ignored, depth - 1)}"
    return f"a {type(target).__name__}"


def _owner_of(table: dict[Any, Any]) -> str | None:
    """The name of the object or Python module whose attribute table ``table`` is."""
    name = table.get("__name__")
    if isinstance(name, str) and getattr(sys.modules.get(name), "__dict__", None) is table:
        return name
    for holder in gc.get_referrers(table):
        if getattr(holder, "__dict__", None) is table:
            return type(holder).__name__
    return None
