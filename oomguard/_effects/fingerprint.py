"""Whether bf16 tensors on the device changed since they were last recorded, told by a checksum made there.

The master level keeps each weight's fp32 master on the host and a bf16 copy on the device. A write through
``p.data`` (weight clipping, an EMA swap) goes through an alias with a version counter of its own, so the
parameter's version does not move; comparing every weight with what was uploaded would copy 2 bytes a parameter
down every step. Instead, each tensor's bit patterns (read as int16) are multiplied by position weights and summed
per row of :data:`ROW` elements, in int64, on the device; the sums come down (8 bytes a row: 0.0001 byte a
parameter), and only the tensors whose sums changed are compared in full.

The arithmetic is exact (int16 times a weight of at most 65,521 fits int32; a row's sum fits int64), so the same
bits give the same sums however the reduction is ordered. One changed element always changes its row's sum (its
weight is not zero); so does a swap of two different elements of a row (a row's weights are all distinct); other
changes go unseen only if their integer contributions cancel exactly. The recorded sums are kept on the host: the
level adds nothing to the device's memory between steps (a small model's bf16 copies may save less than one
more allocation would cost). The products are made a block of rows at a time (16 MiB at most) and freed.
"""

from __future__ import annotations

import torch

from oomguard._backends.memory import MemoryBackend
from oomguard._detect import is_oom

__all__ = ["ROW", "Fingerprints"]

#: Elements per checksum: a prime, so the position weights ``i * 7919 mod ROW + 1`` of a row are all distinct.
ROW = 65521
_BLOCK = 64 * ROW  # elements multiplied at once: 16 MiB of int32 products at most


def _rows(size: int) -> int:
    return -(-size // ROW)  # (ceil: a last row may be short)


def _weights_like(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """The position weights of a row of ``size`` elements, where ``tensor`` lives (made from it, in place: one
    allocation, and host memory for a host tensor, fake for a fake one)."""
    positions = tensor.new_ones(min(ROW, max(size, 1)), dtype=torch.int32).cumsum_(0).sub_(1)
    return positions.mul_(7919).remainder_(ROW).add_(1)


class Fingerprints:
    """The row checksums of a list of bf16 tensors on the device: recorded after each upload (from the device, or
    from the host copies of what was uploaded), compared before the weights are used."""

    def __init__(self) -> None:
        self._sizes: list[int] = []  # the element count of each tensor recorded
        self._known: torch.Tensor | None = None  # int64 row sums as recorded, on the host
        self._fresh: torch.Tensor | None = None  # (a reusable host buffer for the sums now)
        self._ready: _Prepared | None = None  # device buffers for one record that must not allocate

    def prepare(self, tensors: list[torch.Tensor]) -> None:
        """Device buffers for the next :meth:`record` of ``tensors`` (may run out of memory), so that the record,
        made after a committed step, allocates nothing and cannot fail for want of memory."""
        self._ready = _Prepared(tensors) if tensors else None

    def release(self) -> None:
        """Free the prepared buffers (an attempt failed before its record)."""
        self._ready = None

    def record(self, tensors: list[torch.Tensor], backend: MemoryBackend) -> None:
        """Take the checksums of ``tensors`` as they are on the device now; the host reads them once a later
        comparison has synchronized. Through the prepared buffers if any (released after): should a CUDA
        reduction's own workspace not fit (the only allocation left), nothing is recorded and the next comparison
        is in full. Without them the products are allocated, and an OOM propagates with nothing recorded."""
        ready, self._ready = self._ready, None
        known, self._known, self._sizes = self._known, None, []
        sizes = [t.numel() for t in tensors]
        if not tensors:
            return
        if ready is None or ready.sizes != sizes:
            weights = _weights_like(tensors[0], max(sizes))
            sums = torch.cat([s for tensor in tensors for s in _row_sums(tensor, weights)])
        else:
            try:
                sums = ready.sums(tensors)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                return
        self._known, self._sizes = backend.to_host(sums, known), sizes

    def record_host(self, images: list[torch.Tensor]) -> None:
        """Take the checksums from ``images``, host copies of what the device tensors hold (complete: read now),
        computed on the host: no device memory, no transfer (for the rare records: applying the level, a load, a
        write found)."""
        self.forget()
        if images:
            weights = _weights_like(images[0], max(t.numel() for t in images))
            self._known = torch.cat([s for image in images for s in _row_sums(image, weights)])
            self._sizes = [t.numel() for t in images]

    def forget(self) -> None:
        """The tensors changed in a way the level did not record: the next comparison reports every one changed."""
        self._known, self._sizes = None, []

    def changed(self, tensors: list[torch.Tensor | None], backend: MemoryBackend) -> list[bool]:
        """Which of ``tensors`` (on the device) differ from their record (None: not to be checked, reported
        changed). The sums come down, 8 bytes a row, and are compared on the host."""
        known = self._known
        sizes = [t.numel() if t is not None else n for t, n in zip(tensors, self._sizes, strict=False)]
        if known is None or sizes != self._sizes or len(tensors) != len(sizes) or all(t is None for t in tensors):
            return [True] * len(tensors)
        present = next(t for t in tensors if t is not None)
        weights, device = _weights_like(present, max(sizes)), present.device
        sums = []
        for tensor, size in zip(tensors, sizes, strict=True):
            if tensor is None:  # (its rows: zeros, reported changed whatever they are)
                sums.append(torch.zeros(_rows(size), device=device, dtype=torch.int64))
            else:
                sums.extend(_row_sums(tensor, weights))
        self._fresh = backend.to_host(torch.cat(sums), self._fresh)
        backend.synchronize()  # (the sums, and the recorded ones, are complete before the host reads them)
        differ = self._fresh != known
        if not bool(differ.any()):  # (the common case: nothing was written)
            return [t is None for t in tensors]
        flags, start, found = differ.tolist(), 0, []
        for tensor, size in zip(tensors, sizes, strict=True):
            found.append(tensor is None or any(flags[start : start + _rows(size)]))
            start += _rows(size)
        return found


def _row_sums(tensor: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    """``tensor``'s bit patterns times the position weights, summed per row, a block of rows at a time (where
    ``tensor`` lives: the products and sums are allocated there)."""
    bits = tensor.detach().reshape(-1).view(torch.int16)  # (a contiguous bf16 tensor: a view, no copy)
    size = bits.numel()
    full = size // ROW * ROW
    sums = [
        (bits[b : min(full, b + _BLOCK)].view(-1, ROW) * weights).sum(dim=1, dtype=torch.int64)
        for b in range(0, full, _BLOCK)
    ]
    if full < size:  # the short last row (the whole of a tensor under ROW elements)
        sums.append((bits[full:] * weights[: size - full]).sum(dtype=torch.int64).reshape(1))
    return sums


class _Prepared:
    """Device buffers for the row sums of tensors of ``sizes`` elements: position weights, a block's products,
    the sums."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.sizes = [t.numel() for t in tensors]
        largest = max(*self.sizes, 1)
        self.weights = _weights_like(tensors[0], largest)
        self.scratch = tensors[0].new_empty(min(_BLOCK, largest), dtype=torch.int32)
        self.out = tensors[0].new_empty(sum(_rows(n) for n in self.sizes), dtype=torch.int64)

    def sums(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Every tensor's row sums into ``out`` (through ``scratch``: nothing allocated)."""
        row = 0
        for tensor in tensors:
            bits = tensor.detach().reshape(-1).view(torch.int16)
            size = bits.numel()
            full = size // ROW * ROW
            for begin in range(0, full, _BLOCK):
                block = bits[begin : min(full, begin + _BLOCK)].view(-1, ROW)
                products = self.scratch[: block.numel()].view(-1, ROW)
                torch.mul(block, self.weights, out=products)
                torch.sum(products, dim=1, dtype=torch.int64, out=self.out[row : row + block.shape[0]])
                row += block.shape[0]
            if full < size:
                products = self.scratch[: size - full]
                torch.mul(bits[full:], self.weights[: size - full], out=products)
                torch.sum(products, dim=0, keepdim=True, dtype=torch.int64, out=self.out[row : row + 1])
                row += 1
        return self.out
