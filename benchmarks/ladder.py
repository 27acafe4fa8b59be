"""What each rung of the ladder costs and saves: peak device memory and step time, rung by rung.

For one model and batch, on a SimulatedGPU (CPU), this measures the plain step, each rung alone, and the plan
the guard settles on under a budget the plain step does not fit. Peaks are the simulator's exact tensor
accounting; step times are medians over interleaved rounds and include the simulator's own overhead (the same
for every plan), so compare them with each other rather than with a real GPU.

    python benchmarks/ladder.py [--rounds 5] [--budget 24MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oomguard import OOMGuard, Plan
from oomguard._backends.units import format_bytes, parse_bytes
from oomguard._cli.data import stdlib_text, text_batches
from oomguard._cli.demo import DemoConfig, build_model
from oomguard.testing import SimulatedGPU

CONFIG = DemoConfig(batch_size=8, seq_len=256, hidden_size=128, layers=4)
PLANS: list[tuple[str, Plan]] = [
    ("plain step", Plan()),
    ("micro_batch (x4)", Plan(micro_batch_size=2)),
    ("amp (bf16)", Plan(precision="bf16")),
    ("checkpointing (partial)", Plan(checkpointing="partial")),
    ("checkpointing (full)", Plan(checkpointing="full")),
    ("activation_offload", Plan(activation_offload=True)),
    ("optimizer_offload", Plan(optimizer_offload=True)),
    ("layer_offload (all 4 layers)", Plan(offload_layers=4)),
]


def _guard(model: torch.nn.Module, ladder: list[str] | None = None) -> OOMGuard:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer, ladder=ladder)


@dataclass
class _Run:
    name: str
    plan: Plan
    model: torch.nn.Module
    guard: OOMGuard
    times: list[float] = field(default_factory=list)
    peak: int = 0
    transfer_bytes: int = 0  # host<->device bytes of a steady step

    def resident(self, gpu: SimulatedGPU) -> int:
        """Device bytes this run's weights and optimizer state hold between steps."""
        tensors = list(self.model.parameters()) + [
            t for state in self.guard.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        ]
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if gpu.is_device(t)}
        return sum(-(-nbytes // 512) * 512 for nbytes in storages.values())


def measure_plans(rounds: int) -> list[dict[str, Any]]:
    """Peak and median step time of each plan, the plans interleaved round by round."""
    batches = text_batches(stdlib_text(), CONFIG.batch_size, CONFIG.seq_len, seed=3)
    runs = []
    for name, plan in PLANS:
        model = build_model(CONFIG)
        guard = _guard(model, ladder=[])
        guard.plan = plan
        runs.append(_Run(name, plan, model, guard))
    with SimulatedGPU("4GiB") as gpu:
        for run in runs:
            gpu.adopt(run.model)
        for round_index in range(rounds + 1):  # round 0 warms up (Adam's state, the first journaled step)
            batch = next(batches)
            for run in runs if round_index % 2 == 0 else runs[::-1]:
                others = gpu.memory_allocated() - run.resident(gpu)  # what the other runs hold
                gpu.reset_peak_memory_stats()
                started = time.perf_counter()
                result = run.guard(batch)
                elapsed = time.perf_counter() - started
                if round_index:
                    run.times.append(elapsed)
                    run.transfer_bytes = result.transfer_bytes
                    run.peak = max(run.peak, gpu.max_memory_allocated() - others)
    return [
        {
            "name": run.name,
            "plan": run.plan.to_dict(),
            "peak_bytes": run.peak,
            "step_s": statistics.median(run.times),
            "transfer_bytes": run.transfer_bytes,
        }
        for run in runs
    ]


def settle(budget: int, steps: int) -> dict[str, Any]:
    """Run the guard with its default ladder under ``budget`` and report the plan it settles on."""
    batches = text_batches(stdlib_text(), CONFIG.batch_size, CONFIG.seq_len, seed=4)
    model = build_model(CONFIG)
    guard = _guard(model)
    times, ooms = [], 0
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        for _ in range(steps):
            started = time.perf_counter()
            result = guard(next(batches))
            times.append(time.perf_counter() - started)
            ooms += result.ooms
        gpu.reset_peak_memory_stats()
        started = time.perf_counter()
        last = guard(next(batches))
        settled_time = time.perf_counter() - started
        peak = gpu.max_memory_allocated()
    return {
        "name": "settled under the budget",
        "plan": guard.plan.to_dict(),
        "description": guard.plan.describe(CONFIG.batch_size),
        "peak_bytes": peak,
        "step_s": min(settled_time, statistics.median(times[-3:])),
        "ooms": ooms,
        "budget_bytes": budget,
        "transfer_bytes": last.transfer_bytes,
    }


def table(rows: list[dict[str, Any]]) -> str:
    plain = rows[0]
    lines = [
        "| plan | peak device memory | vs plain | step time | vs plain | host<->device per step |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']}{' — ' + row['description'] if 'description' in row else ''} | "
            f"{format_bytes(row['peak_bytes'])} | {row['peak_bytes'] / plain['peak_bytes']:.2f}x | "
            f"{row['step_s'] * 1e3:.0f} ms | {row['step_s'] / plain['step_s']:.2f}x | "
            f"{format_bytes(row.get('transfer_bytes', 0))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", default="24MiB", help="the budget for the settled plan (plain needs more)")
    parser.add_argument("--steps", type=int, default=6, help="steps to settle under the budget")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = measure_plans(args.rounds)
    settled = settle(parse_bytes(args.budget), args.steps)
    rows.append(settled)
    meta = {
        "model": f"Llama hidden {CONFIG.hidden_size} x {CONFIG.layers} layers, AdamW",
        "batch": f"{CONFIG.batch_size} x {CONFIG.seq_len} tokens",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"{meta['model']}, batch {meta['batch']}, SimulatedGPU; {meta['machine']}, {meta['date']}")
    print(f"settled under {format_bytes(settled['budget_bytes'])} after {settled['ooms']} OOM(s)\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
