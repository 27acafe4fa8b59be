"""SimulatedGPU: the public face of the device-memory accounting in :mod:`oomguard._backends.accounting`.

What it counts, and what it cannot see, is told there.
"""

from __future__ import annotations

from oomguard._backends.accounting import AccountedDevice

__all__ = ["SimulatedGPU"]


class SimulatedGPU(AccountedDevice):
    """A simulated GPU of ``capacity`` bytes for training on the CPU under a device-memory budget.

    Inside the context every CPU tensor storage created counts as device memory until it is freed; going past
    the capacity raises a real ``torch.OutOfMemoryError`` whose message looks like CUDA's and says it is
    simulated. While active, :mod:`oomguard` reads memory figures, empties the cache and makes host copies
    through it, as it does through ``torch.cuda`` on a GPU.

    Limits: only CPU tensors are counted, and ``torch.compile`` does not compile under it (its dispatch mode makes
    dynamo skip the frame, and dynamo caches the skip until ``torch._dynamo.reset()``): a compiled model runs
    eagerly, with eager memory figures, and :meth:`adopt` (or the guard's first call) warns once.

    The host is simulated too: every host tensor the guard makes through it (what ``to_host`` returns: offloaded
    optimizer state and master weights, offloaded blocks, activation offload's saved tensors, the journal's copies;
    and what the optimizer's step on the host computes from them) counts as host memory until it is freed, read with
    :meth:`host_memory_allocated` and :meth:`max_host_memory_allocated` (``reset_peak_memory_stats`` resets both
    peaks). Past ``host_capacity`` a host allocation raises ``MemoryError`` naming host memory: the stand-in for the
    kernel's OOM killer, which on a real machine ends the process without an exception.
    :meth:`fail_host_allocation` makes one host allocation fail, as a failed ``cudaHostAlloc`` does.

    Args:
        capacity: bytes, or a string such as ``"6GiB"`` or ``"64MiB"``.
        host_capacity: the host memory the guard may allocate, bytes or a string (default None: counted, never
            refused); it is also the guard's host budget (``host_memory=``) while the simulation is active.
        spurious_ooms: allocate as CUDA's caching allocator can, failing now and then while the memory it needs is
            pending: the guard then tries the same plan once more after the first OOM of a call on a plan that ran
            clean, before it moves down the ladder. A fault made by :meth:`fail_allocation` is such a one-off.

    >>> import torch
    >>> from oomguard.testing import SimulatedGPU
    >>> with SimulatedGPU("1MiB") as gpu:
    ...     x = torch.zeros(1024)              # 4 KiB
    ...     gpu.memory_allocated()
    4096
    >>> with SimulatedGPU("1MiB"):
    ...     torch.zeros(10**6)                 # 4 MB: too much
    Traceback (most recent call last):
    ...
    torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.8 MiB. ... (simulated by oomguard...)
    """

    def __init__(
        self, capacity: int | str, *, host_capacity: int | str | None = None, spurious_ooms: bool = False
    ) -> None:
        super().__init__(capacity, host_capacity=host_capacity)
        #: Whether the guard takes an OOM here for one a retry may clear (see ``spurious_ooms``).
        self.spurious_ooms = spurious_ooms
