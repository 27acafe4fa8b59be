"""The master level's stepped weights on their way up to the device, as the host step goes on.

The optimizer steps the fp32 masters on the host; each goes up rounded to bf16 (its image, pinned on CUDA) into
its device copy. The host step runs in buckets (:mod:`.hoststep`), and each bucket's weights go up as soon as the
step has stepped it, while the host steps the next: on CUDA a non-blocking copy from pinned memory on the compute
stream (:meth:`~oomguard._backends.memory.CudaMemory.upload`), so the link works while the host does. Nothing
waits for a copy on the host: the next forward's kernels are queued behind the copies on that stream, and the host
writes an image again only after the backward's gradients landed, which synchronizes. Under
:class:`~oomguard.testing.SimulatedGPU` and on the CPU the same calls run, each copy a memcpy. What the step did
not report (a parameter without a gradient, an optimizer whose loop the host step does not change) goes up once
the step is done, as every weight did before.

An upload before the step is committed changes only the device copy, which the level derives from the master. A
step that raises after it (the journal putting the masters back) leaves those images unlike their masters'
rounding, and resetting the attempt uploads them again (``MasterWeights._back_to_device``), as for a master
changed outside the guard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from oomguard._backends.memory import MemoryBackend, nbytes

__all__ = ["Ascent"]


class _Rising(Protocol):
    """What a halved weight keeps for its upload (see :class:`~oomguard._effects.masters._Weight`)."""

    param: torch.nn.Parameter  # its data the device copy, but while the parameter is its master
    master: torch.Tensor  # fp32, host
    image: torch.Tensor  # bf16, host: what the device copy holds once uploaded
    device: torch.Tensor | None  # the device copy, held while the parameter is its master


class Ascent:
    """The weights of one optimizer step sent up so far."""

    def __init__(self) -> None:
        self._sent: set[int] = set()  # the weights sent in this step, by identity
        self._last = 0  # bytes of the last bucket sent
        self._early = 0  # bytes sent while the step went on
        #: Bytes the last step uploaded while the host still had buckets to step (what the copies' time can hide
        #: behind: the planner's time model reads it).
        self.beside = 0

    def begin(self) -> None:
        """A step is next: nothing sent yet."""
        self._sent.clear()
        self._last = self._early = 0

    def send(self, weights: Iterable[_Rising], backend: MemoryBackend, *, in_step: bool = True) -> None:
        """Each of ``weights`` not sent yet (its master stepped): rounded into its image on the host, and copied
        into its device copy (on CUDA without waiting for the copy). ``in_step=False``: sent during backward
        (:mod:`.early`), beside no host step of the step's own."""
        sent = 0
        for weight in weights:
            if id(weight) in self._sent:
                continue
            weight.image.copy_(weight.master)  # (fp32 to bf16, on the host)
            backend.upload(weight.device if weight.device is not None else weight.param.data, weight.image)
            self._sent.add(id(weight))
            sent += nbytes(weight.image)
        if sent and in_step:
            self._early, self._last = self._early + sent, sent

    def resend(self, weights: list[_Rising], backend: MemoryBackend) -> None:
        """``weights``' step was undone (:mod:`.early`): their masters' rounding goes up again now, and they are
        sent once more when stepped again."""
        self._sent.difference_update(id(weight) for weight in weights)
        self.send(weights, backend, in_step=False)
        self._sent.difference_update(id(weight) for weight in weights)

    def finish(self, weights: Iterable[_Rising], backend: MemoryBackend) -> None:
        """The step is committed: every weight not sent yet goes up now."""
        beside = self._early - self._last  # (the last bucket's copies had no host step left beside them)
        self.send(weights, backend)
        self.beside = beside
        self.begin()
