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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv`` and run the command; returns the exit status."""
    args = _parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
