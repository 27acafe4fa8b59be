"""The optimizer step on the host: torch's per-parameter loop where the user asked for ``foreach``.

Where the offload rungs step parameters on the host (optimizer offload's copies and masters, layer offload's streamed
blocks), a ``foreach=True`` optimizer runs torch's multi-tensor path on CPU tensors: it computes each intermediate
for *every* parameter of a group before the next (Adam's ``sqrt(v)``: one more fp32 copy of the whole model, 4 bytes
a parameter of host memory at the step's peak, a quarter of what optimizer offload keeps there) and is no faster on
the CPU, which has no kernel launches to save. torch itself picks the loop for CPU tensors when ``foreach`` is left
to it. So for the optimizers whose loop and multi-tensor path give the same bits on CPU tensors (checked for each, in
``tests/test_host_step.py``), each parameter group with a parameter on the host steps with ``foreach=False``, put
back after the step; the maths and every bit of the result are the user's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from oomguard._backends.memory import MemoryBackend

__all__ = ["LOOPED_OPTIMIZERS", "host_loops"]

#: The optimizers whose per-parameter loop gives the multi-tensor path's bits on CPU tensors (torch's NAdam and
#: RAdam do not: they keep their own path).
LOOPED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.SGD,
)


@contextlib.contextmanager
def host_loops(optimizer: torch.optim.Optimizer, backend: MemoryBackend) -> Iterator[None]:
    """Around an optimizer step: ``foreach=False`` in each group that steps a parameter on the host (see the
    module), the groups as they were after it, whether it raised or not."""
    changed = []
    if backend.offloads and type(optimizer) in LOOPED_OPTIMIZERS:  # (a subclass may step otherwise: left alone)
        for group in optimizer.param_groups:
            on_host = any(p.grad is not None and not backend.is_device(p) for p in group["params"])
            if on_host and group.get("foreach") and not group.get("fused"):
                changed.append(group)
                group["foreach"] = False
    try:
        yield
    finally:
        for group in changed:
            group["foreach"] = True
