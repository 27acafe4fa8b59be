"""Each example runs, briefly, as a user would run it."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_loop_example_trains_and_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    loss = _load("plain_loop").main(steps=2)
    assert math.isfinite(loss)
    events = [json.loads(line)["event"] for line in (tmp_path / "plain_loop.jsonl").read_text().splitlines()]
    assert "fallback" in events and "recovered" in events
