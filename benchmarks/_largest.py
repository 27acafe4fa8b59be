"""The largest Llama-style model each contender can train under a 6 GiB budget, from the dry-run planner.

Each contender is the planner run with the fallbacks that contender has, for batches of 8 x 1024 tokens with
AdamW (fp32 master weights) on a CUDA device (the planner adds its device overhead):

* oomguard: its whole default ladder (``preplan=True`` uses the same planner and ladder: the same answer);
* Composer's rule: micro-batching only (``ladder=["micro_batch"]``), the batch of 8 kept;
* Accelerate: a batch it can shrink to 1 and nothing else: a whole batch of 1 (``ladder=[]``, ``batch_size=1``).

The family is sorted by size and fitting is monotone in it, so each contender's largest is found by bisection.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

import oomguard
from oomguard.planner import PRESETS, load_config

__all__ = ["FAMILY", "QUICK_FAMILY", "largest_models"]

BUDGET = "6GiB"
SEQ_LEN = 1024


def _llama(hidden: int, layers: int, heads: int, intermediate: int) -> dict[str, Any]:
    return {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
    }  # fmt: skip


#: Llama-style configs (vocabulary 32000), smallest first: the shapes of common small Llamas.
FAMILY: list[tuple[str, dict[str, Any]]] = [
    ("llama 512 x 8 layers", _llama(512, 8, 8, 1376)),
    ("llama 768 x 12 layers", _llama(768, 12, 12, 2048)),
    ("llama 1024 x 24 layers", _llama(1024, 24, 16, 2816)),
    ("TinyLlama-1.1B", PRESETS["tinyllama-1.1b"]),
    ("llama 3200 x 26 layers (OpenLLaMA-3B shape)", _llama(3200, 26, 32, 8640)),
    ("llama 4096 x 32 layers (Llama-2-7B shape)", _llama(4096, 32, 32, 11008)),
]
#: One small config: exercises the code in seconds (``--quick``).
QUICK_FAMILY: list[tuple[str, dict[str, Any]]] = [("llama 256 x 2 layers", _llama(256, 2, 4, 688))]

#: contender -> (ladder, batch size) it is planned with.
_SETUPS: dict[str, tuple[list[str] | None, int]] = {
    "accelerate": ([], 1),
    "composer": (["micro_batch"], 8),
    "oomguard": (None, 8),
}


@dataclass(frozen=True)
class Planned:
    """One planner answer: did the model fit, on which plan, with what predicted peak, after how long."""

    model: str
    parameters: int
    fits: bool
    plan: str
    predicted_peak_bytes: int
    seconds: float


def parameters(config: dict[str, Any]) -> int:
    """Parameter count of a config, from a model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(config))
    return sum(p.numel() for p in model.parameters())


def _plan(name: str, config: dict[str, Any], contender: str) -> Planned:
    ladder, batch_size = _SETUPS[contender]
    started = time.perf_counter()
    report = oomguard.plan(
        dict(config), gpu_memory=BUDGET, batch_size=batch_size, seq_len=SEQ_LEN, ladder=ladder, target="cuda"
    )
    plan = report.recommended.describe(batch_size) if report.recommended is not None else "nothing fits"
    peak = report.predicted_peak_bytes if report.fits else report.baseline_peak_bytes
    return Planned(name, parameters(config), report.fits, plan, peak, time.perf_counter() - started)


def _largest(fits: Callable[[int], bool], count: int) -> int:
    """The largest index whose ``fits`` is true (-1 if none), for ``fits`` true up to some index, then false."""
    low, high = -1, count  # fits(low) is known true (or low is -1), fits(high) known false (or high is count)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def largest_models(family: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per contender: the largest model of ``family`` that fits, and every planner answer it took to find it."""
    results: dict[str, dict[str, Any]] = {}
    for contender in _SETUPS:
        answers: dict[int, Planned] = {}

        def fits(index: int, contender: str = contender, answers: dict[int, Planned] = answers) -> bool:
            answers[index] = _plan(*family[index], contender)
            return answers[index].fits

        best = _largest(fits, len(family))
        results[contender] = {
            "largest": None if best < 0 else asdict(answers[best]),
            "planned": [asdict(answers[index]) for index in sorted(answers)],
        }
    return results
