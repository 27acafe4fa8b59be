"""``oomguard plan`` as a user meets it: sizes read with their unit, a batch and a model name checked before the
seconds of planning, this machine's host budget, a progress line while it plans, and the answer to act on.

The planning itself is :func:`oomguard.plan`'s; the answer's words are :meth:`oomguard.PlanReport.answer`'s.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from oomguard._backends.host import HOST_MARGIN_FRACTION, HOST_MARGIN_MIN_BYTES, host_margin, total_host_memory
from oomguard._backends.units import GiB, parse_bytes
from oomguard._cli.errors import bad_input

__all__ = [
    "MAX_BATCH_SIZE",
    "MAX_SEQ_LEN",
    "check_model",
    "check_shape",
    "host_memory",
    "memory_size",
    "progress",
]

#: The most sequences a step ``oomguard plan`` plans: past it the walk down micro-batch sizes alone takes minutes
#: (a batch of 1,000,000 ran past 5 minutes without a word), and no optimizer step of a causal LM is that large.
MAX_BATCH_SIZE = 65_536
#: The longest sequence it plans (the model's own positions bound it further).
MAX_SEQ_LEN = 1_048_576
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
_DECIMAL_UNITS = ("k", "kb", "m", "mb", "g", "gb", "t", "tb")


def memory_size(option: str, text: str) -> tuple[int, str | None]:
    """``text`` (the value of ``option``, e.g. ``--gpu-memory``) in bytes, and a line saying what a decimal unit
    made of it (``6GB`` is 6,000,000,000 bytes, 5.59 GiB, not 6 GiB); None for a binary unit. A bare number is
    refused (status 2): ``--gpu-memory 6`` was 6 bytes, and nothing fitted."""
    match = _NUMBER.fullmatch(text)
    if match is not None and not match.group(2):
        number = match.group(1)
        bad_input(
            "plan",
            f"{option} {text} has no unit: write {number}GiB ({number} x 2**30 bytes, as torch and nvidia-smi count a "
            f"GPU's memory: a '6 GB' card has 6GiB) or {number}GB ({number} x 10**9 bytes)",
        )
    try:
        nbytes = parse_bytes(text)
    except ValueError:
        fix = "a size must be positive" if match else "write a number and a unit, e.g. 6GiB, 512MiB or 800MB"
        bad_input("plan", f"{option}: cannot read {text!r} as a memory size: {fix}")
    if match is None or match.group(2).lower() not in _DECIMAL_UNITS:
        return nbytes, None
    return nbytes, (
        f"({option} {text.strip()} is {nbytes:,} bytes, {nbytes / GiB:.2f} GiB: for {match.group(1)} x 2**30 bytes "
        f"write {match.group(1)}GiB)"
    )


def check_shape(batch_size: int, seq_len: int) -> None:
    """Exit with status 2 where the batch or the sequence is past what the planner plans (below 1, the planner's
    own error says so)."""
    if batch_size > MAX_BATCH_SIZE:
        bad_input(
            "plan",
            f"--batch-size {batch_size:,} is past the {MAX_BATCH_SIZE:,} sequences a step it plans: give the batch of "
            f"one optimizer step (the guard splits it into micro-batches itself)",
        )
    if seq_len > MAX_SEQ_LEN:
        bad_input("plan", f"--seq-len {seq_len:,} is past the {MAX_SEQ_LEN:,} tokens a sequence it plans")


def check_model(model: str, presets: list[str]) -> None:
    """Exit with status 2, naming the preset meant, where ``model`` is neither a preset nor a path but close to a
    preset's name (``tinylama``); other names are left to the planner's own error."""
    name = model.lower()
    if name in presets or Path(model).exists():
        return
    close = [p for p in presets if p.startswith(name)] + difflib.get_close_matches(name, presets, n=1, cutoff=0.6)
    if close:
        bad_input(
            "plan",
            f"unknown model {model!r}: did you mean {close[0]!r}? (the presets: {', '.join(presets)}; or the path of "
            f"a transformers config.json)",
        )


def host_memory(text: str | None) -> tuple[int | None, str | None]:
    """The host budget ``oomguard plan`` plans for, and how it was chosen: ``--host-memory`` (``text``) where given,
    else this machine's RAM (its container's limit, where lower) less a margin, a figure that does not move from
    run to run as the memory free now does; ``None`` (unlimited) where the machine's RAM cannot be read."""
    if text is not None:
        return memory_size("--host-memory", text)
    total = total_host_memory()
    if total is None:
        return None, "this machine's RAM could not be read; give --host-memory"
    margin = host_margin(total)
    least = f"{HOST_MARGIN_MIN_BYTES / GiB:.0f} GiB"
    return max(0, total - margin), (
        f"this machine's {total / GiB:.2f} GiB of RAM less {HOST_MARGIN_FRACTION:.0%}, at least {least}"
    )


@contextlib.contextmanager
def progress(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """A line on ``stream`` (stderr) while the planner runs: said once where it is a file or a pipe; on a terminal
    it counts the seconds and ends with the time taken."""
    out = sys.stderr if stream is None else stream
    line = f"oomguard plan: planning {what} on fake tensors (seconds to a few minutes)..."
    if not out.isatty():
        print(line, file=out, flush=True)
        yield
        return
    done = threading.Event()
    started = time.perf_counter()

    def tick() -> None:
        while not done.wait(1.0):
            out.write(f"\r{line} {time.perf_counter() - started:.0f} s")
            out.flush()

    ticker = threading.Thread(target=tick, name="oomguard-plan-progress", daemon=True)
    out.write(line)
    out.flush()
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        out.write(f"\r{line} done in {time.perf_counter() - started:.0f} s\n")
        out.flush()
