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

    Args:
        capacity: bytes, or a string such as ``"6GiB"`` or ``"64MiB"``.

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
