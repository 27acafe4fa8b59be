"""The peer benchmark runs end to end in its quick mode and its table is complete (timings are not checked)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytestmark = pytest.mark.integration  # the benchmarks' smoke tests


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A script from benchmarks/, imported with its folder on sys.path (it imports its sibling modules)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def _rows(markdown: str, heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading``, header row first (the separator row left out)."""
    table: list[list[str]] = []
    for line in markdown.split(heading, 1)[1].splitlines():
        if not line.startswith("|"):
            if table:
                break
            continue
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in table if not set("".join(row)) <= {"-"}]


@pytest.mark.slow  # (67 s of the default run on 2026-12-07: the benchmark's own smoke test)
def test_quick_run_writes_a_complete_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _load("run", monkeypatch)
    tables = _load("_tables", monkeypatch)

    assert run.main(["--quick", "--out", str(tmp_path)]) == 0

    results = json.loads((tmp_path / "results.json").read_text())
    markdown = (tmp_path / "RESULTS.md").read_text()
    header, *rows = _rows(markdown, "## Results")
    assert header == tables.RESULT_COLUMNS
    scenarios = [entry["scenario"]["title"] for entry in results["scenarios"]]
    contenders = list(tables.LABELS.values())
    assert len(scenarios) == 5
    assert [(row[0], row[1]) for row in rows] == [(s, c) for s in scenarios for c in contenders]
    assert all(len(row) == len(header) and all(row) for row in rows), "every cell is filled"
    assert results["meta"]["machine"] and results["meta"]["torch"] and results["meta"]["cores"]
    assert results["overhead"]["median_ratio"] > 0
    assert set(results["largest"]) == {"accelerate", "composer", "oomguard"}
    for heading in ("## Scenarios", "## Happy-path overhead", "## Largest Llama-style model"):
        _, *body = _rows(markdown, heading)
        assert body and all(all(row) for row in body), heading


def test_gpu_script_parses_its_arguments_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = _load("gpu_6gib", monkeypatch)

    defaults = gpu.arguments([])
    assert (defaults.gpu_memory, defaults.batch_size, defaults.seq_len) == ("6GiB", 8, 1024)
    assert defaults.max_seconds <= 480  # the command must end within 8 minutes
    given = gpu.arguments(["--steps", "5", "--max-seconds", "60", "--hand-plan", '{"micro_batch_size": 2}'])
    assert (given.steps, given.max_seconds, given.hand_plan) == (5, 60.0, {"micro_batch_size": 2})
    with pytest.raises(SystemExit):
        gpu.arguments(["--steps", "0"])


def test_the_host_step_benchmark_times_every_contender(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host_step = _load("host_step", monkeypatch)

    assert host_step.main(["--params", "2e6", "--rounds", "1", "--json", str(tmp_path / "host.json")]) == 0
    results = json.loads((tmp_path / "host.json").read_text())["results"]
    assert {result["threads"] for result in results} >= {1}
    for result in results:
        assert {"loop", "foreach", "fused", "guard fused", "guard exact", "guard fused call"} <= set(
            result["parameters_per_s"]
        )
        assert all(rate > 0 for rate in result["parameters_per_s"].values())
        assert "deepspeed" in result["notes"], "DeepSpeed's figure, or why there is none"


def test_the_early_step_benchmark_times_both_steps_and_steps_during_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    early_step = _load("early_step", monkeypatch)
    out = tmp_path / "early.json"
    assert early_step.main(["--width", "64", "--layers", "2", "--batch", "4", "--rounds", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["stepped_early"] == result["parameters"] == 2 * 64 * 64, "every weight stepped during backward"
    assert result["early_seconds"] > 0 and result["after_seconds"] > 0
