"""Real training text that is always available offline: the Python standard library's own source files.

Bytes are tokens (a vocabulary of 256), so no tokenizer has to be downloaded.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["VOCAB_SIZE", "stdlib_text", "text_batches"]

VOCAB_SIZE = 256


def stdlib_text(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Up to ``max_bytes`` of the standard library's ``.py`` sources (sorted, so the same on every run)."""
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
    """Endless causal-LM batches of random windows: ``input_ids``, ``attention_mask`` and ``labels``."""
    if text.numel() <= seq_len:
        raise ValueError(f"the text ({text.numel()} tokens) is shorter than one sequence ({seq_len})")
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, text.numel() - seq_len, (batch_size,), generator=generator)
        input_ids = torch.stack([text[s : s + seq_len] for s in starts.tolist()])
        yield {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": input_ids.clone(),
        }
