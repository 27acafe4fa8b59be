"""The main job, `oomguard demo`, end to end on a short run."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard._cli import main
from oomguard._demo import run


def test_demo_recovers_and_reports_its_fallbacks(tmp_path: Path) -> None:
    log = tmp_path / "demo.jsonl"
    out, err = io.StringIO(), io.StringIO()
    args = _parse(["demo", "--steps", "3", "--log-file", str(log)])
    assert run(args, out=out, err=err) == 0
    text = out.getvalue()
    assert "Fallbacks needed: micro_batch x" in text, text
    assert "every step trained on all 16 samples" in text
    assert "step    3/3" in err.getvalue(), "the progress bar reached the end"
    assert "[oomguard] step 0: OOM in" in err.getvalue(), "event lines are shown as they happen"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["event"] == "oom" and events[0]["memory"]["capacity"] == 64 * 2**20
    assert [e["event"] for e in events if e["event"] != "progress"][-1] == "recovered"
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and progress[0]["steps_by_rung"] == {"micro_batch": 1}


def test_cli_entry_points_answer_help() -> None:
    for command in ([sys.executable, "-m", "oomguard", "demo", "--help"], [sys.executable, "-m", "oomguard", "--help"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert "demo" in done.stdout


def test_cli_rejects_a_bad_budget(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read 'lots' as a memory size"):
        main(["demo", "--steps", "1", "--gpu-memory", "lots", "--log-file", str(tmp_path / "x.jsonl"), "--quiet"])


def _parse(argv: list[str]):  # type: ignore[no-untyped-def]
    from oomguard._cli import _parser

    return _parser().parse_args(argv)
