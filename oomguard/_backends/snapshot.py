"""Device memory figures at one moment, as a memory backend reads them (:mod:`.memory`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from oomguard._backends.units import format_bytes

__all__ = ["MemorySnapshot"]


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory figures at one moment, in bytes (``capacity`` is ``None`` where unknown), and the host memory
    the guard holds where the backend counts it (``host_allocated``, and ``host_peak``, the most since the peaks
    were last reset, as ``peak`` is the device's; None elsewhere: CUDA does not count it)."""

    backend: str
    allocated: int
    reserved: int
    peak: int
    capacity: int | None
    host_allocated: int | None = None
    host_peak: int | None = None

    @property
    def host_held(self) -> int | None:
        """The most host memory the guard held since the peaks were reset (at an attempt's start: so after a failed
        one, what it held when it failed, which it has let go of by now); None where it is not counted."""
        return self.host_allocated if self.host_peak is None else max(self.host_peak, self.host_allocated or 0)

    @property
    def free(self) -> int | None:
        """Capacity not held by tensors, or ``None`` where the capacity is unknown."""
        return None if self.capacity is None else max(0, self.capacity - self.allocated)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """E.g. ``"60.1 MiB of 64.0 MiB in use (peak 63.9 MiB)"``."""
        return (
            f"{format_bytes(self.allocated)} of {format_bytes(self.capacity)} in use "
            f"(peak {format_bytes(self.peak)}, reserved {format_bytes(self.reserved)})"
        )
