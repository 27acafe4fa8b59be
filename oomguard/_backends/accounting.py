"""AccountedDevice: a device-memory budget with real accounting of every live CPU tensor.

A ``TorchDispatchMode`` sees every aten op and its outputs. Each output whose storage is new (neither one of
the op's inputs' storages nor one already tracked) is a device allocation: it counts against the capacity,
rounded up to 512 bytes as CUDA's caching allocator does, until a ``weakref.finalize`` on the storage object
reports it freed. Views, ``detach`` and ``split`` share their input's storage and cost nothing.

Decisions worth knowing:

* ``torch.tensor(data)`` builds its data outside the dispatcher and arrives through ``aten.lift_fresh``: it is
  counted, as ``torch.tensor(data, device="cuda")`` would allocate on a GPU.
* Tensors created before entering, or by ``torch.from_numpy``, are host memory until ``adopt``-ed.
* An op that both mutates its inputs and allocates (batch-norm running statistics; any write-annotated op
  with fresh outputs) is sized on meta tensors *before* it runs, so an OOM leaves its inputs untouched, as a
  real device fails before the kernel. All other ops are accounted after running; failing them then is
  equivalent, since they changed nothing but their (discarded) outputs.
* ``resize_`` is checked before it runs; ``set_`` and ``out=`` variants that grow a tracked storage are
  accounted for the growth.
* Allocations inside a kernel's own implementation (scratch space a C++ kernel takes without dispatching)
  are not seen; they are transient.
* Host memory is what ``to_host`` returns (offloaded tensors, the guard's journal) and whatever an op computes
  from host tensors alone (an optimizer step on offloaded parameters): never device memory, counted against the
  host's own budget (``host_capacity``) in :mod:`oomguard._backends.hostledger`. ``to_device`` copies a host
  tensor into the device's accounting. For ``_foreach_*`` ops this is decided per list element.
* Only CPU tensors are tracked: on CUDA, backward runs in other threads that a mode would not see.

The dispatch mode and the helpers that classify ops live in :mod:`oomguard._backends.dispatch`. Users meet this
class as :class:`oomguard.testing.SimulatedGPU`; the library's own code (the planner, the demo) uses it here.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

import torch

from oomguard._backends.dispatch import (
    FRESH,
    PAUSED,
    RESIZE,
    AccountingMode,
    aligned,
    all_host,
    compiled_model_note,
    cpu_storages,
    host_outputs,
    meta_output_bytes,
    resized_bytes,
    simulated_oom,
    tensors_of,
    untracked_storages,
    writes_and_allocates,
)
from oomguard._backends.hostledger import HostFigures, HostLedger
from oomguard._backends.memory import MemorySnapshot, copied, nbytes, pop_backend, push_backend, snapshot
from oomguard._backends.units import parse_bytes

__all__ = ["AccountedDevice"]


def _release(device: weakref.ref[AccountedDevice], key: int) -> None:
    """A storage's finalizer. It holds its device weakly: the finalizer registry is a root, which would keep the
    device (and all it refers to) alive as long as the storage lives."""
    accounted = device()
    if accounted is not None:
        accounted._release(key)


_Device = TypeVar("_Device", bound="AccountedDevice")


class AccountedDevice(HostFigures):
    """A simulated device of ``capacity`` bytes: every CPU tensor storage created inside the context counts as
    device memory until it is freed; going past the capacity raises a real ``torch.OutOfMemoryError``. While
    active it is the memory backend :mod:`oomguard` reads figures from and makes host copies through.

    Args:
        capacity: bytes, or a string such as ``"6GiB"`` or ``"64MiB"``.
        host_capacity: the host memory the guard may allocate (bytes or a string; None: unlimited, still counted).
        name: a label for the device.
        on_allocate: an observer, called as ``on_allocate(allocated_bytes)`` with :meth:`memory_allocated` at
            that moment, after every successful accounting of new storages (an op's outputs, ``to_device``,
            ``adopt``, ``resize_storage``) and after every change in size of a tracked storage (a growth, or a
            shrink that releases memory). It runs on the allocating thread, outside the accounting's lock.
    """

    tracks_allocations = True
    offloads = True

    def __init__(
        self,
        capacity: int | str,
        *,
        host_capacity: int | str | None = None,
        name: str = "simulated",
        on_allocate: Callable[[int], None] | None = None,
    ) -> None:
        #: The budget in bytes.
        self.capacity = parse_bytes(capacity)
        self.host_capacity = None if host_capacity is None else parse_bytes(host_capacity)  # (None: unlimited)
        self.name = name
        #: Device allocations made so far (each new storage counts once; failed ones do not).
        self.allocations = 0
        self._allocated = 0
        self._peak = 0
        self._tracked: dict[int, int] = {}  # id(storage) -> counted bytes
        self._host = HostLedger(self.host_capacity)  # the host storages: never device memory
        self.transferred_bytes = 0  # host<->device bytes copied through to_host, to_device and upload
        self._compile_warned = False
        # Re-entrant: a storage's finalizer (_release) can run inside any allocation, the simulator's own
        # bookkeeping included, whenever the garbage collector frees a tensor there; on the same thread a plain
        # lock would deadlock.
        self._lock = threading.RLock()
        self._fail_in: int | None = None  # allocations left before an injected failure
        self._paused = PAUSED
        self._mode: AccountingMode | None = None
        self._on_allocate = on_allocate
        self.empty_cache_calls = 0

    # -- context ----------------------------------------------------------------------------------------
    def __enter__(self: _Device) -> _Device:
        if self._mode is not None:
            raise RuntimeError("this SimulatedGPU is already active; it cannot be entered twice")
        self._mode = AccountingMode(self._paused, self._before, self._account)
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        push_backend(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        finally:
            pop_backend(self)

    # -- the figures ------------------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        """Bytes held by live tensors on the simulated device."""
        return self._allocated

    def max_memory_allocated(self) -> int:
        """The highest ``memory_allocated()`` since creation or the last ``reset_peak_memory_stats()``."""
        return self._peak

    def memory_reserved(self) -> int:
        """Equal to ``memory_allocated()``: the simulator has no caching allocator."""
        return self._allocated

    def reset_peak_memory_stats(self) -> None:
        """Start measuring the peaks (the device's and the host's) again from the current usage."""
        self._peak = self._allocated
        self._host.peak = self._host.allocated

    def total_memory(self) -> int:
        return self.capacity

    def snapshot(self) -> MemorySnapshot:
        """All figures at once."""
        return snapshot(self)

    def empty_cache(self) -> None:
        """Nothing is cached in the simulator; counted so tests can see that the guard asked."""
        self.empty_cache_calls += 1

    def synchronize(self) -> None:
        return None

    def fence(self) -> Callable[[], None]:
        return copied  # (every copy is complete when it returns)

    def identity(self) -> str:
        """``"SimulatedGPU:<capacity>"``: plans remembered on one simulated size do not apply to another."""
        return f"SimulatedGPU:{self.capacity}"

    def telemetry(self, requested: int | None) -> dict[str, Any] | None:
        """The simulator has no NVML and no caching allocator to fragment."""
        return None

    # -- fault injection and reservations ---------------------------------------------------------------
    def fail_allocation(self, n: int = 1) -> None:
        """Make the ``n``-th device allocation from now raise an out-of-memory error, once (``n=1``: the very next
        allocation). Replaces any failure armed before."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fail_allocation(n) needs n >= 1 (1 = the next allocation), got {n!r}")
        self._fail_in = n

    @property
    def fault_pending(self) -> bool:
        """Whether a failure armed by :meth:`fail_allocation` has not fired yet."""
        return self._fail_in is not None

    def reserve(self, nbytes: int) -> bool:
        """Whether ``nbytes`` of transient allocations surely fit now.

        False while an injected failure is armed, on the device or on the host (``fail_host_allocation``): an
        injected fault stands for an allocation nobody could foresee, so the guard must take its fully undoable
        path. (An optimizer step on offloaded state allocates on the host as it changes that state in place.)
        """
        armed = self._fail_in is not None or self._host.fault_pending
        return not armed and self.capacity - self._allocated >= nbytes

    # -- host and device copies -------------------------------------------------------------------------
    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy outside the accounting: host memory (traffic when ``tensor`` is device memory)."""
        self.transferred_bytes += nbytes(tensor) if self.is_device(tensor) else 0
        return self._host.copy(tensor, out, self._paused)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy that counts as device memory (raises the simulated OOM if it does not fit)."""
        self.transferred_bytes += nbytes(tensor)
        with self._paused:
            copy = tensor.detach().clone()
        self._allocate([copy.untyped_storage()])
        return copy

    def upload(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """Copy a host tensor into a device tensor in place (no new storage: nothing to account but the bytes)."""
        self.transferred_bytes += nbytes(host)
        with torch.no_grad():
            device.copy_(host)

    def prefetch(self, device: torch.Tensor, host: torch.Tensor) -> Callable[[], None]:
        self.upload(device, host)  # (a memcpy, complete when it returns: nothing to wait for after it)
        return copied

    def is_device(self, tensor: torch.Tensor) -> bool:
        """Whether the tensor's storage (a wrapper subclass's: its inner tensors') is counted as device memory."""
        return bool(found := cpu_storages(tensor)) and all(id(s) in self._tracked for s in found)

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Resize a storage in place (storage resizes bypass the dispatcher, so the accounting is told here)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._host:
            self._host.resized(storage, nbytes)  # (raises first where the host has no room for the growth)
            storage.resize_(nbytes)
            return
        with self._lock:
            extra = aligned(nbytes) - self._tracked.get(key, 0)
            if extra > 0:
                self._check([extra])  # a real device fails before the storage grows
        storage.resize_(nbytes)
        if key in self._tracked:
            self._resized(storage, count_faults=False)
        else:
            self._allocate([storage], count_faults=False)

    def adopt(self, *objects: torch.nn.Module | torch.Tensor | torch.optim.Optimizer | Iterable[Any]) -> None:
        """Count already existing tensors as resident on the device, as ``model.to("cuda")`` would.

        Accepts modules (parameters, their gradients and buffers, and the quantization state of bitsandbytes 4-bit
        weights), optimizers (their state tensors), tensors and iterables of these. Storages already counted are
        skipped. Raises ``torch.OutOfMemoryError`` if they do not fit, leaving nothing adopted.
        """
        tensors: list[torch.Tensor] = []
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                self.warn_if_compiled(obj)
            tensors.extend(tensors_of(obj))
        self._allocate(untracked_storages(tensors, self._tracked), count_faults=False)

    def warn_if_compiled(self, model: torch.nn.Module) -> None:
        """Warn, once per device, that a model compiled with ``torch.compile`` runs eagerly here."""
        note = None if self._compile_warned else compiled_model_note(model)
        if note is not None:
            self._compile_warned = True
            warnings.warn(note, UserWarning, stacklevel=3)

    # -- accounting internals ---------------------------------------------------------------------------
    def _oom(self, nbytes: int, pending: int = 0) -> torch.OutOfMemoryError:
        # (``pending``: the op's outputs before this one)
        return simulated_oom(nbytes, self.capacity, self._allocated, self.capacity - self._allocated - pending)

    def _check(self, sizes: list[int], count_faults: bool = True) -> None:
        """Raise the OOM the device would raise for these allocations (made in order); track nothing."""
        total = 0
        for size in sizes:
            if count_faults and self._fail_in is not None:
                self._fail_in -= 1
                if self._fail_in == 0:
                    self._fail_in = None
                    raise self._oom(size, total)
            if self._allocated + total + size > self.capacity:
                raise self._oom(size, total)
            total += size

    def _allocate(self, storages: list[torch.UntypedStorage], count_faults: bool = True) -> None:
        # Empty storages are tracked too (at 0 bytes, not as allocations) so that a later resize_ is seen.
        sizes = [aligned(int(s.nbytes())) for s in storages]
        with self._lock:
            self._check([size for size in sizes if size], count_faults)  # all or nothing for the op
            for storage, size in zip(storages, sizes, strict=True):
                key = id(storage)
                self._tracked[key] = size
                weakref.finalize(storage, _release, weakref.ref(self), key)  # (weakly: no cycle through the registry)
            self._allocated += sum(sizes)
            self.allocations += sum(1 for size in sizes if size)
            self._peak = max(self._peak, self._allocated)
        self._notify()

    def _release(self, key: int) -> None:
        with self._lock:
            self._allocated -= self._tracked.pop(key, 0)

    def live_storages(self) -> set[int]:
        """Identities of the storages this device accounted (as device or host memory) that are still alive."""
        return {*self._tracked, *self._host}

    def _resized(self, storage: torch.UntypedStorage, count_faults: bool) -> None:
        """A tracked storage changed size (``resize_``, ``set_``, ``out=``): account the growth or the release."""
        key = id(storage)
        size = aligned(int(storage.nbytes()))
        with self._lock:
            extra = size - self._tracked[key]
            if extra > 0:  # a growth is one more device allocation
                self._check([extra], count_faults)
                self.allocations += 1
            self._tracked[key] = size
            self._allocated += extra
            self._peak = max(self._peak, self._allocated)
        self._notify()

    def _notify(self) -> None:
        # After the lock is released, as the figures this allocation left: the observer holds up no other
        # thread's accounting.
        if self._on_allocate is not None:
            self._on_allocate(self._allocated)

    def _before(self, func: torch._ops.OpOverload, args: Any, kwargs: Any) -> None:
        """Refuse an op that grows a storage or that both mutates and allocates, before it runs (see above)."""
        if func is RESIZE:
            self._check_resize(args[0], args[1])
        elif writes_and_allocates(func, args):
            self._precheck(func, args, kwargs)

    def _check_resize(self, tensor: torch.Tensor, size: Any) -> None:
        if tensor.device.type != "cpu":
            return
        needed, key = resized_bytes(tensor, size), id(tensor.untyped_storage())
        if key in self._host:  # a host tensor grows on the host (unrounded), refused before it grows
            self._host.precheck([needed - self._host.size_of(key)])
        elif aligned(needed) > (current := self._tracked.get(key, 0)):
            with self._lock:
                self._check([aligned(needed) - current])

    def _precheck(self, func: torch._ops.OpOverload, args: Any, kwargs: Any) -> None:
        on_host = self._all_host(cpu_storages((args, kwargs)))
        if on_host and self.host_capacity is None and not self._host.fault_pending:
            return  # (an unlimited host cannot refuse it)
        sizes = meta_output_bytes(func, args, kwargs)
        if sizes is None:  # no meta kernel: account after running instead
            return
        if on_host:  # the host refuses it before it mutates anything; its outputs are added once it ran
            self._host.precheck(sizes)
            return
        sizes = [aligned(size) for size in sizes]
        with self._lock:
            fail_in = self._fail_in
            self._check(sizes)  # raises before the op mutates anything
            self._fail_in = fail_in  # it fits: the accounting after the op counts these allocations again

    def _all_host(self, storages: list[torch.UntypedStorage]) -> bool:
        return all_host(storages, self._host.keys())

    def _account(self, func: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any) -> None:
        inputs = cpu_storages((args, kwargs))
        input_keys = {id(s) for s in inputs}
        on_host = self._host_outputs(func, args, out, inputs)
        fresh: dict[int, torch.UntypedStorage] = {}
        host: dict[int, torch.UntypedStorage] = {}
        for storage in cpu_storages(out):
            key = id(storage)
            if key in self._tracked:
                if aligned(int(storage.nbytes())) != self._tracked[key]:
                    self._resized(storage, count_faults=func is not RESIZE)  # resize_: checked
            elif key in self._host:
                self._host.resized(storage, int(storage.nbytes()))  # (out= and set_ may grow a host storage)
            elif key in input_keys and func not in FRESH:
                continue
            elif key in on_host:
                host[key] = storage
            else:
                fresh[key] = storage
        if host:
            self._host.add(list(host.values()))  # past the host's budget: MemoryError in place of the result
        if fresh:
            self._allocate(list(fresh.values()))

    def _host_outputs(
        self, func: torch._ops.OpOverload, args: Any, out: Any, inputs: list[torch.UntypedStorage]
    ) -> set[int]:
        return host_outputs(func, args, out, inputs, self._host.keys()) if self._host.keys() else set()
