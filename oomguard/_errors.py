"""The exceptions oomguard raises, all in one place.

Every error a user can meet derives from :class:`OOMGuardError` and says what happened, the state that
led there, and the fix, in one message::

    OOMGuardError
    ├── LadderExhausted          every plan on the ladder ran out of memory for this batch
    ├── RecoveryLimitExceeded    the bound on attempts or recovery time was hit first
    ├── HostMemoryError          (also MemoryError) host memory ran out: not retried down the ladder
    ├── StepRollbackError        an optimizer step failed half-way and could not be undone
    ├── BatchSplitError          (also ValueError) the batch cannot be split into micro-batches
    ├── LossError                (also TypeError) the step function returned no usable loss
    ├── NonFiniteLoss            (also FloatingPointError) the loss or gradient norm is NaN or infinite
    └── GuardConfigError         (also ValueError) the guard was configured wrongly

Out-of-memory errors themselves are never wrapped: the guard recovers from them, and everything that is
not an out-of-memory error propagates unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oomguard._backends.memory import MemorySnapshot
    from oomguard._events import FailureSummary
    from oomguard._ladder.plan import Plan

__all__ = [
    "BatchSplitError",
    "GuardConfigError",
    "HostMemoryError",
    "LadderExhausted",
    "LossError",
    "NonFiniteLoss",
    "OOMGuardError",
    "RecoveryLimitExceeded",
    "StepRollbackError",
]


class OOMGuardError(Exception):
    """Base class of every error raised by oomguard itself."""


class _GaveUp(OOMGuardError):
    """Shared shape of the two ways a guarded step can give up on a batch."""

    def __init__(
        self,
        message: str,
        *,
        step: int,
        tried: tuple[tuple[Plan, FailureSummary], ...],
        memory: MemorySnapshot,
    ) -> None:
        super().__init__(message)
        #: Index of the step (the guard's count of successful calls) that failed.
        self.step = step
        #: Each plan tried for the batch, with a summary of how it failed, in order.
        self.tried = tried
        #: Memory figures after the guard freed what the failed attempts held.
        self.memory = memory


class LadderExhausted(_GaveUp):
    """Every plan on the ladder ran out of memory for this batch.

    The model, optimizer and scheduler are exactly as they were before the call, so a caller may catch this,
    shrink the batch and call again. ``tried`` lists each plan with the error it met.
    """


class RecoveryLimitExceeded(_GaveUp):
    """The guard hit its bound on attempts (``max_attempts``) or time (``max_recovery_seconds``) for one batch.

    Like :class:`LadderExhausted`, the model, optimizer and scheduler are left as they were before the call.
    """


class HostMemoryError(_GaveUp, MemoryError):
    """Host memory (RAM) ran out during a step: a host allocation the guard made failed (a pinned buffer, the
    optimizer state or master weights moved to the host, an offloaded layer, saved activations, the step journal),
    or the host's allocator refused one.

    The guard does not move down the ladder for it: the next rungs offload more to the host. The step committed
    nothing and the guard's effects are undone, as for :class:`LadderExhausted`; the message says what ran out and
    the fix (``host_memory=``, ``quantized_optimizer`` on the ladder, fewer offloaded layers).
    """


class StepRollbackError(OOMGuardError):
    """An optimizer step ran out of memory after changing parameters and could not be rolled back.

    This can only happen on a step the guard had judged safe to run without a host-side journal (see
    ``OOMGuard(step_journal=...)``); pass ``step_journal="always"`` to make every step undoable.
    """


class BatchSplitError(OOMGuardError, ValueError):
    """The batch cannot be split along dim 0 (tensors disagree on the batch size, or no tensor at all)."""


class LossError(OOMGuardError, TypeError):
    """The step function returned something that is not a scalar loss with a gradient."""


class NonFiniteLoss(OOMGuardError, FloatingPointError):
    """The batch's loss, or its gradient norm, is NaN or infinite, so the step was not committed.

    An optimizer step on such a batch would write NaN into every weight it touches (and into Adam's moments), which
    no later step undoes. The model, optimizer and scheduler are as they were before the call: a caller may catch
    this and skip the batch. Under fp16 mixed precision the gradient scaler skips such steps itself, as torch's
    GradScaler does, and this is not raised.
    """


class GuardConfigError(OOMGuardError, ValueError):
    """The guard was given an invalid configuration (unknown rung, foreign optimizer, bad bound...)."""
