"""``oomguard plan`` as a user acts on it (issue 47, item 2): sizes need a unit, the answer comes first with the line
that starts a job on it, ``Plan.from_dict`` reads ``--json``'s plan back, and input it cannot plan is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from oomguard import Plan, oom_guard
from oomguard._backends import host
from oomguard._backends.units import GiB
from oomguard._cli import planning
from oomguard._cli.main import main
from oomguard._planner.report import plan_code
from oomguard.testing import SimulatedGPU

#: A GPT-2 small enough to plan and train in seconds (random weights, built from its config: nothing downloaded).
_TINY = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64}
#: A simulated device its batch of 8 x 64 tokens does not fit whole (about 9 MiB) and micro-batches do.
_SHAPE = ["--batch-size", "8", "--seq-len", "64", "--target", "simulated", "--gpu-memory", "6MiB"]


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_TINY))
    return path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``oomguard`` answers ``argv`` with, having checked it exits with status 2 before planning."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "planning" not in err, err
    return err


@pytest.mark.parametrize("option", ["--gpu-memory", "--host-memory"])
def test_a_memory_size_without_a_unit_is_refused_naming_gib_and_gb(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `--gpu-memory 6` was 6 bytes; it planned for 14 s and answered "nothing fits"."""
    err = _refused(["plan", "--model", "gpt2", option, "6"], capsys)
    assert f"{option} 6 has no unit" in err and "6GiB (6 x 2**30 bytes" in err and "6GB (6 x 10**9 bytes)" in err


def test_a_decimal_unit_is_said_as_the_bytes_it_is() -> None:
    """Before: `6GB` quietly became 5.6 GiB."""
    nbytes, said = planning.memory_size("--gpu-memory", "6GB")
    assert nbytes == 6 * 10**9
    assert said == "(--gpu-memory 6GB is 6,000,000,000 bytes, 5.59 GiB: for 6 x 2**30 bytes write 6GiB)"
    assert planning.memory_size("--gpu-memory", "6GiB") == (6 * GiB, None), "binary units need no word"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--batch-size", "1000000"], "--batch-size 1,000,000 is past the 65,536 sequences a step it plans"),
        (["--seq-len", "2000000"], "--seq-len 2,000,000 is past the 1,048,576 tokens"),
        (["--model", "tinylama"], "unknown model 'tinylama': did you mean 'tinyllama-1.1b'?"),
        (["--model", "qwen"], "did you mean 'qwen2.5-0.5b'?"),
    ],
)
def test_a_batch_past_the_bounds_or_a_mistyped_preset_is_one_line_at_once(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a batch of 1,000,000 planned for over 5 minutes without a word; a mistyped preset got the list of
    presets and no suggestion."""
    err = _refused(["plan", "--model", "gpt2", *argv], capsys)
    assert err.startswith("oomguard plan: ") and expected in err, err


def test_a_missing_extra_is_one_line_naming_the_pip_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a 34-line traceback."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # (as if it were not installed: its import fails)
    with pytest.raises(SystemExit) as done:
        main(["plan", "--model", "gpt2"])
    last = capsys.readouterr().err.splitlines()[-1]
    assert done.value.code == 2 and "Traceback" not in last
    assert last.startswith("oomguard plan: ") and last.endswith("pip install 'oomguard[hf]'"), last


def test_the_default_host_budget_is_the_machines_ram_less_a_stated_margin(tmp_path: Path) -> None:
    """Before: what happened to be available, so the answer moved from run to run. The RAM is capped by the
    container's limit; what is free now does not count."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 33554432 kB\nMemAvailable: 1048576 kB\n")
    assert host.total_host_memory(tmp_path) == 32 * GiB
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("memory\n")
    (cgroup / "memory.max").write_text(str(8 * GiB))
    (cgroup / "memory.current").write_text(str(7 * GiB))
    assert host.total_host_memory(tmp_path) == 8 * GiB, "the container's limit, not its headroom"
    assert host.available_host_memory(tmp_path) == 1 * GiB


def test_the_cli_plans_for_the_ram_less_its_margin_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "total_host_memory", lambda: 64 * GiB)
    budget, said = planning.host_memory(None)
    assert budget == 64 * GiB - int(6.4 * GiB) and said == "this machine's 64.00 GiB of RAM less 10%, at least 1 GiB"
    monkeypatch.setattr(planning, "total_host_memory", lambda: 4 * GiB)
    assert planning.host_memory(None)[0] == 3 * GiB, "at least 1 GiB left free"
    assert planning.host_memory("16GiB") == (16 * GiB, None)


def test_the_answer_comes_first_and_says_how_to_start_on_its_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: nothing for 15-30 s, then a table of up to 22 rows with lines up to 384 characters, and nothing said
    about the code."""
    config = _config(tmp_path)
    argv = ["plan", "--model", str(config), "--batch-size", "2", "--seq-len", "16", "--gpu-memory", "6GB"]
    assert main([*argv, "--host-memory", "8GiB"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith(f"oomguard plan: planning {config}, 2 x 16 tokens, a 5.59 GiB GPU") and err.count("\n") == 1
    lines = out.splitlines()
    assert lines[0] == f"{config}: a batch of 2 x 16 tokens, AdamW, on a 5.59 GiB CUDA device"
    assert lines[1] == "Fits: whole batch" and lines[2].startswith("Device peak: ") and " GiB of 5.59 GiB (" in lines[2]
    assert lines[3].startswith("Host peak: ") and lines[3].endswith(" of 8.00 GiB")
    assert lines[4].startswith("Predicted step: ")
    assert lines[5] == "In your code: train_step.guard.plan = Plan()", "the whole batch fits: the plain plan"
    assert lines[6].strip().startswith("(train_step: the function you decorated with @oom_guard")
    assert lines[7].startswith("(planned in ") and lines[8].startswith("(--gpu-memory 6GB is 6,000,000,000 bytes")
    assert "| plan |" not in out and len(lines) == 9 and max(map(len, lines[1:])) <= 120, out
    assert main(argv) == 0, "(this machine's RAM less its margin)"
    assert "GiB of RAM less 10%, at least 1 GiB)" in capsys.readouterr().out
    preset = ["plan", "--model", "gpt2", "--batch-size", "1", "--seq-len", "16", "--gpu-memory", "80GiB", "--table"]
    assert main(preset) == 0
    tabled = capsys.readouterr().out
    assert tabled.startswith("gpt2: a batch of 1 x 16 tokens, AdamW, on a 80.00 GiB CUDA device\nFits: whole batch\n")
    assert tabled.index("In your code: train_step.guard.plan = Plan()") < tabled.index("| plan | tensor peak |")


def test_plan_from_dict_of_the_json_plan_starts_a_guard_on_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan `--json` answers, read back with Plan.from_dict (before: "unknown plan field(s) ['micro_batches',
    'rungs']"), starts a guard that trains the planned batch on the planned device without an out-of-memory error,
    as the text answer's code line does (:func:`plan_code`, the Python that makes the plan)."""
    config = _config(tmp_path)
    assert main(["plan", "--model", str(config), *_SHAPE, "--host-memory", "8GiB", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    planned = Plan.from_dict(answer["plan"])
    assert eval(plan_code(planned), {"Plan": Plan}) == planned
    assert planned.micro_batches(8) > 1 and planned.checkpointing, "the whole batch does not fit, nor micro-batches"

    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @oom_guard(model=model, optimizer=optimizer, tune_after=None, relax_after=None)
    def train_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    train_step.guard.plan = planned
    ids = torch.randint(0, 256, (8, 64))
    with SimulatedGPU("6MiB") as gpu:
        gpu.adopt(model)
        result = train_step({"input_ids": ids, "labels": ids})
    assert result.ooms == 0 and result.plan == planned, result
