"""The ``oomguard`` command (also ``python -m oomguard``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oomguard", description="Keep PyTorch training alive when the GPU runs out of memory."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small Llama under a memory budget its batch does not fit, and recover",
        description="Train a small Llama (random init) on the standard library's source under a memory budget "
        "its starting batch does not fit; the guard recovers and reports which fallbacks it needed.",
    )
    from oomguard import _demo

    _demo.add_arguments(demo)
    demo.set_defaults(run=_demo.run)
    report = commands.add_parser(
        "report",
        help="summarise an event log: a table per rung, and optionally a plot of memory over steps",
        description="Summarise an oomguard event log (JSON lines): per rung, times engaged, steps on it and time "
        "lost to OOMs; --plot draws memory over steps with rung changes marked (needs matplotlib).",
    )
    report.add_argument("log", help="the event log written with log_file=")
    report.add_argument("--plot", metavar="FILE.png", help="also draw memory over steps to this PNG")
    report.set_defaults(run=_run_report)
    return parser


def _run_report(args: argparse.Namespace) -> int:
    from oomguard._report import Report, plot, read_log

    try:
        events = read_log(args.log)
    except OSError as error:
        raise SystemExit(f"oomguard report: cannot read {args.log}: {error.strerror or error}") from error
    print(Report.from_events(events).table())
    if args.plot:
        plot(events, args.plot, title=args.log)
        print(f"\nPlot written to {args.plot}.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv`` and run the command; returns the exit status."""
    args = _parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
