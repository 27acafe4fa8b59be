"""What a rank raises when another rank failed: small, dependency-free, shared by the step and the protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from oomguard._errors import OOMGuardError

__all__ = ["Agree", "Outcome", "PeerFailure", "PeerOutOfMemory", "peer_failure"]

Outcome = Literal["ok", "oom", "fatal"]
#: Tells the other ranks how this rank's phase went; returns the worst outcome of all ranks.
Agree = Callable[[Outcome], Outcome]


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this attempt; this rank retries with it, on the agreed plan."""


class PeerFailure(OOMGuardError):
    """Another rank failed with an error that is not an out-of-memory error; every rank stops this step."""


def peer_failure(outcome: Outcome, phase: str) -> Exception:
    """The exception a healthy rank raises when another rank's ``phase`` ended with ``outcome``."""
    if outcome == "oom":
        return PeerOutOfMemory(f"out of memory on another rank in the {phase} phase (this rank was fine)")
    return PeerFailure(
        f"another rank failed in the {phase} phase with an error that is not an out-of-memory error; this rank "
        f"stops too rather than wait for it. See that rank's log for the error."
    )
