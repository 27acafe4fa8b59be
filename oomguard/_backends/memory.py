"""Memory backends: where the guard reads memory figures, frees the cache and makes host copies.

One backend per kind of device. :func:`current_backend` picks the one for a model: an active
:class:`oomguard.testing.SimulatedGPU` first (so the guard sees the simulated device exactly as it would see a
real one), else CUDA for a model on a GPU, else the host allocator.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from oomguard._backends.host import available_host_memory, host_in_use, host_peak, pinned_empty
from oomguard._backends.snapshot import MemorySnapshot

__all__ = [
    "CpuMemory",
    "CudaMemory",
    "MemoryBackend",
    "MemorySnapshot",
    "active_simulation",
    "bf16_supported",
    "copied",
    "copy_into",
    "current_backend",
    "pop_backend",
    "push_backend",
]


@runtime_checkable
class MemoryBackend(Protocol):
    """What the guard needs from a device's allocator."""

    name: str
    #: Whether ``memory_allocated`` and ``max_memory_allocated`` are real figures (False on plain CPU).
    tracks_allocations: bool
    #: Whether moving tensors to the host frees device memory (False on a CPU-only run: the host is the device).
    offloads: bool
    #: Bytes copied between host and device through this backend so far (``to_host``, ``to_device``, ``upload``).
    transferred_bytes: int

    def total_memory(self) -> int | None: ...
    def memory_allocated(self) -> int: ...
    def max_memory_allocated(self) -> int: ...
    def memory_reserved(self) -> int: ...
    def empty_cache(self) -> None: ...

    def reserve(self, nbytes: int) -> bool:
        """True only if ``nbytes`` of transient allocations can be made now without running out of memory."""
        ...

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of a device tensor that does not count as device memory (``out`` is reused if it fits).

        The copy may still be in flight (pinned, non-blocking on CUDA): call :meth:`synchronize` before reading
        it on the host. Copying it back to the device is ordered after it without a synchronize.
        """
        ...

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor; it counts as device memory."""
        ...

    def upload(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """Copy ``host`` into the device tensor ``device`` in place (ordered after the compute before it)."""
        ...

    def prefetch(self, device: torch.Tensor, host: torch.Tensor) -> Callable[[], None]:
        """Begin copying ``host`` into the device tensor ``device`` beside the compute; the compute that reads
        ``device`` must first call what this returns (it waits for the copy, the host does not)."""
        ...

    def is_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is device memory (what offloading can move to the host)."""
        ...

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Free (``nbytes=0``) or re-allocate a device tensor's storage in place; views of it stay valid."""
        ...

    def synchronize(self) -> None:
        """Wait for copies started by ``to_host`` to finish."""
        ...

    def fence(self) -> Callable[[], None]:
        """A wait for the copies ``to_host`` started so far (and for nothing after them): called later, in any
        thread, it returns once they are complete."""
        ...

    def reset_peak_memory_stats(self) -> None:
        """Start measuring the peak again from the current usage (the guard does so at each attempt)."""
        ...

    def identity(self) -> str:
        """What a remembered plan depends on: the device's kind, name and total memory."""
        ...

    def telemetry(self, requested: int | None) -> dict[str, Any] | None:
        """Extra figures for an OOM event (NVML, fragmentation); None where there are none."""
        ...


def snapshot(backend: MemoryBackend) -> MemorySnapshot:
    """The backend's figures now."""
    return MemorySnapshot(
        backend=backend.name,
        allocated=backend.memory_allocated(),
        reserved=backend.memory_reserved(),
        peak=backend.max_memory_allocated(),
        capacity=backend.total_memory(),
        host_allocated=host_in_use(backend),
        host_peak=host_peak(backend),
    )


class CpuMemory:
    """The host allocator, for models trained on the CPU without a simulator.

    PyTorch keeps no allocation statistics for the CPU, so the figures are zero and ``tracks_allocations`` is
    False; ``reserve`` compares with the memory the kernel reports as available.
    """

    name = "cpu"
    tracks_allocations = False
    offloads = False

    def total_memory(self) -> int | None:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        return 0

    def empty_cache(self) -> None:
        gc.collect()

    def reserve(self, nbytes: int) -> bool:
        available = available_host_memory()  # (a container's cgroup limit included)
        return available is not None and available >= nbytes

    def __init__(self) -> None:
        self.transferred_bytes = 0  # (stays 0: the host is the device, a copy crosses no link)

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return copy_into(tensor, out)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def upload(self, device: torch.Tensor, host: torch.Tensor) -> None:
        with torch.no_grad():
            device.copy_(host)

    def prefetch(self, device: torch.Tensor, host: torch.Tensor) -> Callable[[], None]:
        self.upload(device, host)
        return copied

    def is_device(self, tensor: torch.Tensor) -> bool:
        return False  # on a CPU-only run there is no device memory to free by offloading

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        tensor.untyped_storage().resize_(nbytes)

    def synchronize(self) -> None:
        return None

    def fence(self) -> Callable[[], None]:
        return copied  # (copies on the CPU are complete when they return)

    def reset_peak_memory_stats(self) -> None:
        return None

    def identity(self) -> str:
        return f"cpu:{self.total_memory()}"

    def telemetry(self, requested: int | None) -> dict[str, Any] | None:
        return None


class CudaMemory:
    """A CUDA device, read through ``torch.cuda``."""

    tracks_allocations = True
    offloads = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.name = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
        self._stream: torch.cuda.Stream | None = None  # host<->device copies run here, beside the compute
        self._retries_seen = 0  # the allocator's cudaMalloc retries at the last OOM
        self.transferred_bytes = 0

    def _copy_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        return self._stream

    def total_memory(self) -> int | None:
        _, total = torch.cuda.mem_get_info(self.device)
        return int(total)

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def empty_cache(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def reserve(self, nbytes: int) -> bool:
        # Free device memory plus what the caching allocator holds unused. Fragmentation can still make a
        # large request fail; the optimizer transaction guards that case by checking tensor versions.
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = self.memory_reserved() - self.memory_allocated()
        return int(free) + cached >= nbytes

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # On the copy stream the transfer overlaps the compute that follows. It starts once the work that
        # produced ``tensor`` is done, and record_stream keeps the allocator from reusing ``tensor``'s memory
        # before the copy has read it.
        if out is None or not _fits(tensor, out):
            out = pinned_empty(tensor.shape, tensor.dtype)  # (a failure there is host memory, and says so)
        self.transferred_bytes += nbytes(tensor) if tensor.is_cuda else 0
        stream = self._copy_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            out.copy_(tensor.detach(), non_blocking=True)
        tensor.record_stream(stream)
        return out

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        self.transferred_bytes += nbytes(tensor)
        stream, current = self._copy_stream(), torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            copy = tensor.detach().to(self.device, non_blocking=True)
        current.wait_stream(stream)  # the compute that uses the copy waits for it, not the host
        copy.record_stream(current)
        return copy

    def upload(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self.transferred_bytes += nbytes(host)
        with torch.no_grad():
            device.copy_(host, non_blocking=True)  # on the current stream: after the compute that freed ``device``

    def prefetch(self, device: torch.Tensor, host: torch.Tensor) -> Callable[[], None]:
        # On the copy stream, after the compute queued so far (``device``'s memory may have been another tensor's
        # until then); record_stream keeps the allocator from reusing it before the copy is done, should it be
        # let go unread.
        self.transferred_bytes += nbytes(host)
        stream, current = self._copy_stream(), torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream), torch.no_grad():
            device.copy_(host, non_blocking=True)
        device.record_stream(stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return functools.partial(_wait_for, event, self.device)

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        tensor.untyped_storage().resize_(nbytes)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        torch.cuda.synchronize(self.device)

    def fence(self) -> Callable[[], None]:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._copy_stream())  # (after the copies queued there, each after the compute it read)
        return event.synchronize

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def identity(self) -> str:
        return f"{torch.cuda.get_device_name(self.device)}:{self.total_memory()}"

    def telemetry(self, requested: int | None) -> dict[str, Any] | None:
        from oomguard._backends.telemetry import fragmentation, nvml_snapshot

        stats = torch.cuda.memory_stats(self.device)
        retries, self._retries_seen = self._retries_seen, int(stats.get("num_alloc_retries", 0))
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return {
            "nvml": nvml_snapshot(index),
            "fragmentation": fragmentation(stats, retries, self.total_memory(), requested),
        }


def _fits(tensor: torch.Tensor, out: torch.Tensor | None) -> bool:
    return out is not None and out.shape == tensor.shape and out.dtype == tensor.dtype


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes of a tensor's elements (what copying it moves)."""
    return tensor.numel() * tensor.element_size()


def copy_into(tensor: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out.copy_(tensor)`` when ``out`` has the right shape and dtype, else a fresh clone."""
    if out is not None and _fits(tensor, out):
        return out.copy_(tensor.detach())
    return tensor.detach().clone()


_OVERRIDES: list[MemoryBackend] = []  # active simulators, innermost last
_CPU = CpuMemory()
_CUDA: dict[torch.device, CudaMemory] = {}


def push_backend(backend: MemoryBackend) -> None:
    """Make ``backend`` the one every guard uses until :func:`pop_backend` (used by SimulatedGPU)."""
    _OVERRIDES.append(backend)


def pop_backend(backend: MemoryBackend) -> None:
    """Undo :func:`push_backend`."""
    if not _OVERRIDES or _OVERRIDES[-1] is not backend:
        raise RuntimeError("memory backends must be left in the reverse order they were entered")
    _OVERRIDES.pop()


def active_simulation() -> MemoryBackend | None:
    """The simulated device active now (the innermost), if any."""
    return _OVERRIDES[-1] if _OVERRIDES else None


def current_backend(device: torch.device) -> MemoryBackend:
    """The backend for tensors on ``device``: an active simulator, CUDA, or the host."""
    if _OVERRIDES:
        return _OVERRIDES[-1]
    if device.type == "cuda":
        backend = _CUDA.get(device)
        if backend is None:
            backend = _CUDA[device] = CudaMemory(device)
        return backend
    return _CPU


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast runs natively on ``device`` (CPU: yes; CUDA: compute capability 8.0+)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return True


def copied() -> None:
    """A wait for copies that are all complete already (what :meth:`MemoryBackend.fence` gives where copies are
    synchronous)."""


def _wait_for(event: torch.cuda.Event, device: torch.device) -> None:
    """The compute stream waits for ``event`` (a copy beside it); the host does not."""
    torch.cuda.current_stream(device).wait_event(event)
