"""Test doubles for training without a GPU, shipped with the library for users' tests and ours.

:class:`SimulatedGPU` runs real PyTorch training on the CPU under a device-memory budget, with real
``torch.OutOfMemoryError``\\ s, so OOM recovery can be tested anywhere::

    from oomguard.testing import SimulatedGPU

    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)                    # the weights are already "on the device"
        result = train_step(batch)          # OOMs happen, and are recovered from, for real
        print(gpu.max_memory_allocated())
"""

from oomguard._backends.units import parse_bytes
from oomguard.testing._simulated import SimulatedGPU

__all__ = ["SimulatedGPU", "parse_bytes"]
