"""Predictive sizing against blind halving: OOM events over the same unattended job.

The job: a small Llama on a 12 MiB SimulatedGPU trains on batches of 32 x 64 tokens, with a rare batch of
32 x 256 every 6th step; from step 12 to step 24 another "process" holds 4 MiB of the device (a memory hog), so
the guard degrades and, after the hog is gone, steps back up (relax_after=4). The same job runs twice,
identical but for ``predictive=True`` (sizes micro-batches from measured peaks) or ``False`` (halves and
doubles), and the OOM events are counted per phase.

    python benchmarks/predictive.py [--steps 36] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from oomguard import OOMGuard
from oomguard.testing import DemoConfig, SimulatedGPU, demo_model, stdlib_text, text_batches

CONFIG = DemoConfig(batch_size=32, seq_len=64, hidden_size=64, layers=2)
BUDGET = "12MiB"
HOG_BYTES = 4 * 2**20
LONG_EVERY, LONG_FACTOR, HOG_FROM, HOG_UNTIL, RELAX_AFTER = 6, 4, 12, 24, 4


def job(predictive: bool, steps: int) -> dict[str, Any]:
    """Run the job; OOM events per phase, and the plans it ended on."""
    text = stdlib_text()
    short = text_batches(text, CONFIG.batch_size, CONFIG.seq_len, seed=5)
    long = text_batches(text, CONFIG.batch_size, LONG_FACTOR * CONFIG.seq_len, seed=6)
    model = demo_model(DemoConfig(**{**CONFIG.__dict__, "seq_len": LONG_FACTOR * CONFIG.seq_len}))
    guard = OOMGuard(
        lambda batch: model(**batch),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        predictive=predictive,
        relax_after=RELAX_AFTER,
    )
    ooms = {"first steps": 0, "long batches": 0, "hog arrives": 0, "stepping back up": 0}
    hog = None
    started = time.perf_counter()
    with SimulatedGPU(BUDGET) as gpu:
        gpu.adopt(model)
        for step in range(steps):
            if step == HOG_FROM:
                hog = torch.empty(HOG_BYTES, dtype=torch.uint8)  # another process takes memory
            if step == HOG_UNTIL:
                hog = None  # ...and gives it back
            is_long = step % LONG_EVERY == LONG_EVERY - 1
            result = guard(next(long) if is_long else next(short))
            phase = (
                "long batches" if is_long
                else "first steps" if step < HOG_FROM
                else "hog arrives" if step < HOG_UNTIL
                else "stepping back up"
            )  # fmt: skip
            ooms[phase] += result.ooms
    del hog
    return {
        "predictive": predictive,
        "ooms": ooms,
        "total_ooms": sum(ooms.values()),
        "relaxations": guard.summary().relaxations,
        "plans": {str(bucket): plan.describe(CONFIG.batch_size) for bucket, plan in guard.plans.items()},
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = [job(True, args.steps), job(False, args.steps)]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(runs, indent=2) + "\n")
    phases = list(runs[0]["ooms"])
    print(f"{args.steps} steps, SimulatedGPU {BUDGET}, Llama hidden {CONFIG.hidden_size} x {CONFIG.layers}, "
          f"batches {CONFIG.batch_size} x {CONFIG.seq_len} ({CONFIG.batch_size} x {LONG_FACTOR * CONFIG.seq_len} "
          f"every {LONG_EVERY}th), a {HOG_BYTES >> 20} MiB hog from step {HOG_FROM} to {HOG_UNTIL}, "
          f"relax_after={RELAX_AFTER}\n")  # fmt: skip
    print("| sizing | " + " | ".join(phases) + " | total OOM events | steps back up (held, failed) |")
    print("|---" * (len(phases) + 3) + "|")
    for run in runs:
        name = "predictive (default)" if run["predictive"] else "halving only"
        counts = " | ".join(str(run["ooms"][phase]) for phase in phases)
        print(f"| {name} | {counts} | **{run['total_ooms']}** | {run['relaxations']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
