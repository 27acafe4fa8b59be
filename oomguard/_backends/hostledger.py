"""The simulated host: the accounting of the host memory a simulated device's guard allocates.

:class:`~oomguard._backends.accounting.AccountedDevice` hands every storage it decides is host memory to one
:class:`HostLedger`: what ``to_host`` returns (offloaded optimizer state and masters, offloaded blocks, activation
offload's saved tensors, the journal's copies, the staging buffers) and whatever an op computes from host tensors
alone (the host optimizer step's moments and temporaries). Each storage counts its bytes (unrounded: the host's
allocator has no 512-byte blocks) from then until a ``weakref.finalize`` on it reports it freed, as the device's
storages do. Past ``capacity`` a host allocation raises ``MemoryError`` naming host memory, before the storage is
made where the ledger is asked first (``to_host``, a resize), else in place of the op's result: the stand-in for the
kernel's OOM killer, which on a real machine ends the process with no exception at all.

Tensors made before the simulation began (a model built on the CPU, the batch) are not the guard's and are not
counted: the ledger measures what the guard adds to the host, which is what its host budget limits.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, KeysView

import torch

from oomguard._backends.dispatch import Paused
from oomguard._backends.memory import copy_into, nbytes
from oomguard._backends.units import format_bytes

__all__ = ["HostFigures", "HostLedger", "host_oom"]


def _release(ledger: weakref.ref[HostLedger], key: int) -> None:
    """A host storage's finalizer; it holds the ledger weakly (the finalizer registry is a root)."""
    alive = ledger()
    if alive is not None:
        alive.release(key)


def host_oom(nbytes: int, in_use: int, limit: int) -> MemoryError:
    """The error the simulated host raises past its limit: what was asked, what is in use, the limit."""
    return MemoryError(
        f"host memory exhausted. Tried to allocate {format_bytes(nbytes)} of host memory with "
        f"{format_bytes(in_use)} in use, past the host limit of {format_bytes(limit)} (simulated by "
        f"oomguard.testing.SimulatedGPU(host_capacity=...); on a real machine the kernel's OOM killer would end "
        f"the process here)"
    )


class HostLedger:
    """Host storages by identity, with their bytes; a limit (``capacity``, None: unlimited), the figures and the
    peak, and an injected failure (:meth:`fail_allocation`) for tests of what the guard does when one fails."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.allocated = 0
        self.peak = 0
        #: Host allocations made so far (each new non-empty storage counts once; failed ones do not).
        self.allocations = 0
        self._tracked: dict[int, int] = {}  # id(storage) -> counted bytes
        self._fail_in: int | None = None  # host allocations left before an injected failure
        self._lock = threading.RLock()  # re-entrant: a finalizer may run inside any allocation (see accounting)
        #: Told the bytes allocated after each allocation and growth (the planner's probe keeps a peak per phase).
        self.observer: Callable[[int], None] | None = None

    def __contains__(self, key: object) -> bool:
        return key in self._tracked

    def __iter__(self) -> Iterator[int]:
        return iter(self._tracked)

    def keys(self) -> KeysView[int]:
        """The identities of the live host storages (a set-like view)."""
        return self._tracked.keys()

    def fail_allocation(self, n: int) -> None:
        """Make the ``n``-th host allocation from now fail (1: the next), once, as if the host had no room."""
        self._fail_in = n

    @property
    def fault_pending(self) -> bool:
        return self._fail_in is not None

    def check(self, sizes: Iterable[int]) -> None:
        """Raise the host's ``MemoryError`` if these allocations (made in order) do not fit; track nothing."""
        total = 0
        for size in sizes:
            if not size:
                continue  # an empty storage is no allocation, and uses up no armed failure
            if self._fail_in is not None:
                self._fail_in -= 1
                if self._fail_in == 0:
                    self._fail_in = None
                    raise MemoryError(
                        f"host memory: an allocation of {format_bytes(size)} of host memory failed (injected by "
                        f"oomguard.testing.SimulatedGPU.fail_host_allocation)"
                    )
            if self.capacity is not None and self.allocated + total + size > self.capacity:
                raise host_oom(size, self.allocated + total, self.capacity)
            total += size

    def copy(self, tensor: torch.Tensor, out: torch.Tensor | None, paused: Paused) -> torch.Tensor:
        """``tensor`` copied into ``out`` where it fits, else into a new host storage; refused before the copy is
        made where the host has no room for it. ``paused``: the device's accounting does not see the copy."""
        reused = out is not None and out.shape == tensor.shape and out.dtype == tensor.dtype
        self.check([0 if reused else nbytes(tensor)])
        with paused:
            copy = copy_into(tensor, out)
        self.add([copy.untyped_storage()], checked=True)
        return copy

    def precheck(self, sizes: list[int]) -> None:
        """:meth:`check` before an op runs, leaving an armed failure for the accounting after it to meet (once)."""
        with self._lock:
            fail_in = self._fail_in
            self.check(sizes)
            self._fail_in = fail_in

    def add(self, storages: list[torch.UntypedStorage], checked: bool = False) -> None:
        """Count these new host storages, all or none (``checked``: :meth:`check` already passed for them)."""
        fresh = {id(s): s for s in storages if id(s) not in self._tracked}
        sizes = [int(s.nbytes()) for s in fresh.values()]
        with self._lock:
            if not checked:
                self.check(sizes)
            for (key, storage), size in zip(fresh.items(), sizes, strict=True):
                self._tracked[key] = size
                weakref.finalize(storage, _release, weakref.ref(self), key)
            self.allocated += sum(sizes)
            self.allocations += sum(1 for size in sizes if size)
            self._grown()

    def size_of(self, key: int) -> int:
        """The bytes counted for the host storage ``key`` (0 if it is not one)."""
        return self._tracked.get(key, 0)

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A tracked host storage is about to become ``nbytes`` (raises first if the growth does not fit)."""
        key = id(storage)
        if key not in self._tracked:
            return
        with self._lock:
            extra = nbytes - self._tracked[key]
            if extra > 0:
                self.check([extra])
                self.allocations += 1
            self._tracked[key] = nbytes
            self.allocated += extra
            self._grown()

    def _grown(self) -> None:
        self.peak = max(self.peak, self.allocated)
        if self.observer is not None:
            self.observer(self.allocated)

    def release(self, key: int) -> None:
        with self._lock:
            self.allocated -= self._tracked.pop(key, 0)


class HostFigures:
    """The host's figures and fault injection on a simulated device (the public face of its :class:`HostLedger`)."""

    _host: HostLedger
    #: The host's budget in bytes (None: unlimited, though still counted).
    host_capacity: int | None

    def host_memory_allocated(self) -> int:
        """Bytes of host memory held by what the guard put on the host (see :mod:`oomguard._backends.hostledger`)."""
        return self._host.allocated

    def max_host_memory_allocated(self) -> int:
        """The highest ``host_memory_allocated()`` since creation or the last ``reset_peak_memory_stats()``."""
        return self._host.peak

    def host_total_memory(self) -> int | None:
        """The host's budget (``host_capacity``), or None where it is unlimited."""
        return self.host_capacity

    @property
    def host_allocations(self) -> int:
        """Host allocations made so far (each new non-empty host storage counts once; failed ones do not)."""
        return self._host.allocations

    def fail_host_allocation(self, n: int = 1) -> None:
        """Make the ``n``-th host allocation from now raise ``MemoryError``, once, as a failed pinned or pageable
        host allocation does (what :func:`oomguard._backends.host.pinned_empty` makes of a failed
        ``cudaHostAlloc``). Replaces any host failure armed before."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fail_host_allocation(n) needs n >= 1 (1 = the next host allocation), got {n!r}")
        self._host.fail_allocation(n)
