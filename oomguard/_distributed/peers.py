"""What a rank raises when another rank failed: small, dependency-free, shared by the step and the protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from oomguard._detect import is_device_oom, is_host_oom
from oomguard._errors import OOMGuardError

__all__ = [
    "OUTCOMES",
    "Agree",
    "Outcome",
    "PeerFailure",
    "PeerOutOfMemory",
    "failure_outcome",
    "own_or_peer_failure",
    "peer_failure",
]

#: How a rank's phase went: fine; a device OOM (every rank retries on the next plan); host memory (RAM) ran out
#: where the device is not the host (every rank stops: the ladder does not relieve it); any other error.
Outcome = Literal["ok", "oom", "host", "fatal"]
#: The outcomes, best first: the ranks agree on the worst any rank had (the largest index).
OUTCOMES: tuple[Outcome, ...] = ("ok", "oom", "host", "fatal")
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


def peer_failure(outcome: Outcome, phase: str, own: Outcome = "ok") -> Exception:
    """The exception a rank raises when another rank's ``phase`` ended with ``outcome``, worse than this rank's
    ``own`` (``"ok"``: this rank was fine; ``"oom"``: it ran out of memory, and must not retry alone)."""
    if outcome == "oom":
        return PeerOutOfMemory(f"out of memory on another rank in the {phase} phase (this rank was fine)")
    mine = " (this rank ran out of memory in the same attempt, and stops with them rather than retry alone)"
    mine = mine if own == "oom" else ""
    if outcome == "host":
        return PeerFailure(
            f"another rank ran out of host memory (RAM) in the {phase} phase, not device memory; the ladder does not "
            f"relieve host memory (its next rungs offload more), so every rank stops this step and this rank "
            f"commits nothing either{mine}. That rank's HostMemoryError names its host figures and the fix."
        )
    return PeerFailure(
        f"another rank failed in the {phase} phase with an error that is not an out-of-memory error; this rank "
        f"stops too rather than wait for it{mine}. See that rank's log for the error."
    )


def own_or_peer_failure(error: Exception, own: Outcome, agreed: Outcome, phase: str) -> Exception:
    """What a rank whose ``phase`` failed with ``error`` (its ``own`` outcome) raises once the ranks agreed the worst
    of theirs (``agreed``): its own error, or, where another rank's is worse (an error the ranks do not retry beside
    this rank's out-of-memory error), :class:`PeerFailure`: the others stop, so this rank must not retry alone."""
    if OUTCOMES.index(agreed) <= OUTCOMES.index(own):
        return error
    return peer_failure(agreed, phase, own)
