"""Repetitions a dry run need not dispatch: identical work on fake tensors, run once for many.

A step on fake tensors costs per operation dispatched, whatever the sizes. Some effects repeat the same work many
times over in one step: the chunked loss runs the head and the cross-entropy chunk after chunk, a hundred and more
chunks for a 150k-word vocabulary, each allocating and freeing the same tensors. On fake tensors one such repetition
can stand for many: each frees what it made before the next begins, so the memory of the rest is the memory of one
(the same peak, nothing left behind), and only their operations and FLOPs are missing, which the dry run counts by
``repeat``.

While :func:`eliding` is entered (the dry-run planner does, around each measured step), an effect asks
:func:`elided` for the context to run one repetition in that stands for ``times`` of them; outside it (a real step,
the simulator, the fault sweep) every repetition runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

__all__ = ["Repeat", "elided", "eliding"]

#: Entered around one repetition that stands for ``times`` of them: counts the work of the ``times - 1`` not run.
Repeat = Callable[[int], AbstractContextManager[None]]

_active: list[Repeat] = []


@contextlib.contextmanager
def eliding(repeat: Repeat) -> Iterator[None]:
    """Inside, effects may run one of many identical repetitions on fake tensors, inside ``repeat(times)``."""
    _active.append(repeat)
    try:
        yield
    finally:
        _active.remove(repeat)


def elided() -> Repeat | None:
    """The ``repeat`` of the innermost :func:`eliding` entered; None where every repetition must run."""
    return _active[-1] if _active else None
