"""Simulated devices that tell a test what they allocate."""

from __future__ import annotations

from oomguard.testing import SimulatedGPU


class CountingGPU(SimulatedGPU):
    """A SimulatedGPU that calls :meth:`counted` whenever its allocation count grows, from inside its own
    bookkeeping (the count is a plain attribute the simulator increments)."""

    def __init__(self, capacity: int | str) -> None:
        self._count = 0
        super().__init__(capacity)

    @property
    def allocations(self) -> int:
        return self._count

    @allocations.setter
    def allocations(self, value: int) -> None:
        before, self._count = self._count, value
        self.counted(before, value)

    def counted(self, before: int, after: int) -> None:
        """Allocations ``before + 1`` to ``after`` were just made."""
