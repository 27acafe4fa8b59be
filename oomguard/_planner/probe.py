"""The dry-run planner's device: unlimited, accounting every fake tensor as a simulated GPU does, and noting what a
plan's step measures (each phase's peak, the phase that first passed the budget, the host<->device bytes)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from oomguard._backends.accounting import AccountedDevice
from oomguard._backends.memory import nbytes
from oomguard._ladder.plan import Phase
from oomguard._planner.regions import BEFORE, Regions

__all__ = ["Probe"]

_UNLIMITED = 2**62


class Probe(AccountedDevice):
    """An unlimited simulated device that notes in which phase usage first passed ``budget``, and the peak of
    each phase (in each region of it, :meth:`regions`). ``phase`` must not hold the runner: the probe's storage
    finalizers outlive the dry run."""

    def __init__(self, budget: int, phase: Callable[[], Phase], micro_batch: Callable[[], int]) -> None:
        super().__init__(_UNLIMITED, name="planner", on_allocate=self._note)
        self.budget = budget
        self.per_micro_batch = self.per_step = 0  # host<->device bytes of the step measured now
        self.beside = 0  # of ``per_micro_batch``: device-to-host copies a side stream runs beside the compute
        self.crossed: Phase | None = None
        #: Peak by phase and micro-batch (a micro-batch's forward, its backward; then clipping, the optimizer step),
        #: and region of the phase (:mod:`oomguard._planner.regions`: before, inside or past the model's blocks).
        self.phase_peaks: dict[tuple[Phase, int, int], int] = {}
        self.host_peaks: dict[tuple[Phase, int, int], int] = {}  # the same of host memory
        self.host_start = 0  # host memory held when the step began
        self._host.observer = self._note_host
        self._phase_of, self._micro_batch = phase, micro_batch
        self._region: Callable[[], int] = lambda: BEFORE

    def start(self) -> int:
        """Measure a new step from here; returns what is resident now."""
        self.reset_peak_memory_stats()
        self.crossed, self.phase_peaks, self.host_peaks = None, {}, {}
        self.host_start = self.host_memory_allocated()
        self.per_micro_batch = self.per_step = self.beside = 0
        return self.memory_allocated()

    @contextlib.contextmanager
    def regions(self, blocks: Sequence[torch.nn.Module]) -> Iterator[None]:
        """Each phase's peak kept per region of it (before, inside or past ``blocks``) for what runs inside."""
        with Regions(blocks, self.pass_key).marking() as regions:
            self._region = regions
            try:
                yield
            finally:
                self._region = lambda: BEFORE

    def pass_key(self) -> tuple[Phase, int]:
        """The phase now, and the micro-batch of a forward or backward (0 for the rest)."""
        phase = self._phase_of()
        return phase, self._micro_batch() if phase in (Phase.FORWARD, Phase.BACKWARD) else 0

    def transfers(self, micro_batches_run: int, micro_batches: int) -> int:
        """Host<->device bytes of a whole step with ``micro_batches``, from a run of ``micro_batches_run``: what
        the forward and backward copied is per micro-batch, the rest (the optimizer's journal) per step."""
        return self.per_micro_batch * micro_batches // micro_batches_run + self.per_step

    def overlapped(self, micro_batches_run: int, micro_batches: int) -> int:
        """Of :meth:`transfers`, the bytes copied beside the compute: on CUDA a device-to-host copy during forward
        and backward, and the next streamed block going up (:meth:`prefetch`), run on the backend's copy stream,
        and the compute waits for none of it (for a prefetched block only when it reaches that block)."""
        return self.beside * micro_batches // micro_batches_run

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._phase_of() in (Phase.FORWARD, Phase.BACKWARD):
            self.beside += nbytes(tensor)
        self._attribute(tensor)
        return super().to_host(tensor, out)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        self._attribute(tensor)
        return super().to_device(tensor)

    def upload(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self._attribute(host)
        super().upload(device, host)

    def prefetch(self, device: torch.Tensor, host: torch.Tensor) -> Callable[[], None]:
        if self._phase_of() in (Phase.FORWARD, Phase.BACKWARD):  # (on CUDA on the copy stream, beside the compute)
            self.beside += nbytes(host)
        return super().prefetch(device, host)  # (its upload attributes the bytes)

    def _attribute(self, tensor: torch.Tensor) -> None:
        moved = nbytes(tensor)
        if self._phase_of() in (Phase.FORWARD, Phase.BACKWARD):
            self.per_micro_batch += moved
        else:
            self.per_step += moved

    def _key(self) -> tuple[Phase, int, int]:
        phase, micro_batch = self.pass_key()
        return phase, micro_batch, self._region()

    def _note_host(self, allocated: int) -> None:
        """The host ledger's observer: after every host allocation and growth."""
        key = self._key()
        self.host_peaks[key] = max(self.host_peaks.get(key, 0), allocated)

    def _note(self, allocated: int) -> None:
        """The ``on_allocate`` observer: after every allocation, and every resize of a tracked storage."""
        key = self._key()
        phase = key[0]
        self.phase_peaks[key] = max(self.phase_peaks.get(key, 0), allocated)
        if self.crossed is None and allocated > self.budget:
            self.crossed = phase
