"""What the master level's bookkeeping costs: finding writes through ``p.data``, and summing micro-batches on the host.

The level keeps fp32 master weights on the host and bf16 copies on the device. Per step it now also takes the
checksums of the bf16 weights twice on the device (before the step, to find writes that bypassed the version
counters; after the upload, as the record), and per micro-batch it moves the bf16 gradients down and adds them
into fp32 sums on the host. This times both for bf16 tensors shaped as a Llama's (hidden x 4 hidden matrices),
and sets them beside the time the level's own traffic takes over a PCIe 4.0 x16 link (25 GB/s, 4 bytes a
parameter a step).

    python benchmarks/master_weights.py [--device cpu|cuda] [--params 50e6] [--rounds 5] [--json out.json]

On the CPU the "device" is the host (a copy is a memcpy): the checksum figure is then the CPU's, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from oomguard._backends.memory import current_backend
from oomguard._effects.fingerprint import Fingerprints

PCIE_BYTES_PER_SECOND = 25e9  # PCIe 4.0 x16, what a copy between host and device reaches in practice


def weights(params: float, device: torch.device, hidden: int = 1024) -> list[torch.Tensor]:
    """bf16 matrices of hidden x 4 hidden (a Llama's MLP shape) totalling about ``params`` elements."""
    generator = torch.Generator().manual_seed(0)
    count = max(1, round(params / (4 * hidden * hidden)))
    return [torch.randn(hidden, 4 * hidden, generator=generator).to(device, torch.bfloat16) for _ in range(count)]


def timed(run: Callable[[], object], rounds: int, device: torch.device) -> float:
    """The median seconds of ``run`` over ``rounds`` (after one warm-up), synchronized on CUDA."""
    times = []
    for index in range(rounds + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(params: float, device: torch.device, rounds: int) -> dict[str, Any]:
    backend = current_backend(device)
    tensors = weights(params, device)
    count = sum(t.numel() for t in tensors)
    prints = Fingerprints()

    def record() -> None:
        prints.prepare(tensors)
        prints.record(tensors, backend)

    record()
    check = timed(lambda: prints.changed(list(tensors), backend), rounds, device)
    record_seconds = timed(record, rounds, device)
    staging = [backend.to_host(t) for t in tensors]
    sums = [torch.zeros(t.shape, dtype=torch.float32) for t in tensors]

    def accumulate() -> None:  # one micro-batch's bf16 gradients down, into fp32 sums on the host
        for tensor, buffer in zip(tensors, staging, strict=True):
            backend.to_host(tensor, buffer)
        backend.synchronize()
        for buffer, total in zip(staging, sums, strict=True):
            total.add_(buffer)

    micro_batch = timed(accumulate, rounds, device)
    link = 4 * count / PCIE_BYTES_PER_SECOND
    return {
        "device": str(device),
        "parameters": count,
        "checksums_per_step_s": check + record_seconds,
        "checksum_ns_per_parameter": 1e9 * (check + record_seconds) / count,
        "level_traffic_per_step_s_at_pcie4": link,
        "checksums_vs_traffic": (check + record_seconds) / link,
        "host_sum_per_micro_batch_s": micro_batch,
        "host_sum_ns_per_parameter": 1e9 * micro_batch / count,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args.params, torch.device(args.device), args.rounds)
    for key, value in result.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
