"""Happy-path overhead of the guard: a guarded training step against the same step written by hand.

Both train identical copies of a small Llama (random init) on the same batches on the CPU, with no memory
pressure, so the guard never recovers anything: what is measured is its bookkeeping alone. Runs are
interleaved (hand, guard, guard, hand, ...) so that drifts in machine load hit both alike, and the figure is
the median over rounds of guarded time / hand-written time.

    python benchmarks/overhead.py [--rounds 15] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from oomguard import oom_guard
from oomguard.testing import DemoConfig, demo_model, stdlib_text, text_batches


def _hand_written(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Callable[[Any], float]:
    def step(batch: dict[str, torch.Tensor]) -> float:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    return step


def _guarded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Callable[[Any], float]:
    @oom_guard(model=model, optimizer=optimizer, scheduler=scheduler)
    def step(batch: dict[str, torch.Tensor]) -> Any:
        return model(**batch)

    return lambda batch: step(batch).loss


def measure(rounds: int, steps: int, config: DemoConfig) -> dict[str, Any]:
    base = demo_model(config)
    hand_model, guard_model = copy.deepcopy(base), copy.deepcopy(base)
    hand = _hand_written(*_with_optimizer(hand_model))
    guard = _guarded(*_with_optimizer(guard_model))
    batches = text_batches(stdlib_text(), config.batch_size, config.seq_len, seed=1)
    for _ in range(2):  # warm-up: allocator, Adam's state, the guard's first (journaled) step
        batch = next(batches)
        hand(batch)
        guard(batch)
    ratios, hand_times, guard_times = [], [], []
    for index in range(rounds):
        round_batches = [next(batches) for _ in range(steps)]
        order = [("hand", hand), ("guard", guard)] if index % 2 == 0 else [("guard", guard), ("hand", hand)]
        seconds: dict[str, float] = {}
        for name, step in order:
            started = time.perf_counter()
            for batch in round_batches:
                step(batch)
            seconds[name] = (time.perf_counter() - started) / steps
        hand_times.append(seconds["hand"])
        guard_times.append(seconds["guard"])
        ratios.append(seconds["guard"] / seconds["hand"])
    same = all(torch.equal(p, q) for p, q in zip(hand_model.parameters(), guard_model.parameters(), strict=True))
    return {
        "benchmark": "happy-path overhead",
        "model": f"Llama hidden {config.hidden_size} x {config.layers} layers",
        "batch": f"{config.batch_size} x {config.seq_len} tokens",
        "rounds": rounds,
        "steps_per_round": steps,
        "median_ratio": statistics.median(ratios),
        "ratios": ratios,
        "median_hand_step_s": statistics.median(hand_times),
        "median_guarded_step_s": statistics.median(guard_times),
        "identical_weights": same,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }


def _with_optimizer(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    config = DemoConfig(batch_size=args.batch_size, seq_len=args.seq_len)
    result = measure(args.rounds, args.steps, config)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{result['model']}, batch {result['batch']}, {args.rounds} interleaved rounds of {args.steps} steps\n"
        f"hand-written step: {result['median_hand_step_s'] * 1e3:.1f} ms (median)\n"
        f"guarded step:      {result['median_guarded_step_s'] * 1e3:.1f} ms (median)\n"
        f"median ratio guarded / hand-written: {result['median_ratio']:.4f} (target <= 1.02)\n"
        f"identical weights after training: {result['identical_weights']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
