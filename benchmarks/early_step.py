"""The master level's host step begun during the last backward against the same step after backward, timed interleaved.

Issue 27's overlap of the host step with backward (``oomguard/_effects/early.py``): an MLP of ``--layers`` bias-free
``--width`` x ``--width`` linear layers (batches of ``--batch``), AdamW as the user configured it, guarded on
``Plan(precision="bf16", optimizer_offload="master")`` under :class:`oomguard.testing.SimulatedGPU`, twice: the
step begun during backward (the default) and the step after backward (``step_journal="never"``, as the early step
needs a journal to be undoable; in the steady state, where the step takes the fast path, nothing else differs).
Here the device is the CPU: the host thread and the backward share this machine's cores, and the journal the early
step writes first is real host work, so the figure is what the overlap gains (or costs) on this host, not on a
GPU. Each round times one call of each, in alternating order, after warm-up calls; the answer is the median of the
per-round ratios (begun during backward / after).

    python benchmarks/early_step.py [--width 1024] [--layers 8] [--batch 64] [--rounds 15] [--json out.json]
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

MASTER = Plan(precision="bf16", optimizer_offload="master")


def measure(width: int, layers: int, batch_size: int, rounds: int) -> dict[str, Any]:
    batch = (torch.randn(batch_size, width), torch.randn(batch_size, width))
    with SimulatedGPU(64 * width * width * layers) as gpu:
        guards = {}
        for name in ("early", "after"):
            guard, model = guarded_mlp(MASTER, width, layers, step_journal="auto" if name == "early" else "never")
            gpu.adopt(model)
            guards[name] = guard
        seconds = interleaved(guards, batch, rounds)
        stepped = guards["early"].effects.stepped_early  # (elements of the last step stepped during backward)
        for guard in guards.values():
            guard.close()
    return {**ratio(seconds, "early", "after"), "stepped_early": stepped, "parameters": width * width * layers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    return report(measure(args.width, args.layers, args.batch, args.rounds), args.json)


if __name__ == "__main__":
    sys.exit(main())
