"""oomguard against the peers users would pick instead, side by side in one run, on the same scenarios.

Contenders: Hugging Face Accelerate's ``find_executable_batch_size`` (as its docs show it), a re-creation of
Composer's automatic micro-batching, and oomguard with its default ladder and with ``preplan=True``, plus an
unconstrained reference run. Scenarios, on a SimulatedGPU with a small Llama on the CPU: a batch 4x too large,
40x too large, a rare long batch, a budget where batch 1 does not fit in fp32, and weights + optimizer state
larger than the budget. Also the guard's happy-path overhead (``overhead.py``), what each rung costs and the plan
the guard settles on (``ladder.py``), the quantization rungs against the exact ones (``quantization.py``), and
the largest Llama-style model each contender can train under 6 GiB (from the dry-run planner).

    python benchmarks/run.py            # ~6 min here: benchmarks/out/results.json and benchmarks/RESULTS.md
    python benchmarks/run.py --quick    # under a minute, smaller everything: benchmarks/out/quick/
    python benchmarks/run.py --out DIR  # DIR/results.json and DIR/RESULTS.md
    python benchmarks/run.py --render benchmarks/out/results.json   # only rewrite RESULTS.md from the JSON
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import ladder
import quantization
import torch
from _contenders import CONTENDERS, RunRecord, run_reference
from _largest import FAMILY, QUICK_FAMILY, largest_models
from _scenarios import Scenario, build_scenario, specs
from _tables import markdown
from overhead import measure

from oomguard.testing import DemoConfig, parse_bytes

HERE = Path(__file__).resolve().parent


def _eval_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(model(**batch).loss)


def _distance(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Relative L2 distance of all weights from the reference run's: ||w - w_ref|| / ||w_ref||."""
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    difference = sum(float((p.detach() - q.detach()).pow(2).sum()) for p, q in pairs)
    norm = sum(float(q.detach().pow(2).sum()) for _, q in pairs)
    return math.sqrt(difference / norm)


def _score(
    record: RunRecord,
    model: torch.nn.Module,
    reference: RunRecord,
    reference_model: torch.nn.Module,
    eval_batch: dict[str, torch.Tensor],
) -> None:
    """The held-out loss of a finished run, and how far it and its weights are from the reference run's."""
    record.eval_loss = _eval_loss(model, eval_batch)
    record.eval_loss_delta = record.eval_loss - (reference.eval_loss or 0.0)
    record.weight_distance = _distance(model, reference_model)


def run_scenario(scenario: Scenario, log: Any, freeze: bool = False) -> list[RunRecord]:
    """The reference and every contender on one scenario, each scored against the reference.

    ``freeze`` (the quick mode, a smoke run) spares each run the full garbage collections (~0.2 s each here) that
    Accelerate and the guard make after every OOM, by freezing what is alive before it starts.
    """
    reference, reference_model = run_reference(scenario)
    reference.eval_loss = _eval_loss(reference_model, scenario.eval_batch)
    records = [reference]
    for name, runner in CONTENDERS.items():
        if freeze:
            gc.freeze()
        record, model = runner(scenario)
        if record.finished:
            _score(record, model, reference, reference_model, scenario.eval_batch)
        print(
            f"  {name}: {'finished' if record.finished else record.failure}, {record.ooms_total} OOM(s), "
            f"{record.wall_s:.1f} s",
            file=log,
            flush=True,
        )
        records.append(record)
    return records


def _meta(quick: bool, threads: int) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "accelerate": version("accelerate"),
        "python": platform.python_version(),
        "quick": quick,
    }


def _overhead(quick: bool) -> dict[str, Any]:
    if quick:
        return measure(2, 1, DemoConfig(batch_size=2, seq_len=16, hidden_size=32, layers=2))
    return measure(9, 5, DemoConfig(batch_size=8, seq_len=128))


def run_all(quick: bool, threads: int, skip_largest: bool = False, log: Any = sys.stderr) -> dict[str, Any]:
    """Every benchmark; the results as one JSON-ready dictionary."""
    started = time.perf_counter()
    results: dict[str, Any] = {"meta": _meta(quick, threads), "scenarios": []}
    try:
        for spec in specs(quick):
            print(f"scenario {spec.key}: {spec.title} ({spec.describe()})", file=log, flush=True)
            scenario = build_scenario(spec)
            runs = run_scenario(scenario, log, freeze=quick)
            results["scenarios"].append({"scenario": scenario.to_dict(), "runs": [run.to_dict() for run in runs]})
    finally:
        gc.unfreeze()
    print("happy-path overhead...", file=log, flush=True)
    results["overhead"] = _overhead(quick)
    print("every fitting plan against the one the guard runs on (ladder.py)...", file=log, flush=True)
    results["ladder"] = None if quick else ladder.run(parse_bytes("24MiB"), steps=20, rounds=4)
    print("the quantization rungs against the exact rungs (quantization.py)...", file=log, flush=True)
    results["quantization"] = None if quick else quantization.run(rounds=10)
    print("largest model under 6 GiB (dry-run planner)...", file=log, flush=True)
    results["largest"] = {} if skip_largest else largest_models(QUICK_FAMILY if quick else FAMILY)
    results["meta"]["seconds"] = time.perf_counter() - started
    return results


def _paths(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.out is not None:
        return args.out / "results.json", args.out / "RESULTS.md"
    if args.quick:
        return HERE / "out" / "quick" / "results.json", HERE / "out" / "quick" / "RESULTS.md"
    return HERE / "out" / "results.json", HERE / "RESULTS.md"


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small scenarios, few steps: under a minute")
    parser.add_argument("--out", type=Path, default=None, help="write results.json and RESULTS.md in this folder")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: see RESULTS.md)")
    parser.add_argument("--skip-largest", action="store_true", help="skip the 6 GiB planning part")
    parser.add_argument("--render", type=Path, default=None, help="only write RESULTS.md from this results.json")
    return parser.parse_args(argv)


#: Where RESULTS.md's hand-kept section begins: figures measured by other scripts (the planner, the tests, the demo),
#: which a run of this one keeps as they are.
HAND_KEPT = "\n## Measured elsewhere"


def _write_results(path: Path, rendered: str) -> None:
    """``rendered`` to ``path``, followed by the hand-kept section of the file there now, if it has one."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    kept = old.find(HAND_KEPT)
    path.write_text(rendered.rstrip("\n") + "\n" + old[kept:] if kept >= 0 else rendered, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    json_path, markdown_path = _paths(args)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    if args.render is not None:
        _write_results(markdown_path, markdown(json.loads(args.render.read_text())))
        return 0
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = run_all(args.quick, args.threads, args.skip_largest)
    finally:
        torch.set_num_threads(threads)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    _write_results(markdown_path, markdown(results))
    print(f"wrote {json_path} and {markdown_path} ({results['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
