"""A deep model guarded with default options: how many OOMs it takes to settle, and how long its worst call is
against a steady step (the jump's and tuning's planning inside training calls; issue 28).

The job: a 16-layer Llama of hidden size 64 (the demo's model, deeper) trains on batches of 16 x 64 tokens of the
standard library's text under a SimulatedGPU of 0.3x the plain step's peak, with ``oom_guard``'s defaults (the
jump after the first OOM, tuning after 4 clean steps). Each call is timed; the steady step is the median of the
calls of the last quarter of the job (96 steps by default: tuning's search, which takes at most its share of the
job's time, is done by step 60 or so and its trials soon after, so the last quarter runs on the plan it kept, and
every call of the search and of the trials is among those the worst call is taken from).

    python benchmarks/deep_job.py [--steps 96] [--layers 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from oomguard import oom_guard
from oomguard.testing import DemoConfig, SimulatedGPU, demo_model, stdlib_text, text_batches

FRACTION = 0.3


def plain_peak(config: DemoConfig, batch: dict[str, torch.Tensor]) -> int:
    """The unguarded step's peak (its second step: Adam's state resident)."""
    model = demo_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with SimulatedGPU("64GiB") as gpu:
        gpu.adopt(model)
        for _ in range(2):
            gpu.reset_peak_memory_stats()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return gpu.max_memory_allocated()


def job(steps: int, layers: int) -> dict[str, Any]:
    config = DemoConfig(batch_size=16, seq_len=64, hidden_size=64, layers=layers)
    batches = text_batches(stdlib_text(), config.batch_size, config.seq_len, seed=3)
    data = [next(batches) for _ in range(steps)]  # (made outside the simulated device: host memory)
    budget = int(FRACTION * plain_peak(config, data[0]))
    model = demo_model(config)
    step: Any = oom_guard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    calls: list[dict[str, Any]] = []
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        for batch in data:
            started = time.perf_counter()
            result = step(batch)
            calls.append(
                {"seconds": time.perf_counter() - started, "ooms": result.ooms, "plan": result.plan.describe(16)}
            )
    events = [event.to_dict() for event in step.guard.events]
    step.guard.close()
    seconds = [float(call["seconds"]) for call in calls]
    steady, worst = statistics.median(seconds[-max(2, steps // 4) :]), max(seconds)
    return {
        "layers": layers,
        "budget_bytes": budget,
        "calls": calls,
        "ooms_first_step": calls[0]["ooms"],
        "ooms_after": sum(call["ooms"] for call in calls[1:]),
        "steady_seconds": steady,
        "worst_seconds": worst,
        "worst_over_steady": worst / steady,
        "total_seconds": sum(call["seconds"] for call in calls),
        "planning": [
            {key: e.get(key) for key in ("event", "step", "planning_seconds", "fake_steps", "search_calls")}
            for e in events
            if e.get("fake_steps")
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    found = job(args.steps, args.layers)
    for index, call in enumerate(found["calls"]):
        print(f"call {index + 1:2d}: {call['seconds']:7.2f} s, {call['ooms']} OOM(s), {call['plan']}")
    print(
        f"{found['ooms_first_step']} OOM(s) on the first step, {found['ooms_after']} after; worst call "
        f"{found['worst_seconds']:.1f} s = {found['worst_over_steady']:.1f}x the steady step "
        f"({found['steady_seconds']:.2f} s); {found['total_seconds']:.0f} s in all; planning: {found['planning']}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
