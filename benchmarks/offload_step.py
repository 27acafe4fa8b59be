"""A step on offloaded optimizer state against the same step with the state on the device, timed interleaved.

Issue 27's measure: an MLP of ``--layers`` bias-free ``--width`` x ``--width`` linear layers (batches of 2), AdamW
as the user configured it, guarded on a forced plan under :class:`oomguard.testing.SimulatedGPU` (here the device
is the CPU, so every copy is a memcpy and the figure is the host step's cost and the copies' bookkeeping, not a
link's), on one intra-op thread. Each round times one call on each plan, in alternating order, after warm-up calls;
the answer is the median of the per-round ratios (offloaded / on the device), which the machine's noise moves
least.

    python benchmarks/offload_step.py [--width 1024] [--layers 8] [--rounds 15] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _mlp import guarded_mlp

from oomguard import Plan
from oomguard.testing import SimulatedGPU

PLANS = {"device": Plan(), "optimizer_offload": Plan(optimizer_offload=True)}


def measure(width: int, layers: int, rounds: int) -> dict[str, Any]:
    batch = (torch.randn(2, width), torch.randn(2, width))
    with SimulatedGPU(64 * width * width * layers) as gpu:
        guards = {}
        for name, plan in PLANS.items():
            guard, model = guarded_mlp(plan, width, layers)
            gpu.adopt(model)
            for _ in range(3):  # (warm-up: the first step on a plan applies it and journals)
                guard(batch)
            guards[name] = guard
        seconds: dict[str, list[float]] = {name: [] for name in guards}
        for index in range(rounds):
            order = list(guards) if index % 2 == 0 else list(reversed(guards))
            for name in order:
                started = time.perf_counter()
                guards[name](batch)
                seconds[name].append(time.perf_counter() - started)
        for guard in guards.values():
            guard.close()
    ratios = [off / on for off, on in zip(seconds["optimizer_offload"], seconds["device"], strict=True)]
    return {
        "device_seconds": statistics.median(seconds["device"]),
        "offload_seconds": statistics.median(seconds["optimizer_offload"]),
        "median_ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.width, args.layers, args.rounds)
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
