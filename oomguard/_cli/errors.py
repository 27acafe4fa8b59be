"""How every ``oomguard`` command answers bad input: one line on stderr and exit status 2."""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["bad_input"]


def bad_input(command: str, error: Exception | str) -> NoReturn:
    """Print ``oomguard COMMAND: what is wrong`` on one line of stderr and exit with status 2, as argparse does
    for bad usage: 1 already means an answer (nothing fits), so a script can tell the two apart.

    The ``SystemExit`` carries the message as its text (for a caller of :func:`oomguard._cli.main.main` such as a
    test) and the status as its ``code``: Python exits with an int code silently, so the line is printed exactly
    once.
    """
    message = f"oomguard {command}: {' '.join(str(error).split())}"  # one line, whatever the error's layout
    print(message, file=sys.stderr)
    exit_ = SystemExit(message)
    exit_.code = 2
    if isinstance(error, Exception):
        raise exit_ from error
    raise exit_
