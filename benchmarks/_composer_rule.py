"""A re-creation of Composer's automatic micro-batching (``device_train_microbatch_size="auto"``).

Composer (mosaicml) cannot be installed beside this project's torch (its latest release pins an older torch),
so the benchmark re-creates the rule its documentation and trainer describe, and nothing more:

* the device micro-batch size starts at the full per-device batch size;
* a batch is run as consecutive micro-batches of that size, each micro-batch's mean loss scaled by its share of
  the batch's samples before ``backward``, so the accumulated gradient is the whole batch's (global batch kept);
* an error whose message says ``CUDA out of memory`` anywhere in the step (forward, backward or the optimizer
  step) zeroes the gradients and retries **the same batch** with the micro-batch size halved;
* the size never grows back, for this batch or any later one;
* an out-of-memory error at micro-batch size 1 is fatal (a ``RuntimeError`` saying so).

Like Composer, it only retries: it does not restore optimizer state that an out-of-memory error inside
``optimizer.step()`` left half-built. Composer's other trigger, allocator thrashing (``num_alloc_retries``), has
no counterpart on a simulated device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["AutoMicrobatching", "BatchOutcome", "is_cuda_oom"]

Batch = dict[str, torch.Tensor]


def is_cuda_oom(error: BaseException) -> bool:
    """Composer's test: a ``RuntimeError`` whose message names a CUDA out-of-memory error."""
    text = str(error)
    return isinstance(error, RuntimeError) and ("CUDA out of memory" in text or "CUDA error: out of memory" in text)


@dataclass(frozen=True)
class BatchOutcome:
    """One batch trained: its loss, the OOMs it took and the seconds those failed attempts cost."""

    loss: float
    ooms: int
    seconds_lost: float
    microbatch_size: int


class AutoMicrobatching:
    """Train batches of ``device_batch_size`` samples, halving the micro-batch size on each OOM."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device_batch_size: int) -> None:
        self.model, self.optimizer = model, optimizer
        self.microbatch_size = device_batch_size
        #: Totals over every batch so far: OOMs caught and seconds spent on the attempts they ended.
        self.ooms, self.seconds_lost = 0, 0.0

    def train_batch(self, batch: Batch) -> BatchOutcome:
        """One optimizer step on ``batch``, retried with smaller micro-batches until it fits."""
        ooms, lost = 0, 0.0
        while True:
            started = time.perf_counter()
            loss = self._attempt(batch)
            if loss is not None:
                return BatchOutcome(loss, ooms, lost, self.microbatch_size)
            # Outside the ``except`` block: the error and the frames of the failed attempt are gone by now.
            self.optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - started
            ooms, lost = ooms + 1, lost + seconds
            self.ooms, self.seconds_lost = self.ooms + 1, self.seconds_lost + seconds
            self._halve()

    def _attempt(self, batch: Batch) -> float | None:
        try:
            return self._step(batch)
        except RuntimeError as error:
            if not is_cuda_oom(error):
                raise
        return None

    def _step(self, batch: Batch) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        size = int(batch["input_ids"].shape[0])
        total = 0.0
        for start in range(0, size, self.microbatch_size):
            micro = {name: tensor[start : start + self.microbatch_size] for name, tensor in batch.items()}
            share = micro["input_ids"].shape[0] / size  # sample-weighted, as Composer scales each loss
            loss = self.model(**micro).loss * share
            loss.backward()
            total += float(loss.detach())
        self.optimizer.step()
        return total

    def _halve(self) -> None:
        if self.microbatch_size == 1:
            raise RuntimeError(
                "CUDA out of memory. The train loop failed with an internal microbatch of size 1. The GPU does not "
                "have enough memory to process even 1 sample during train."
            )
        self.microbatch_size = max(self.microbatch_size // 2, 1)
