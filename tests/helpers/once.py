"""Expensive jobs that several tests read (a two-rank job, the demo), run once per test process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_DONE: dict[str, Any] = {}


def once(name: str, run: Callable[[], T]) -> T:
    """``run()``'s result, computed the first time this process asks for ``name`` and kept for the session.

    A module-scoped fixture alone does not give that under pytest-xdist: a worker tears a module's fixtures down
    whenever the next test in its queue comes from another module, and the job behind the fixture runs again for the
    module's next test (in ``make test`` every two-rank job and the demo ran twice so). A fixture that returns
    ``once(...)`` runs its job once. A job that fails is not kept: the next test that needs it runs it again.
    """
    if name not in _DONE:
        _DONE[name] = run()
    return _DONE[name]  # type: ignore[no-any-return]
