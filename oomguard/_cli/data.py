"""Real training text that is always available offline: the Python standard library's own source files.

Bytes are tokens (a vocabulary of 256), so no tokenizer has to be downloaded. The demo trains on it, and so do the
examples and benchmarks, through its public names in :mod:`oomguard.testing` (the CLI may not import the test
double's package, so the code lives here).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["VOCAB_SIZE", "stdlib_text", "text_batches"]

VOCAB_SIZE = 256


def stdlib_text(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Up to ``max_bytes`` of the standard library's ``.py`` sources as byte tokens (0-255, ``int64``).

    The files are read in sorted order, so the text is the same on every run of one Python version; nothing is
    downloaded. Raises ``ValueError`` for a ``max_bytes`` below 1.

    >>> text = stdlib_text(max_bytes=1000)
    >>> text.shape, text.dtype, int(text.max()) < 256
    (torch.Size([1000]), torch.int64, True)
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int (how many bytes of text to read), got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python source files found under {root}; the demo trains on them")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def text_batches(
    text: torch.Tensor, batch_size: int, seq_len: int, *, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless causal-LM batches of random windows of ``text``: ``input_ids``, ``attention_mask`` and ``labels``,
    each ``batch_size x seq_len`` (the same windows for the same ``seed``).

    >>> batch = next(text_batches(stdlib_text(max_bytes=1000), batch_size=4, seq_len=16))
    >>> sorted(batch), tuple(batch["input_ids"].shape), bool((batch["labels"] == batch["input_ids"]).all())
    (['attention_mask', 'input_ids', 'labels'], (4, 16), True)
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if text.numel() <= seq_len:
        raise ValueError(f"the text ({text.numel()} tokens) is shorter than one sequence ({seq_len})")
    return _windows(text, batch_size, seq_len, torch.Generator().manual_seed(seed))  # (checked now, not at next())


def _windows(
    text: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """The batches :func:`text_batches` promises, drawn from ``generator`` (its arguments already checked)."""
    while True:
        starts = torch.randint(0, text.numel() - seq_len, (batch_size,), generator=generator)
        input_ids = torch.stack([text[s : s + seq_len] for s in starts.tolist()])
        yield {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": input_ids.clone(),
        }
