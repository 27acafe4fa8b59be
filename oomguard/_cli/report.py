"""``oomguard report LOG.jsonl``: what a run's event log says, as a table per rung and (optionally) a plot.

The table has, for each rung: how many times it was engaged, how many steps ran with it in effect, and the time
lost to the out-of-memory errors that led to it; where the events count the host memory the guard holds
(``memory.host_allocated``: a simulated host, not CUDA), the most of it any event names, in all and with each rung
in effect. ``--plot FILE.png`` draws peak device memory over steps (from
the progress events) with every fallback and every step back up marked; it needs matplotlib (``pip install
oomguard[plot]``).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard._backends.units import MiB, format_bytes
from oomguard._guard.tally import Tally, event_problem

__all__ = ["EventLog", "plot", "read_log", "table", "tallied"]


@dataclass
class EventLog:
    """The events of a log that a report can use, and why each line it could not use was skipped.

    A log outlives the run that wrote it: a crash can cut its last line, a restarted job or another program can
    write into it, someone can edit it. The report counts what it can read and says what it skipped, in one line,
    rather than failing on the first damaged line.
    """

    events: list[dict[str, Any]] = field(default_factory=list)
    #: Skipped lines, by reason ("not JSON", "fallback without a rung"...).
    skipped: Counter[str] = field(default_factory=Counter)

    def skipped_line(self) -> str | None:
        """E.g. ``"3 unreadable line(s) skipped: 2 not JSON, 1 fallback without a rung"``; None if none were."""
        if not self.skipped:
            return None
        reasons = ", ".join(f"{count} {reason}" for reason, count in self.skipped.most_common())
        return f"{self.skipped.total()} unreadable line(s) skipped: {reasons}"


def read_log(path: str | Path) -> EventLog:
    """The events of a JSON-lines log; a line that is not an event the report can use is skipped and counted.

    The file is read as bytes and decoded line by line, so that stray binary data (a disk error, another program
    writing to the file) costs only the lines it is on. Blank lines are not damage and are not counted.
    """
    log = EventLog()
    with Path(path).open("rb") as lines:
        for raw in lines:
            if not raw.strip():
                continue
            event = _event(raw)
            if isinstance(event, str):
                log.skipped[event] += 1
            else:
                log.events.append(event)
    return log


def _event(raw: bytes) -> dict[str, Any] | str:
    """The event on a line of the log, or why there is none there."""
    try:
        event = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8"
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return "not JSON"
    if not isinstance(event, dict):
        return "not a JSON object"
    return event_problem(event) or event


def table(tally: Tally) -> str:
    """The Markdown table per rung, with a headline."""
    host = tally.host_peak is not None  # (a column only where the events count the host: not on CUDA)
    lines = [
        f"{tally.logged} steps logged ({tally.runs} run(s)), {tally.ooms} out-of-memory error(s), "
        f"{tally.exhausted} batch(es) given up; stepped back up {tally.relax_held} time(s), {tally.relax_failed} "
        f"try(s) backed off; {sum(tally.seconds_lost.values()):.2f} s lost to OOMs.",
        *([f"Host memory held by the guard: at most {format_bytes(tally.host_peak)} in the events logged."] * host),
        "",
        "| rung | times engaged | steps on it | time lost to OOMs |" + " host memory held (most) |" * host,
        "|---|---|---|---|" + "---|" * host,
    ]
    steps = tally.steps_by_rung
    for name in tally.rung_names():
        held = tally.host_by_rung.get(name)
        lines.append(
            f"| {name} | {tally.engaged.get(name, 0)} | {steps.get(name, '-')} | "
            f"{tally.seconds_lost.get(name, 0.0):.2f} s |" + f" {'-' if held is None else format_bytes(held)} |" * host
        )
    if not steps:
        lines.append("\n(no progress events in this log: steps per rung need the guard's log_every)")
    return "\n".join(lines)


def tallied(events: list[dict[str, Any]]) -> Tally:
    """The tally of a log's events (well formed: as :func:`read_log` returns them)."""
    tally = Tally()
    for event in events:
        tally.add(event)
    return tally


def plot(events: list[dict[str, Any]], path: str | Path, title: str = "oomguard") -> None:
    """Peak and resident device memory over steps, with fallbacks (red) and steps back up (green) marked.

    ``events`` must be well formed, as :func:`read_log` returns them: every progress event has its figures.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("oomguard report --plot needs matplotlib: pip install 'oomguard[plot]'") from error
    tally = Tally()
    positions = [(tally.add(event), tally.runs) for event in events]  # (step across restarts, run)
    located = [(step, event) for (step, _), event in zip(positions, events, strict=True)]
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
    for (step, run), (_, previous_run) in zip(positions[1:], positions, strict=False):
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
