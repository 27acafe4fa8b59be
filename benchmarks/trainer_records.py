"""What OOMGuardTrainer's per-step snapshot of the trainer's records costs as a history grows.

Before every guarded attempt the trainer takes a :class:`~oomguard.integrations._rollback.PlainState` of its
plain-data attributes (what a failed attempt added is put back from it). A subclass that keeps a history makes
that snapshot grow with the run; this times one snapshot (and, for reference, one restore, which only an OOM
costs) of a trainer-like object holding TRL's ``_metrics``, a token count and a history of ``N`` entries, for a
history of floats and one of small dicts (``{"step": ..., "loss": ...}``, like ``state.log_history``).

    python benchmarks/trainer_records.py                 # 1k, 100k and 500k entries
    python benchmarks/trainer_records.py --entries 500000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from oomguard.integrations._rollback import PlainState


class Records:
    """A trainer's plain records: TRL's metrics and token count, and a subclass's history of ``entries``."""

    def __init__(self, history: list[Any]) -> None:
        self._metrics = {"train": defaultdict(list, {"entropy": [0.5] * 8}), "eval": defaultdict(list)}
        self._total_train_tokens = 12_345
        self.history = history


def histories(entries: int) -> dict[str, list[Any]]:
    """The two kinds of history, ``entries`` long."""
    return {
        "floats": [float(i) for i in range(entries)],
        "dicts": [{"step": i, "loss": float(i)} for i in range(entries)],
    }


def median_ms(run: Callable[[], Any], repeats: int) -> float:
    """The median wall time of ``run``, in milliseconds, over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, nargs="*", default=[1_000, 100_000, 500_000])
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args(argv)
    print("| history | entries | snapshot (every step) | restore (after an OOM) |")
    print("|---|---|---|---|")
    for entries in options.entries:
        for kind, history in histories(entries).items():
            records = Records(history)
            snapshot = median_ms(lambda: PlainState(records), options.repeats)  # noqa: B023  (called at once)
            state = PlainState(records)
            restore = median_ms(state.restore, options.repeats)
            print(f"| {kind} | {entries:,} | {snapshot:.2f} ms | {restore:.2f} ms |")


if __name__ == "__main__":
    main()
