"""oomguard: keep PyTorch training alive when the GPU runs out of memory.

Decorate a forward-only training step; on an out-of-memory error the guard frees what the failed attempt
held and retries the same batch one rung down a ladder of fallbacks, starting with exact micro-batching::

    from oomguard import oom_guard

    @oom_guard(model=model, optimizer=optimizer, log_file="oomguard.jsonl")
    def train_step(batch):
        return model(**batch).loss

    for batch in loader:
        result = train_step(batch)   # one optimizer step per call, however the batch was split
"""

from oomguard._backends.memory import MemorySnapshot
from oomguard._decorator import GuardedStep, oom_guard
from oomguard._detect import is_fatal_device_error, is_oom
from oomguard._effects.base import Effect, EffectTarget, Packer
from oomguard._errors import (
    BatchSplitError,
    GuardConfigError,
    HostMemoryError,
    LadderExhausted,
    LossError,
    NonFiniteLoss,
    OOMGuardError,
    RecoveryLimitExceeded,
    StepRollbackError,
)
from oomguard._events import (
    Event,
    ExhaustedEvent,
    FailureSummary,
    FallbackEvent,
    JsonlSink,
    OOMEvent,
    PlannedEvent,
    ProgressEvent,
    RecoveredEvent,
    RelaxEvent,
    RetryEvent,
    StateFileEvent,
    TunedEvent,
)
from oomguard._guard.guard import OOMGuard
from oomguard._guard.results import GuardSummary, StepResult
from oomguard._ladder.plan import Plan
from oomguard._ladder.rungs import Rung, RungContext
from oomguard._planner.api import plan
from oomguard._planner.report import Candidate, PlanReport
from oomguard._rungs import (
    ActivationOffload,
    Amp,
    Checkpointing,
    ChunkedLoss,
    LayerOffload,
    MicroBatch,
    OptimizerOffload,
    QuantizedOptimizer,
    QuantizedWeights,
)
from oomguard._step.batch import batch_size, split_batch

__version__ = "0.1.0"

__all__ = [
    "ActivationOffload",
    "Amp",
    "BatchSplitError",
    "Candidate",
    "Checkpointing",
    "ChunkedLoss",
    "Effect",
    "EffectTarget",
    "Event",
    "ExhaustedEvent",
    "FailureSummary",
    "FallbackEvent",
    "GuardConfigError",
    "GuardSummary",
    "GuardedStep",
    "HostMemoryError",
    "JsonlSink",
    "LadderExhausted",
    "LayerOffload",
    "LossError",
    "MemorySnapshot",
    "MicroBatch",
    "NonFiniteLoss",
    "OOMEvent",
    "OOMGuard",
    "OOMGuardError",
    "OptimizerOffload",
    "Packer",
    "Plan",
    "PlanReport",
    "PlannedEvent",
    "ProgressEvent",
    "QuantizedOptimizer",
    "QuantizedWeights",
    "RecoveredEvent",
    "RecoveryLimitExceeded",
    "RelaxEvent",
    "RetryEvent",
    "Rung",
    "RungContext",
    "StateFileEvent",
    "StepResult",
    "StepRollbackError",
    "TunedEvent",
    "batch_size",
    "is_fatal_device_error",
    "is_oom",
    "oom_guard",
    "plan",
    "split_batch",
]
