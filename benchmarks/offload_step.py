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
import sys
from pathlib import Path
from typing import Any

import torch
from _mlp import guarded_mlp, interleaved, ratio, report

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
            guards[name] = guard
        seconds = interleaved(guards, batch, rounds)
        for guard in guards.values():
            guard.close()
    return ratio({"offload": seconds["optimizer_offload"], "device": seconds["device"]}, "offload", "device")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return report(measure(args.width, args.layers, args.rounds), args.json)


if __name__ == "__main__":
    sys.exit(main())
