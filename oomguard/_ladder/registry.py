"""The registry of built-in rungs: the one list everything that names, orders, describes or composes rungs loops
over.

A built-in rung is registered once (``oomguard/_rungs/__init__.py`` registers the package's own, one line each,
with :func:`oomguard._ladder.rungs.register`): its class declares everything else (see
:class:`~oomguard._ladder.rungs.Rung`). The registry keeps them in their *canonical order*: each rung declares the
rung it follows (``after``), and is placed right behind it. That order is the default ladder (less the ``opt_in``
rungs), the order of :meth:`Plan.describe` and :meth:`Plan.rungs`, of the ranks' agreement and of the report.

This module imports nothing of the package, so that the plan and the rungs may both ask it: it knows a rung by
the few attributes it reads (:class:`Registered`); :mod:`oomguard._ladder.rungs` gives the typed view.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, overload

__all__ = ["BUILTIN_RUNGS", "Registered", "add", "default_ladder", "entries", "find", "in_field", "remove"]


class Registered(Protocol):
    """What the registry and the plan read of a registered rung (a :class:`~oomguard._ladder.rungs.Rung`)."""

    @property
    def name(self) -> str: ...

    @property
    def field(self) -> str | None: ...

    @property
    def after(self) -> str | None: ...

    @property
    def opt_in(self) -> bool: ...

    @property
    def sizing(self) -> bool: ...

    def level(self, plan: Any, batch_size: int) -> int: ...

    def describe(self, plan: Any, batch_size: int | None) -> str | None: ...


_RUNGS: list[Registered] = []  # one default instance of each registered rung class, in canonical order


def add(rung: Registered) -> None:
    """Register ``rung`` right after the rung it declares it follows (see :func:`oomguard._ladder.rungs.register`)."""
    if find(rung.name) is not None:
        raise ValueError(f"a rung named {rung.name!r} is registered already: give the new rung its own name")
    if rung.after is None:
        place = 0  # (the first rung: micro-batching)
    elif find(rung.after) is None:
        raise ValueError(
            f"rung {rung.name!r} follows {rung.after!r}, which is not registered: register {rung.after!r} first"
        )
    else:
        place = 1 + next(index for index, known in enumerate(_RUNGS) if known.name == rung.after)
    _RUNGS.insert(place, rung)


def remove(name: str) -> None:
    """Take the rung ``name`` off the registry (a test's rung, once the test is over)."""
    _RUNGS[:] = [rung for rung in _RUNGS if rung.name != name]


def entries() -> tuple[Registered, ...]:
    """Every registered rung, in canonical order."""
    return tuple(_RUNGS)


def find(name: str) -> Registered | None:
    """The registered rung ``name`` (its default instance), None if no built-in rung has that name."""
    return next((rung for rung in _RUNGS if rung.name == name), None)


def in_field(name: str) -> bool:
    """Whether ``name`` is a built-in rung that keeps its level in a field of the plan (then ``Plan.extras`` may
    not hold it); a rung without a field of its own keeps it in ``extras``, under its name."""
    rung = find(name)
    return rung is not None and rung.field is not None


def default_ladder() -> tuple[str, ...]:
    """The rungs a guard escalates to when ``ladder=`` is not given: every built-in rung that is not opt-in."""
    return tuple(rung.name for rung in _RUNGS if not rung.opt_in)


class _Names(Sequence[str]):
    """The names of the registered rungs, in canonical order, read when used (a rung registered later is in)."""

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        names = tuple(rung.name for rung in _RUNGS)
        return names[index]  # (a slice is a tuple, as the names were before they were read live)

    def __len__(self) -> int:
        return len(_RUNGS)

    def __iter__(self) -> Iterator[str]:
        return iter([rung.name for rung in _RUNGS])

    def __contains__(self, name: object) -> bool:
        return any(rung.name == name for rung in _RUNGS)

    def __repr__(self) -> str:
        return repr(tuple(self))


#: The built-in rungs' names, in canonical order (a live view of the registry).
BUILTIN_RUNGS: Sequence[str] = _Names()
