"""The host's memory: how much of it the guard may use (its host budget), and its pinned allocations.

Every offload rung moves memory from the device to the host. Past the host's RAM, Linux's OOM killer ends the
process with SIGKILL: no exception, nothing saved. So the guard has a host budget, as it has a device one:

* ``host_memory=`` (bytes or ``"16GiB"``), where the user says it; taken as given.
* Under :class:`oomguard.testing.SimulatedGPU`, the simulated host's limit (``host_capacity``; None: unlimited).
* Otherwise what the operating system says is available at the guard's first call, less a margin
  (:data:`HOST_MARGIN_FRACTION` of it or :data:`HOST_MARGIN_MIN_BYTES`, whichever is larger): ``MemAvailable``
  from ``/proc/meminfo``, capped by the headroom of the process's cgroup inside a container (v2 ``memory.max``
  less ``memory.current``; v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``), or psutil's
  ``available`` where there is no ``/proc`` (macOS). None where nothing can be read.

Why a margin: ``MemAvailable`` is the kernel's estimate of what could be handed out without swapping, not a
promise (part of the page cache it counts cannot be dropped); the rest of the job keeps growing after the first
call (data-loader workers, the Python heap, the CUDA context); and CUDA's pinned-memory allocator rounds each
block up to a power of two, so pinned buffers can take up to twice the bytes asked. A tenth, or 1 GiB on a small
machine, keeps those from turning into a SIGKILL; ``host_memory=`` overrides it.

The guard's pinned allocations go through :func:`pinned_empty`, which says a failed ``cudaHostAlloc`` is host
memory: CUDA reports it as ``"CUDA error: out of memory"``, the same words as a device OOM.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from oomguard._backends.units import GiB, format_bytes
from oomguard._detect import is_oom

__all__ = [
    "HOST_MARGIN_FRACTION",
    "HOST_MARGIN_MIN_BYTES",
    "HostAllocationError",
    "available_host_memory",
    "host_budget",
    "host_in_use",
    "host_margin",
    "host_peak",
    "machine_host_budget",
    "pinned_empty",
    "total_host_memory",
]

#: The share of the available host memory the default budget leaves free (see the module for why).
HOST_MARGIN_FRACTION = 0.10
#: The least the default budget leaves free, in bytes.
HOST_MARGIN_MIN_BYTES = 1 * GiB
# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages): anything past 2**60 is no limit.
_NO_LIMIT = 2**60


class HostAllocationError(MemoryError):
    """A host allocation the guard made failed (a pinned buffer's ``cudaHostAlloc``): host memory, not the
    device's, whatever words the failure used. The original error is its ``__cause__``."""


class _HostBudgeted(Protocol):
    """What :func:`host_budget` reads of the guard's options."""

    @property
    def host_bytes(self) -> int | None: ...


@runtime_checkable
class _CountedHost(Protocol):
    """A backend that counts the host memory the guard holds (:class:`oomguard.testing.SimulatedGPU`)."""

    def host_memory_allocated(self) -> int: ...
    def max_host_memory_allocated(self) -> int: ...


def host_in_use(backend: object) -> int | None:
    """The host memory the guard holds now, where ``backend`` counts it (a simulated host); None elsewhere (CUDA
    does not count the host allocations of one process)."""
    return backend.host_memory_allocated() if isinstance(backend, _CountedHost) else None


def host_peak(backend: object) -> int | None:
    """The peak of :func:`host_in_use` since the backend's peaks were last reset; None where it is not counted."""
    return backend.max_host_memory_allocated() if isinstance(backend, _CountedHost) else None


@runtime_checkable
class _SimulatedHost(Protocol):
    """A backend that simulates the host as well (:class:`oomguard.testing.SimulatedGPU`)."""

    def host_total_memory(self) -> int | None: ...


def host_budget(options: _HostBudgeted, backend: object, root: Path = Path("/")) -> int | None:
    """The host memory the guard may use, in bytes: ``host_memory=``, else a simulated host's limit, else the OS's
    available memory less the margin (see the module); None where it is unlimited or cannot be read. ``root``:
    where ``/proc`` and ``/sys`` are found (tests give a fake tree)."""
    if options.host_bytes is not None:
        return options.host_bytes
    if isinstance(backend, _SimulatedHost):  # a simulated host: its own limit (None: unlimited)
        return backend.host_total_memory()
    return machine_host_budget(root)


def machine_host_budget(root: Path = Path("/")) -> int | None:
    """This machine's share of :func:`host_budget`: what the OS says is available less the margin (see the module);
    None where nothing can be read. ``oomguard plan`` plans for it where ``--host-memory`` is not given."""
    available = available_host_memory(root)
    if available is None:
        return None
    return max(0, available - host_margin(available))


def total_host_memory(root: Path = Path("/")) -> int | None:
    """Bytes of host memory this machine has, whatever is in use now: ``MemTotal`` capped by the cgroup's limit
    (psutil's ``total`` where there is no ``/proc/meminfo``); None where neither can be read. A figure that does not
    move from run to run, for ``oomguard plan``'s default host budget (the guard's own is what is available)."""
    found = [figure for figure in (_meminfo(root, "MemTotal:"),) if figure is not None]
    found += [min(limit for limit, _ in limits) for limits in [_cgroup_limits(root)] if limits]
    if not (root / "proc" / "meminfo").exists():
        found += [figure for figure in (_psutil_figure("total"),) if figure is not None]
    return min(found) if found else None


def host_margin(nbytes: int) -> int:
    """What a host budget taken from ``nbytes`` of host memory leaves free: :data:`HOST_MARGIN_FRACTION` of it or
    :data:`HOST_MARGIN_MIN_BYTES`, whichever is larger (see the module for why)."""
    return max(int(nbytes * HOST_MARGIN_FRACTION), HOST_MARGIN_MIN_BYTES)


def available_host_memory(root: Path = Path("/")) -> int | None:
    """Bytes of host memory this process could still allocate: ``MemAvailable`` capped by the cgroup's headroom
    (psutil's ``available`` where there is no ``/proc/meminfo``); None where neither can be read."""
    found = [figure for figure in (_meminfo(root, "MemAvailable:"), _cgroup_headroom(root)) if figure is not None]
    if not (root / "proc" / "meminfo").exists():
        found += [figure for figure in (_psutil_available(),) if figure is not None]
    return min(found) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _number(path: Path) -> int | None:
    """A cgroup file's number; None for ``max`` (v2's "no limit"), a v1 "no limit", or a file that is not there."""
    text = _read(path)
    if text is None or not text.isdigit():
        return None
    value = int(text)
    return None if value >= _NO_LIMIT else value


def _meminfo(root: Path, name: str) -> int | None:
    """A figure of ``/proc/meminfo`` (``"MemAvailable:"``, ``"MemTotal:"``; in kB there), in bytes."""
    text = _read(root / "proc" / "meminfo")
    for line in (text or "").splitlines():
        fields = line.split()
        if fields[:1] == [name] and len(fields) >= 2 and fields[1].isdigit():
            return int(fields[1]) * 1024
    return None


def _cgroup_headroom(root: Path) -> int | None:
    """The least headroom (limit less usage) of the process's memory cgroup and its parents, v2 or v1; None where
    no limit is set. Inside a container ``/sys/fs/cgroup`` is the container's own cgroup, so its root counts."""
    headrooms = [max(0, limit - usage) for limit, usage in _cgroup_limits(root)]
    return min(headrooms) if headrooms else None


def _cgroup_limits(root: Path) -> list[tuple[int, int]]:
    """The memory limit and the usage of each level of the process's cgroup that sets a limit (see
    :func:`_cgroup_headroom`)."""
    base = root / "sys" / "fs" / "cgroup"
    v2, v1 = _own_cgroup(root)
    levels: list[tuple[Path, str, str]] = []
    if (base / "cgroup.controllers").exists():  # the unified (v2) hierarchy
        levels = [(d, "memory.max", "memory.current") for d in _upwards(base, v2)]
    elif (base / "memory").is_dir():  # v1: the memory controller's own hierarchy
        levels = [(d, "memory.limit_in_bytes", "memory.usage_in_bytes") for d in _upwards(base / "memory", v1)]
    limits = []
    for directory, limit_file, usage_file in levels:
        limit = _number(directory / limit_file)
        if limit is not None:
            limits.append((limit, _number(directory / usage_file) or 0))
    return limits


def _own_cgroup(root: Path) -> tuple[str, str]:
    """The process's v2 cgroup path and its v1 memory cgroup path, from ``/proc/self/cgroup`` ("" where none)."""
    v2 = v1 = ""
    for line in (_read(root / "proc" / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _upwards(base: Path, own: str) -> list[Path]:
    """``base/own`` and each of its parents up to ``base`` (the limits of every level apply), where they exist."""
    parts = [part for part in own.split("/") if part and part != ".."]
    levels = [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [level for level in levels if level.is_dir()]


def _psutil_figure(name: str) -> int | None:
    """psutil's ``virtual_memory().<name>`` (``available``, ``total``) where psutil is installed (it reads macOS's
    and Windows' own)."""
    try:
        psutil = importlib.import_module("psutil")
        return int(getattr(psutil.virtual_memory(), name))
    except Exception:  # not installed, or it cannot read this platform: no figure
        return None


def _psutil_available() -> int | None:
    return _psutil_figure("available")


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised pinned (page-locked) host tensor, for copies that overlap the compute.

    A failed ``cudaHostAlloc`` reads ``"CUDA error: out of memory"``, which would pass for a device OOM and send the
    guard down the ladder toward yet more offloading: it is raised as :class:`HostAllocationError` instead.
    """
    try:
        return torch.empty(tuple(shape), dtype=dtype, device="cpu", pin_memory=True)
    except RuntimeError as exc:
        if not is_oom(exc):
            raise
        wanted = format_bytes(torch.Size(shape).numel() * dtype.itemsize)
        raise HostAllocationError(
            f"host memory: a pinned host buffer of {wanted} could not be allocated ({str(exc).strip()[:200]})"
        ) from exc
