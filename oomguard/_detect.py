"""Telling an out-of-memory error from every other error.

PyTorch raises ``torch.OutOfMemoryError`` for the CUDA caching allocator, but memory exhaustion also arrives
in disguise: a plain ``RuntimeError`` from cuBLAS or cuDNN workspaces, from HIP, XPU or MPS, from the CPU
allocator, or wrapped by a library that re-raises with ``from``. :func:`is_oom` recognises all of these and
refuses the fatal CUDA errors (an illegal memory access poisons the context: retrying would be wrong).
"""

from __future__ import annotations

import builtins
import re
from typing import Any

import torch

__all__ = ["is_device_oom", "is_fatal_device_error", "is_host_oom", "is_oom", "names_an_allocator"]

# Messages that mean "an allocation failed". Matched only on RuntimeError (and MemoryError by type), so a
# user's KeyError("out of memory") is never mistaken for one.
_ALLOCATOR_PATTERNS = re.compile(
    "|".join(
        (
            r"\b(?:CUDA|HIP|XPU|NPU|HPU)\b[^\n]*\bout of memory\b",  # caching allocators; "CUDA error: out of memory"
            r"RESOURCE_EXHAUSTED",  # XLA (TPU, and torch_xla on GPU)
            r"MPS backend out of memory",
            r"DefaultCPUAllocator: can't allocate memory",
            r"DefaultCPUAllocator: not enough memory",  # the Windows spelling
            r"CUBLAS_STATUS_ALLOC_FAILED",
            r"CUDNN_STATUS_ALLOC_FAILED",
            r"CUDNN_BACKEND_API_FAILED.*(?:alloc|memory)",
            r"CUFFT_ALLOC_FAILED",
            r"CUSOLVER_STATUS_ALLOC_FAILED",
            r"CUSPARSE_STATUS_ALLOC_FAILED",
            r"HIPBLAS_STATUS_ALLOC_FAILED",
            r"MIOPEN_STATUS_ALLOC_FAILED",
            r"hipErrorOutOfMemory",
            r"cudaErrorMemoryAllocation",
            r"Failed to allocate memory for requested buffer",  # XPU / SYCL
        )
    ),
    re.IGNORECASE,
)
# Any other "out of memory" text: an allocator somewhere, or a library's or a user's own words for it.
_OOM_PATTERNS = re.compile(rf"{_ALLOCATOR_PATTERNS.pattern}|\bout of memory\b", re.IGNORECASE)

# Messages of the host's allocators: the CPU's, and CUDA's pinned-memory one (cudaHostAlloc, the caching host
# allocator); and the words the guard's own host errors use ("host memory").
_HOST_PATTERNS = re.compile(
    r"DefaultCPUAllocator|cudaHostAlloc|CachingHostAllocator|\bpinned memory\b|\bhost memory\b", re.IGNORECASE
)

# Errors that leave the device unusable: never retried, even when an OOM is also in the chain.
_FATAL_PATTERNS = re.compile(
    "|".join(
        (
            r"illegal memory access",
            r"device-side assert",
            r"misaligned address",
            r"an illegal instruction",
            r"unspecified launch failure",
            r"uncorrectable ECC error",
            r"CUBLAS_STATUS_EXECUTION_FAILED",
            r"CUDNN_STATUS_EXECUTION_FAILED",
            r"hipErrorIllegalAddress",
        )
    ),
    re.IGNORECASE,
)

_GROUP: Any = getattr(builtins, "BaseExceptionGroup", None)  # Python 3.11+


def _chain(exc: BaseException, contexts: bool = True) -> list[BaseException]:
    """The exception, its causes and (with ``contexts``) contexts, and the members of exception groups, each once.

    A context hidden with ``raise ... from None`` is not followed: its author chose to replace it.
    """
    seen: dict[int, BaseException] = {}
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:  # cycles end here
            continue
        seen[id(current)] = current
        if _GROUP is not None and isinstance(current, _GROUP):
            todo.extend(current.exceptions)
        if current.__cause__ is not None:
            todo.append(current.__cause__)
        if contexts and current.__context__ is not None and not current.__suppress_context__:
            todo.append(current.__context__)
    return list(seen.values())


def _message_matches(exc: BaseException, pattern: re.Pattern[str]) -> bool:
    return isinstance(exc, RuntimeError) and pattern.search(str(exc)) is not None


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or anything in its chain) is a device error that makes retrying unsafe.

    >>> is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    True
    """
    return any(_message_matches(e, _FATAL_PATTERNS) for e in _chain(exc))


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error the guard may recover from.

    True for ``torch.OutOfMemoryError`` (CUDA, and any backend that raises it), for ``MemoryError``, and for
    ``RuntimeError`` messages of the HIP, XPU, MPS and CPU allocators and of cuBLAS, cuDNN, cuFFT, cuSOLVER
    and cuSPARSE allocation failures, found on ``exc`` itself or down its ``__cause__`` chain (``raise ...
    from``). The error raised is what counts: one raised *while handling* an OOM (its ``__context__``), such as
    a step's own fallback that fails, is not an OOM. False for ``KeyboardInterrupt`` and other non-``Exception``
    errors, and for any chain, contexts included, that holds a fatal device error (illegal memory access,
    device-side assert...): those leave the device unusable and must propagate.

    >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    True
    >>> is_oom(ValueError("out of memory"))  # only runtime errors are read by message
    False
    """
    if not isinstance(exc, Exception):
        return False
    if is_fatal_device_error(exc):
        return False
    return any(
        isinstance(e, (torch.OutOfMemoryError, MemoryError)) or _message_matches(e, _OOM_PATTERNS)
        for e in _chain(exc, contexts=False)
    )


def names_an_allocator(exc: BaseException) -> bool:
    """Whether an OOM is an allocator's own: an out-of-memory error type, or a message that names the device or
    library that failed (not just the words "out of memory", which a library or a user may raise for anything).

    >>> names_an_allocator(RuntimeError("CUDA error: out of memory")), names_an_allocator(RuntimeError("out of memory"))
    (True, False)
    """
    return any(
        isinstance(e, (torch.OutOfMemoryError, MemoryError)) or _message_matches(e, _ALLOCATOR_PATTERNS)
        for e in _chain(exc, contexts=False)
    )


def is_host_oom(exc: BaseException) -> bool:
    """Whether an out-of-memory error is the host's (RAM), not the device's.

    True for an :func:`is_oom` error whose chain of causes holds a ``MemoryError`` (Python's own allocator; the
    guard's failed pinned buffer, raised as one; a simulated host's limit) or a message of a host allocator
    (``DefaultCPUAllocator``, ``cudaHostAlloc``, CUDA's caching host allocator). Only meaningful where the device
    is not the host: on a CPU-only run, host memory is the device's, and the ladder relieves it as any OOM.

    >>> is_host_oom(MemoryError()), is_host_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    (True, False)
    """
    if not is_oom(exc):
        return False
    return any(
        isinstance(e, MemoryError) or _message_matches(e, _HOST_PATTERNS)  # (torch.OutOfMemoryError is no MemoryError)
        for e in _chain(exc, contexts=False)
    )


def is_device_oom(exc: BaseException, *, separate_host: bool) -> bool:
    """Whether ``exc`` is an out-of-memory error that the ladder may relieve: :func:`is_oom`, and not the host's
    (:func:`is_host_oom`) where the host is ``separate_host`` from the device (a GPU, a simulated one)."""
    return is_oom(exc) and not (separate_host and is_host_oom(exc))
