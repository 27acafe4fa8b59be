"""``oomguard report LOG.jsonl``: what a run's event log says, as a table per rung and (optionally) a plot.

The table has, for each rung: how many times it was engaged, how many steps ran with it in effect, and the time
lost to the out-of-memory errors that led to it. ``--plot FILE.png`` draws peak device memory over steps (from
the progress events) with every fallback and every step back up marked; it needs matplotlib (``pip install
oomguard[plot]``).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard._backends.units import MiB, format_bytes
from oomguard._ladder.plan import RUNG_ORDER

__all__ = ["Report", "plot", "read_log"]


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The events of a JSON-lines log; unreadable lines (a line cut by a crash) are skipped."""
    events = []
    with Path(path).open(encoding="utf-8") as log:
        for line in log:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and "event" in event:
                events.append(event)
    return events


@dataclass
class Report:
    """Figures per rung, gathered from a log's events."""

    engaged: Counter[str] = field(default_factory=Counter)
    steps: dict[str, int] = field(default_factory=dict)
    seconds_lost: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    ooms: int = 0
    exhausted: int = 0
    relax_held: int = 0
    relax_failed: int = 0
    steps_logged: int = 0
    runs: int = 1
    capacity: int | None = None

    @classmethod
    def from_events(cls, events: list[dict[str, Any]]) -> Report:
        report = cls()
        pending: list[float] = []  # seconds of OOMs whose consequence (fallback, back off, give up) is next
        totals: Counter[str] = Counter()  # steps per rung, summed over runs (progress counters are per run)
        run_steps: dict[str, int] = {}
        run = 0
        for (run_index, global_step), event in zip(_positions(events), events, strict=True):
            if run_index != run:  # a restarted job appending to the same log
                totals.update(run_steps)
                run_steps, run = {}, run_index
            report.steps_logged = max(report.steps_logged, global_step + 1)
            report.capacity = (event.get("memory") or {}).get("capacity", report.capacity)
            kind = event["event"]
            if kind == "oom":
                report.ooms += 1
                pending.append(float(event.get("seconds", 0.0)))
            elif kind == "fallback":
                report.engaged[event["rung"]] += 1
                report.seconds_lost[event["rung"]] += sum(pending)
                pending.clear()
            elif kind == "relax":
                held = event.get("outcome") == "held"
                report.relax_held += held
                report.relax_failed += not held
                report.seconds_lost["(stepping back up)"] += sum(pending)
                pending.clear()
            elif kind == "exhausted":
                report.exhausted += 1
                report.seconds_lost["(gave up)"] += sum(pending)
                pending.clear()
            elif kind == "progress":
                run_steps = dict(event.get("steps_by_rung", {}))
        totals.update(run_steps)
        report.steps = dict(totals)
        report.runs = run + 1
        return report

    def table(self) -> str:
        """The Markdown table per rung, with a headline."""
        names = [name for name in (*RUNG_ORDER, "none") if name in self.engaged or name in self.steps]
        names += [name for name in self.seconds_lost if name not in names]
        lines = [
            f"{self.steps_logged} steps logged ({self.runs} run(s)), {self.ooms} out-of-memory error(s), "
            f"{self.exhausted} batch(es) "
            f"given up; stepped back up {self.relax_held} time(s), {self.relax_failed} try(s) backed off; "
            f"{sum(self.seconds_lost.values()):.2f} s lost to OOMs.",
            "",
            "| rung | times engaged | steps on it | time lost to OOMs |",
            "|---|---|---|---|",
        ]
        for name in names:
            steps = self.steps.get(name)
            lines.append(
                f"| {name} | {self.engaged.get(name, 0)} | {'-' if steps is None else steps} | "
                f"{self.seconds_lost.get(name, 0.0):.2f} s |"
            )
        if not self.steps:
            lines.append("\n(no progress events in this log: steps per rung need the guard's log_every)")
        return "\n".join(lines)


def _positions(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(run index, step counted across runs) of each event; a step going backwards starts a new run."""
    positions, run, offset, last = [], 0, 0, -1
    for event in events:
        step = int(event.get("step", 0))
        if step < last:
            run, offset = run + 1, offset + last + 1
        last = step
        positions.append((run, offset + step))
    return positions


def plot(events: list[dict[str, Any]], path: str | Path, title: str = "oomguard") -> None:
    """Peak and resident device memory over steps, with fallbacks (red) and steps back up (green) marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("oomguard report --plot needs matplotlib: pip install 'oomguard[plot]'") from error
    positions = _positions(events)
    located = [(step, event) for (_, step), event in zip(positions, events, strict=True)]
    progress = [(step, e) for step, e in located if e["event"] == "progress"]
    if not progress:
        raise SystemExit("oomguard report --plot: the log has no progress events (run the guard with log_every=N)")
    steps = [step for step, _ in progress]
    figure, axes = plt.subplots(figsize=(10, 4), dpi=100)
    axes.plot(steps, [e["memory"]["peak"] / MiB for _, e in progress], marker=".", label="peak of the step")
    axes.plot(steps, [e["memory"]["allocated"] / MiB for _, e in progress], linestyle="--", label="in use after it")
    capacity = progress[-1][1]["memory"].get("capacity")
    if capacity:
        axes.axhline(capacity / MiB, color="black", linewidth=1, label=f"capacity ({format_bytes(capacity)})")
    for step, event in located:
        if event["event"] == "fallback" or (event["event"] == "relax" and event.get("outcome") == "held"):
            colour = "tab:red" if event["event"] == "fallback" else "tab:green"
            axes.axvline(step, color=colour, alpha=0.5, linewidth=1)
            axes.annotate(event["rung"], (step, axes.get_ylim()[1]), rotation=90, fontsize=7,
                          va="top", ha="right", color=colour)  # fmt: skip
    for (run, step), (previous_run, _) in zip(positions[1:], positions, strict=False):
        if run != previous_run:
            axes.axvline(step - 0.5, color="grey", linestyle=":", linewidth=1)
            axes.annotate("restart", (step, axes.get_ylim()[0]), fontsize=7, va="bottom", color="grey")
    axes.set_xlabel("step")
    axes.set_ylabel("device memory (MiB)")
    axes.set_title(f"{title}: memory over steps (red: fallback, green: stepped back up)", fontsize=10)
    axes.legend(loc="center right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
