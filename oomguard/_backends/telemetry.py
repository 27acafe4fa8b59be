"""What the device looked like at an OOM: NVML figures, and signs of allocator fragmentation.

NVML (the ``pynvml`` module of nvidia-ml-py) tells what the whole device holds, other processes included; it is
optional and every failure degrades quietly to ``None``. Fragmentation is judged from torch's own allocator
statistics: retries of cudaMalloc after freeing the cache, or much more memory reserved than allocated.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

__all__ = ["apply_expandable_segments", "fragmentation", "nvml_snapshot"]

logger = logging.getLogger("oomguard")

EXPANDABLE = "expandable_segments:True"
_RESERVED_SLACK = 0.25  # reserved-but-unallocated above this share of the capacity counts as fragmented


def nvml_snapshot(device_index: int) -> dict[str, Any] | None:
    """Total, used and free memory of the device, and what each process on it holds; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            processes = []
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = getattr(process, "usedGpuMemory", None)
                processes.append({"pid": int(process.pid), "used": int(used) if used is not None else None})
            return {
                "total": int(info.total),
                "used": int(info.used),
                "free": int(info.free),
                "processes": processes,
                "other_processes_used": sum(p["used"] or 0 for p in processes if p["pid"] != os.getpid()),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no driver, no permission: telemetry is best effort
        return None


def fragmentation(
    stats: dict[str, Any], retries_before: int, capacity: int | None, requested: int | None
) -> dict[str, Any] | None:
    """Evidence of fragmentation in ``torch.cuda.memory_stats()`` output, or None.

    Fragmented when cudaMalloc retries climbed since the last look, or when the memory reserved but not
    allocated is larger than the failed request and a quarter of the capacity.
    """
    retries = int(stats.get("num_alloc_retries", 0))
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    slack = reserved - allocated
    climbing = retries > retries_before
    wasteful = capacity is not None and slack > _RESERVED_SLACK * capacity and slack > (requested or 0)
    if not (climbing or wasteful):
        return None
    return {
        "num_alloc_retries": retries,
        "new_retries": retries - retries_before,
        "reserved": reserved,
        "allocated": allocated,
        "reserved_not_allocated": slack,
        "recommendation": f"set PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} (or pass fix_fragmentation=True)",
    }


def apply_expandable_segments() -> bool:
    """Switch the CUDA caching allocator to expandable segments for new allocations; True if it took."""
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if EXPANDABLE in current:
        return True
    try:
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    except (AttributeError, RuntimeError) as error:
        logger.warning("oomguard: could not enable %s: %s", EXPANDABLE, error)
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"{current},{EXPANDABLE}".strip(",")
    logger.warning("oomguard: enabled %s in the CUDA allocator to curb fragmentation", EXPANDABLE)
    return True
