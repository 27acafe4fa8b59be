"""Telling out-of-memory errors from every other error: ``is_oom`` and ``is_fatal_device_error``."""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable

import pytest
import torch

from oomguard import is_fatal_device_error, is_oom
from oomguard._detect import is_device_oom, is_host_oom, names_an_allocator

# Python 3.11+ only; looked up at run time so the module still imports on 3.10.
ExceptionGroup = getattr(builtins, "ExceptionGroup", None)
needs_exception_groups = pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups need Python 3.11+")

CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.65 GiB total capacity; 20.81 GiB already allocated; "
    "1.21 GiB free; 21.50 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting "
    "max_split_size_mb to avoid fragmentation."
)
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
)
ILLEGAL_ACCESS = (
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported at "
    "some other API call, so the stacktrace below might be incorrect."
)
FATAL_MESSAGES = [
    pytest.param(ILLEGAL_ACCESS, id="illegal-memory-access"),
    pytest.param("CUDA error: device-side assert triggered", id="device-side-assert"),
    pytest.param("CUDA error: misaligned address", id="misaligned-address"),
    pytest.param("CUDA error: unspecified launch failure", id="unspecified-launch-failure"),
]


def raised_from(cause: BaseException, error: BaseException) -> BaseException:
    """``error`` as caught after ``raise error from cause``."""
    try:
        raise error from cause
    except BaseException as caught:  # the helper builds KeyboardInterrupt chains too
        return caught


def raised_while_handling(first: BaseException, error: BaseException) -> BaseException:
    """``error`` as caught after raising it inside ``except`` for ``first`` (so ``first`` is its context)."""
    try:
        try:
            raise first
        except BaseException:
            raise error  # noqa: B904 - the implicit __context__ is the point
    except BaseException as caught:
        return caught


OOM_CASES = [
    pytest.param(torch.OutOfMemoryError(CUDA_OOM), id="torch.OutOfMemoryError"),
    pytest.param(torch.cuda.OutOfMemoryError("CUDA out of memory."), id="torch.cuda.OutOfMemoryError"),
    pytest.param(torch.OutOfMemoryError("no message we know"), id="OutOfMemoryError-by-type-not-message"),
    pytest.param(RuntimeError(CUDA_OOM), id="cuda-caching-allocator-message"),
    pytest.param(RuntimeError("CUDA error: out of memory"), id="cuda-error-out-of-memory"),
    pytest.param(torch.AcceleratorError("CUDA error: out of memory"), id="AcceleratorError-out-of-memory"),
    pytest.param(RuntimeError("HIP out of memory. Tried to allocate 20.00 MiB (GPU 0; ...)"), id="hip"),
    pytest.param(RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB (GPU 0; ...)"), id="xpu"),
    pytest.param(
        RuntimeError(
            "MPS backend out of memory (MPS allocated: 17.74 GB, other allocations: 1.06 GB, max allowed: ...)"
        ),
        id="mps",
    ),
    pytest.param(RuntimeError(CPU_OOM), id="cpu-allocator"),
    pytest.param(
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), id="cublas"
    ),
    pytest.param(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), id="cudnn"),
    pytest.param(RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"), id="cufft"),
    pytest.param(
        RuntimeError("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`"),
        id="cusolver",
    ),
    pytest.param(
        RuntimeError("CUDA error: CUSPARSE_STATUS_ALLOC_FAILED when calling `cusparseCreate(handle)`"),
        id="cusparse",
    ),
    pytest.param(MemoryError(), id="MemoryError"),
    pytest.param(raised_from(torch.OutOfMemoryError(CUDA_OOM), ValueError("forward failed")), id="ValueError-from-OOM"),
    pytest.param(
        raised_from(RuntimeError(CPU_OOM), RuntimeError("wrapper: could not run the layer")),
        id="RuntimeError-from-cpu-OOM-message",
    ),
    pytest.param(raised_from(raised_from(MemoryError(), KeyError("k")), ValueError("outer")), id="OOM-two-links-down"),
]

NOT_OOM_CASES = [
    pytest.param(ValueError("out of memory"), id="ValueError-with-oom-message"),
    pytest.param(KeyError("out of memory"), id="KeyError-with-oom-message"),
    pytest.param(KeyError("input_ids"), id="KeyError"),
    pytest.param(RuntimeError("shape mismatch: value tensor of shape [2] cannot be broadcast"), id="shape-mismatch"),
    pytest.param(RuntimeError("Expected all tensors to be on the same device"), id="device-mismatch"),
    pytest.param(KeyboardInterrupt(), id="KeyboardInterrupt"),
    # The error raised is what counts, not the OOM it was raised while handling (a step's own fallback that
    # fails): it propagates as itself rather than being retried down the ladder. (It counted as an OOM before.)
    pytest.param(
        raised_while_handling(torch.OutOfMemoryError(CUDA_OOM), TypeError("cleanup failed")), id="OOM-as-context"
    ),
    pytest.param(
        raised_while_handling(torch.OutOfMemoryError(CUDA_OOM), ValueError("no smaller model to fall back to")),
        id="user-fallback-failing-in-its-except-block",
    ),
    pytest.param(
        raised_while_handling(torch.OutOfMemoryError(CUDA_OOM), KeyboardInterrupt()),
        id="KeyboardInterrupt-with-OOM-context",
    ),
    pytest.param(raised_from(torch.OutOfMemoryError(CUDA_OOM), SystemExit(1)), id="SystemExit-from-OOM"),
    *(pytest.param(RuntimeError(*param.values), id=f"fatal-{param.id}") for param in FATAL_MESSAGES),
    pytest.param(torch.AcceleratorError(ILLEGAL_ACCESS), id="AcceleratorError-illegal-access"),
]


@pytest.mark.parametrize("error", OOM_CASES)
def test_out_of_memory_errors_are_recognised(error: BaseException) -> None:
    assert is_oom(error) is True
    assert is_fatal_device_error(error) is False


@pytest.mark.parametrize("error", NOT_OOM_CASES)
def test_other_errors_are_not_out_of_memory(error: BaseException) -> None:
    assert is_oom(error) is False


def test_torch_cuda_out_of_memory_error_is_the_same_class() -> None:
    # Both spellings appear in user code; the guard must treat them as one.
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError


@pytest.mark.parametrize("message", FATAL_MESSAGES)
def test_fatal_device_errors_are_fatal(message: str) -> None:
    assert is_fatal_device_error(RuntimeError(message)) is True


@pytest.mark.parametrize("message", FATAL_MESSAGES)
@pytest.mark.parametrize(
    "combine",
    [
        pytest.param(lambda oom, fatal: raised_from(oom, fatal), id="fatal-from-OOM"),
        pytest.param(lambda oom, fatal: raised_from(fatal, oom), id="OOM-from-fatal"),
        pytest.param(lambda oom, fatal: raised_while_handling(fatal, oom), id="OOM-while-handling-fatal"),
        pytest.param(
            lambda oom, fatal: raised_from(raised_from(fatal, ValueError("mid")), oom), id="fatal-two-links-down"
        ),
    ],
)
def test_fatal_error_anywhere_in_the_chain_wins_over_an_oom(
    message: str, combine: Callable[[BaseException, BaseException], BaseException]
) -> None:
    error = combine(torch.OutOfMemoryError(CUDA_OOM), RuntimeError(message))
    # The chain really holds an OOM: without the fatal error it would be recoverable.
    assert is_fatal_device_error(error) is True
    assert is_oom(error) is False


def test_fatal_message_is_only_read_on_runtime_errors() -> None:
    assert is_fatal_device_error(ValueError("an illegal memory access was encountered")) is False
    assert is_fatal_device_error(torch.OutOfMemoryError(CUDA_OOM)) is False
    assert is_fatal_device_error(RuntimeError("shape mismatch")) is False


@needs_exception_groups
def test_oom_inside_an_exception_group() -> None:
    assert ExceptionGroup is not None
    group = ExceptionGroup("workers failed", [ValueError("bad row"), torch.OutOfMemoryError(CUDA_OOM)])
    assert is_oom(group) is True
    nested = ExceptionGroup("outer", [KeyError("k"), ExceptionGroup("inner", [RuntimeError(CPU_OOM)])])
    assert is_oom(nested) is True


@needs_exception_groups
def test_exception_group_without_oom_or_with_a_fatal_error() -> None:
    assert ExceptionGroup is not None
    assert is_oom(ExceptionGroup("workers failed", [ValueError("a"), KeyError("b")])) is False
    mixed = ExceptionGroup("workers failed", [torch.OutOfMemoryError(CUDA_OOM), RuntimeError(ILLEGAL_ACCESS)])
    assert is_fatal_device_error(mixed) is True
    assert is_oom(mixed) is False


@needs_exception_groups
def test_wide_exception_group_is_read_in_full() -> None:
    # LIBRARY BUG (oomguard/_detect.py, _MAX_CHAIN = 32): _chain stops after 32 exceptions, so in a group with
    # more members the fatal error is never looked at and is_oom says "retry" after an illegal memory access —
    # the one thing the module promises never to do. Cycles are already cut by the identity check, so the cap
    # buys nothing but this. (Here: 40 data-parallel workers, one of them hit an illegal memory access.)
    assert ExceptionGroup is not None
    fatal = RuntimeError(ILLEGAL_ACCESS)
    group = ExceptionGroup("workers failed", [fatal] + [torch.OutOfMemoryError(CUDA_OOM) for _ in range(40)])
    assert is_fatal_device_error(group) is True
    assert is_oom(group) is False


def test_self_referencing_cause_does_not_hang() -> None:
    error = RuntimeError("wrapper")
    error.__cause__ = error
    assert is_oom(error) is False
    assert is_fatal_device_error(error) is False

    oom = torch.OutOfMemoryError(CUDA_OOM)
    oom.__context__ = oom
    assert is_oom(oom) is True


def test_two_exceptions_causing_each_other_do_not_hang() -> None:
    first, second = ValueError("first"), RuntimeError(CPU_OOM)
    first.__cause__ = second
    second.__context__ = first
    assert is_oom(first) is True
    assert is_oom(second) is True


def test_real_cpu_allocator_failure_is_an_oom() -> None:
    # 1 PiB is beyond any machine's address space, so the CPU allocator refuses it on every platform.
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)
    assert is_oom(caught.value) is True
    assert is_fatal_device_error(caught.value) is False


def test_real_cpu_allocator_failure_wrapped_by_a_library() -> None:
    def load() -> None:
        try:
            torch.empty(2**50, dtype=torch.uint8)
        except RuntimeError as error:
            raise ValueError("could not build the embedding table") from error

    with pytest.raises(ValueError, match="embedding table") as caught:
        load()
    assert is_oom(caught.value) is True


@pytest.mark.parametrize(
    ("error", "named"),
    [
        (torch.OutOfMemoryError(CUDA_OOM), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("HIP out of memory. Tried to allocate 2.00 MiB"), True),
        (RuntimeError(CPU_OOM), True),
        (MemoryError(), True),
        (RuntimeError("out of memory"), False),
        (RuntimeError("my cache ran out of memory, giving up"), False),
    ],
)
def test_an_allocator_names_itself_where_a_bare_out_of_memory_does_not(error: BaseException, named: bool) -> None:
    assert is_oom(error)
    assert names_an_allocator(error) is named


@pytest.mark.parametrize(
    ("error", "host"),
    [
        pytest.param(MemoryError(), True, id="MemoryError"),
        pytest.param(RuntimeError(CPU_OOM), True, id="DefaultCPUAllocator"),
        pytest.param(RuntimeError("CUDA error: out of memory (cudaHostAlloc)"), True, id="cudaHostAlloc"),
        pytest.param(raised_from(MemoryError("pinned"), RuntimeError("offload failed")), True, id="host-cause"),
        pytest.param(torch.OutOfMemoryError(CUDA_OOM), False, id="device-OOM"),
        pytest.param(RuntimeError("CUDA error: out of memory"), False, id="bare-CUDA-words"),
        pytest.param(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED"), False, id="cuBLAS"),
        pytest.param(ValueError("host memory"), False, id="not-an-OOM"),
        pytest.param(RuntimeError(f"{ILLEGAL_ACCESS}\nDefaultCPUAllocator"), False, id="fatal"),
    ],
)
def test_a_host_oom_is_told_from_the_devices(error: BaseException, host: bool) -> None:
    assert is_host_oom(error) is host
    assert is_device_oom(error, separate_host=True) is (is_oom(error) and not host)
    assert is_device_oom(error, separate_host=False) is is_oom(error), "on a CPU-only run the host is the device"
