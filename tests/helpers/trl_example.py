"""TRL's setup for the tests: the SFT example (examples/trl_sft.py) loaded as a module, and its logged metrics
compared. Import it after ``pytest.importorskip("trl")``: loading the example imports TRL."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent.parent / "examples" / "trl_sft.py"
spec = importlib.util.spec_from_file_location("trl_sft", EXAMPLE)
assert spec is not None and spec.loader is not None
trl_sft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trl_sft)

METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


def logged(trainer: Any) -> list[dict[str, float]]:
    return [{k: entry[k] for k in METRICS} for entry in trainer.state.log_history if "loss" in entry]


def assert_same_metrics(trainer: Any, reference: Any) -> None:
    got, expected = logged(trainer), logged(reference)
    assert [e["num_tokens"] for e in got] == [e["num_tokens"] for e in expected], "tokens counted once each"
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), f"step {step}"
