"""The master level's device peak: what a steady step keeps on the device, in units of the model's bf16 weights.

ZeRO-Offload keeps about 2 bytes a parameter on the GPU (the bf16 weights) and a slice of the gradients on their way
down. This trains an MLP of ``--layers`` bias-free ``--width`` x ``--width`` linear layers (batches of 2: the
activations are negligible) under :class:`oomguard.testing.SimulatedGPU`, which accounts every live tensor, for
three steps on each plan, and reports the last step's device peak divided by the bf16 weights' bytes: the plain
bf16 plan (fp32 weights, gradients and Adam's moments on the device), optimizer offload's first level (fp32 weights
and gradients), and its master level (bf16 weights; each gradient leaves as backward accumulates it).

    python benchmarks/master_peak.py [--width 1024] [--layers 8] [--json out.json]

The figures are memory, not time: deterministic, so one run is the answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from _mlp import guarded_mlp

from oomguard import Plan
from oomguard.testing import SimulatedGPU

PLANS = {
    "bf16 (everything on the device)": Plan(precision="bf16"),
    "optimizer state offloaded": Plan(precision="bf16", optimizer_offload=True),
    "master weights (bf16 on the device)": Plan(precision="bf16", optimizer_offload="master"),
}


def steady_peak(plan: Plan, width: int, layers: int) -> float:
    """The third step's device peak on ``plan``, in bf16 weights."""
    guard, model = guarded_mlp(plan, width, layers)
    batch = (torch.randn(2, width), torch.randn(2, width))
    with SimulatedGPU(64 * width * width * layers) as gpu:
        gpu.adopt(model)
        for _ in range(2):
            guard(batch)
        gpu.reset_peak_memory_stats()
        guard(batch)
        peak = gpu.max_memory_allocated()
    guard.close()
    return peak / (2 * width * width * layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = {name: round(steady_peak(plan, args.width, args.layers), 3) for name, plan in PLANS.items()}
    print(f"steady device peak of a {args.layers} x {args.width}^2 MLP, in bf16 weights:")
    for name, ratio in result.items():
        print(f"  {name}: {ratio:.3f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
