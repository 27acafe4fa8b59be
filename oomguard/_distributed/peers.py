"""What a rank raises when another rank failed: small, dependency-free, shared by the step and the protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from oomguard._detect import is_device_oom, is_host_oom
from oomguard._errors import OOMGuardError

__all__ = ["Agree", "Outcome", "PeerFailure", "PeerOutOfMemory", "failure_outcome", "peer_failure"]

#: How a rank's phase went: fine; a device OOM (every rank retries on the next plan); host memory (RAM) ran out
#: where the device is not the host (every rank stops: the ladder does not relieve it); any other error.
Outcome = Literal["ok", "oom", "host", "fatal"]
#: Tells the other ranks how this rank's phase went; returns the worst outcome of all ranks.
Agree = Callable[[Outcome], Outcome]


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this attempt; this rank retries with it, on the agreed plan."""


class PeerFailure(OOMGuardError):
    """Another rank failed with an error the ranks do not retry (one that is not an out-of-memory error, or its
    host memory ran out); every rank stops this step."""


def failure_outcome(exc: BaseException, separate_host: bool) -> Outcome:
    """What a rank tells the others of its failure ``exc`` (``separate_host``: the device is not the host)."""
    if is_device_oom(exc, separate_host=separate_host):
        return "oom"
    return "host" if separate_host and is_host_oom(exc) else "fatal"


def peer_failure(outcome: Outcome, phase: str) -> Exception:
    """The exception a healthy rank raises when another rank's ``phase`` ended with ``outcome``."""
    if outcome == "oom":
        return PeerOutOfMemory(f"out of memory on another rank in the {phase} phase (this rank was fine)")
    if outcome == "host":
        return PeerFailure(
            f"another rank ran out of host memory (RAM) in the {phase} phase, not device memory; the ladder does not "
            f"relieve host memory (its next rungs offload more), so every rank stops this step and this rank "
            f"commits nothing either. That rank's HostMemoryError names its host figures and the fix."
        )
    return PeerFailure(
        f"another rank failed in the {phase} phase with an error that is not an out-of-memory error; this rank "
        f"stops too rather than wait for it. See that rank's log for the error."
    )
