"""The main job, `oomguard demo`, end to end on a short run, and `oomguard report` on the log it writes."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.once import once

from oomguard._cli.demo import run
from oomguard._cli.main import _parser, main

# (one worker runs them all, so the demo's run below is made once: see helpers/once.py)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("demo")]  # the demo end to end, and the CLI


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One short demo: 3 steps with a long batch every 2nd, then a restart of 2 steps from the state file."""
    return once("demo", lambda: _demo_run(tmp_path_factory.mktemp("demo")))


def _demo_run(folder: Path) -> tuple[Path, str, str]:
    log, state = folder / "demo.jsonl", folder / "plans.json"
    argv = ["demo", "--steps", "3", "--long-every", "2", "--restart-steps", "2", "--log-file", str(log)]
    argv += ["--plot", str(folder / "demo-memory.png")]
    out, err = io.StringIO(), io.StringIO()
    assert run(_parser().parse_args([*argv, "--state-file", str(state)]), out=out, err=err) == 0
    return folder, out.getvalue(), err.getvalue()


def test_demo_recovers_and_reports_its_fallbacks(demo_run: tuple[Path, str, str]) -> None:
    folder, out, err = demo_run
    assert "Fallbacks needed: micro_batch x" in out, out
    assert "every step trained on all 16 samples" in out
    assert "64-token batches:" in out and "128-token batches:" in out, "each batch bucket has its own plan"
    assert "step    3/3" in err, "the progress bar reached the end"
    assert "[oomguard] step 0: OOM in" in err, "event lines are shown as they happen"
    events = [json.loads(line) for line in (folder / "demo.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "oom" and events[0]["memory"]["capacity"] == 6 * 2**20
    assert any(e["event"] == "recovered" for e in events)
    saved = json.loads((folder / "plans.json").read_text())
    assert len(saved["plans"]) == 2, "both buckets' plans were saved"


def test_demo_shows_rungs_beyond_micro_batches_and_ends_with_its_report(demo_run: tuple[Path, str, str]) -> None:
    folder, out, _ = demo_run
    fallbacks = out.split("Fallbacks needed:")[1].splitlines()[0]
    assert "amp x" in fallbacks or "checkpointing x" in fallbacks, "the long batch needs more than micro-batches"
    report = out.split("$ oomguard report")[1]
    assert "5 steps logged (2 run(s))" in report and "| micro_batch |" in report
    assert f"Memory plot written to {folder / 'demo-memory.png'}" in report and (folder / "demo-memory.png").is_file()
    assert out.rstrip().splitlines()[-1].startswith("Demo finished in ")


def test_the_restart_starts_from_the_state_file_without_ooms(demo_run: tuple[Path, str, str]) -> None:
    _, out, _ = demo_run
    assert "Restart: 2 steps (long batches included) with 0 out-of-memory error(s)" in out


def test_report_summarises_the_demo_log_and_draws_it(
    demo_run: tuple[Path, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image

    folder, _, _ = demo_run
    png = folder / "memory.png"
    assert main(["report", str(folder / "demo.jsonl"), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "5 steps logged (2 run(s))" in table
    assert "| micro_batch |" in table and "time lost to OOMs" in table
    with Image.open(png) as image:
        assert image.size == (1000, 400)
        pixels = image.convert("L")
        low, high = pixels.getextrema()
        assert high - low > 100, "the plot is not blank"
        assert sum(1 for count in pixels.histogram() if count) > 20, "lines, labels and axes make many shades"


@pytest.mark.subprocess
@pytest.mark.parametrize(("args", "expected"), [(["--help"], "report"), (["demo", "--help"], "--state-file")])
def test_cli_entry_points_answer_help(args: list[str], expected: str) -> None:
    done = subprocess.run([sys.executable, "-m", "oomguard", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout


def test_cli_rejects_a_bad_budget(tmp_path: Path) -> None:
    """One line and status 2 (bad input, as for every command), not a traceback."""
    with pytest.raises(SystemExit, match="oomguard demo: --gpu-memory: cannot read 'lots' as a memory size") as out:
        main(["demo", "--steps", "1", "--gpu-memory", "lots", "--log-file", str(tmp_path / "x.jsonl"), "--quiet"])
    assert out.value.code == 2


def test_report_of_a_missing_log_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot read") as out:
        main(["report", str(tmp_path / "nope.jsonl")])
    assert out.value.code == 2, "bad input, not an answer"
