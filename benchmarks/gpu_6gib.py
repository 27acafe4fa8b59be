"""TinyLlama-1.1B on a real CUDA GPU capped at 6 GiB: does the guard get there, and how fast does it train?

For a CUDA machine (this project has none, so it has not been run yet). The GPU is capped with
``torch.cuda.set_per_process_memory_fraction(6 GiB / total)``; a TinyLlama-1.1B-architecture model (random init,
fp32 weights, AdamW) trains on batches of 8 x 1024 byte tokens of the Python standard library's source, a
configuration that runs out of memory as it is:

1. the dry-run planner (``oomguard.plan``, on the CPU) recommends a plan for the cap and predicts its peak;
2. the guard with its default ladder starts from the plain step and falls back on every OOM until it fits;
3. the same job on a ZeRO-Offload-style hand plan (``ZERO_OFFLOAD``: bf16 weights on the device, fp32 master
   weights and AdamW on the host, full checkpointing, micro-batches of one sequence; or ``--hand-plan``),
   forced with ``guard.plan = ...`` and no ladder, to compare tokens/s with.

It reports the OOM events and the plan the guard settled on, tokens/s of both runs over their settled steps,
and the measured peak (``torch.cuda.max_memory_allocated``, reset by the guard before every attempt) against
the planner's prediction for that plan. Each run stops after ``--steps`` steps or when its share of
``--max-seconds`` is spent, whichever comes first, so the whole command ends in time (8 minutes on an H200
with the defaults; layer offload streams every weight over PCIe for every micro-batch, so steps take seconds).

    python benchmarks/gpu_6gib.py [--gpu-memory 6GiB] [--steps 300] [--max-seconds 420] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import oomguard
from oomguard import OOMGuard, Plan
from oomguard.planner import dry_run, load_config
from oomguard.testing import format_bytes, parse_bytes, stdlib_text, text_batches

MODEL = "tinyllama-1.1b"
#: The anchor the issue names: weights on the device in bf16, the optimizer (and fp32 masters) on the host.
ZERO_OFFLOAD = Plan(micro_batch_size=1, precision="bf16", checkpointing="full", optimizer_offload="master")
_SETTLE = 2  # clean steps on the final plan before timing starts (allocator warm-up, first host-side Adam step)
_RESERVE = 60.0  # seconds kept back from --max-seconds for one more dry run on the CPU after training


@dataclass
class RunFigures:
    """One training run under the cap."""

    name: str
    plan: str
    #: The plan the run ended on, as ``Plan.to_dict()``.
    settled: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    ooms: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    seconds_lost: float = 0.0
    tokens_per_s: float | None = None
    median_step_s: float | None = None
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    final_loss: float | None = None
    failure: str | None = None


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-memory", default="6GiB", help="the cap (default 6GiB)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step (default 8)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--steps", type=int, default=300, help="steps per run at most (default 300)")
    parser.add_argument("--max-seconds", type=float, default=420.0, help="wall-clock budget of the command")
    parser.add_argument(
        "--hand-plan", type=json.loads, default=None, help="a Plan as JSON, e.g. '{\"micro_batch_size\": 2}'"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.seq_len < 2 or args.steps < 1 or args.max_seconds <= 0:
        parser.error("--batch-size, --steps and --max-seconds must be positive, --seq-len at least 2")
    return args


@contextmanager
def capped(cap: int) -> Iterator[None]:
    """Limit this process's tensor memory on GPU 0 to ``cap`` bytes (the CUDA context is not counted in it)."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def predicted_peak(plan: Plan, args: argparse.Namespace) -> int:
    """The planner's tensor peak for ``plan`` (as ``oomguard.plan`` would measure it), on fake tensors."""
    from transformers import AutoModelForCausalLM

    config = load_config(MODEL)
    config.use_cache = False
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # CUDA's default
        ids = torch.zeros((args.batch_size, args.seq_len), dtype=torch.long)
        report = dry_run(
            lambda b: model(**b), {"input_ids": ids, "labels": torch.zeros_like(ids)}, model=model,
            optimizer=optimizer, capacity=2**50, target="cuda", label=MODEL, plans=[plan],
        )  # fmt: skip
    return report.candidates[0].peak_bytes


def _batches(args: argparse.Namespace) -> Iterator[dict[str, torch.Tensor]]:
    return text_batches(stdlib_text(), args.batch_size, args.seq_len, seed=0)


def _guard(plan: Plan | None) -> tuple[OOMGuard, torch.nn.Module]:
    """A fresh model on the GPU and its guard: the default ladder, or ``plan`` forced with no fallback."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = load_config(MODEL)
    config.use_cache = False
    with torch.device("cuda"):  # random init on the GPU: fp32 weights, as the planner assumes
        model = AutoModelForCausalLM.from_config(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(batch: dict[str, torch.Tensor]) -> Any:
        return model(**{name: tensor.cuda(non_blocking=True) for name, tensor in batch.items()})

    guard = OOMGuard(step, model=model, optimizer=optimizer, ladder=None if plan is None else [], log_every=None)
    if plan is not None:
        guard.plan = plan
    return guard, model


def train(name: str, plan: Plan | None, args: argparse.Namespace, deadline: float) -> RunFigures:
    """Train until ``args.steps`` or ``deadline``; figures over the steps after the plan settled."""
    guard, model = _guard(plan)
    figures = RunFigures(name, plan.describe(args.batch_size) if plan is not None else "plain step")
    times: list[float] = []
    peaks: list[int] = []
    clean = 0
    batches = _batches(args)
    try:
        while figures.steps < args.steps and time.monotonic() < deadline:
            torch.cuda.synchronize()
            started = time.perf_counter()
            result = guard(next(batches))
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            figures.steps, figures.final_loss = figures.steps + 1, result.loss
            clean = clean + 1 if result.ooms == 0 else 0
            if clean > _SETTLE:  # settled: no OOM for a while, allocator warm
                times.append(elapsed)
                peaks.append(torch.cuda.max_memory_allocated())
    except oomguard.OOMGuardError as error:
        figures.failure = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    _fill(figures, guard, times, peaks, args)
    del guard, model  # not closed: undoing layer offload would bring every weight back over the cap
    gc.collect()
    torch.cuda.empty_cache()
    return figures


def _fill(figures: RunFigures, guard: OOMGuard, times: list[float], peaks: list[int], args: argparse.Namespace) -> None:
    summary = guard.summary()
    figures.ooms, figures.fallbacks, figures.seconds_lost = summary.ooms, summary.fallbacks, summary.seconds_lost
    figures.plan, figures.settled = guard.plan.describe(args.batch_size), guard.plan.to_dict()
    if times:
        figures.tokens_per_s = len(times) * args.batch_size * args.seq_len / sum(times)
        figures.median_step_s = statistics.median(times)
        figures.peak_bytes = max(peaks)


def _report(runs: list[RunFigures]) -> str:
    lines = [
        "| run | plan settled on | steps | OOM events | tokens/s | measured peak | planner's prediction |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        tokens = f"{run.tokens_per_s:.0f}" if run.tokens_per_s is not None else "n/a"
        plan = f"{run.plan} (stopped: {run.failure})" if run.failure else run.plan
        lines.append(
            f"| {run.name} | {plan} | {run.steps} | {run.ooms} | {tokens} | {format_bytes(run.peak_bytes)} | "
            f"{format_bytes(run.predicted_peak_bytes)} |"
        )
    return "\n".join(lines)


def _timed(label: str, work: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    value = work()
    print(f"{label}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return value


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_6gib.py needs a CUDA GPU (--help works anywhere)")
    started = time.monotonic()
    end = started + args.max_seconds
    cap = parse_bytes(args.gpu_memory)
    report: oomguard.PlanReport = _timed(
        "planning", lambda: oomguard.plan(MODEL, gpu_memory=cap, batch_size=args.batch_size, seq_len=args.seq_len)
    )
    hand = Plan.from_dict(args.hand_plan) if args.hand_plan is not None else ZERO_OFFLOAD
    hand_peak = report.predicted_peak_bytes if hand == report.recommended else predicted_peak(hand, args)
    now = time.monotonic()
    halfway = now + (end - _RESERVE - now) / 2
    with capped(cap):
        guarded: RunFigures = _timed("guarded run", lambda: train("guard, default ladder", None, args, halfway))
        forced: RunFigures = _timed(
            "hand plan run", lambda: train("ZeRO-Offload-style hand plan", hand, args, end - _RESERVE)
        )
    forced.predicted_peak_bytes = hand_peak
    settled = Plan.from_dict(guarded.settled)
    guarded.predicted_peak_bytes = hand_peak if settled == hand else predicted_peak(settled, args)
    results = {
        "gpu": torch.cuda.get_device_name(0),
        "cap_bytes": cap,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "recommended": report.recommended.to_dict() if report.recommended is not None else None,
        "recommended_predicted_peak_bytes": report.predicted_peak_bytes,
        "runs": [asdict(run) for run in (guarded, forced)],
        "seconds": time.monotonic() - started,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{results['gpu']}, capped at {args.gpu_memory}, torch {results['torch']}, {results['date']}")
    print(_report([guarded, forced]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
