"""Bad input to the CLI: a damaged event log for ``oomguard report``, an invalid config for ``oomguard plan``.

Neither answers with a traceback. The report skips what it cannot read, counts the rest exactly as in an
undamaged log and ends with one line saying what it skipped; the plan prints one line naming the file, what is
wrong with it and the fix, and exits with status 2 (1 stays "nothing fits").
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oomguard import OOMGuard, plan
from oomguard._backends.memory import MemorySnapshot
from oomguard._backends.units import MiB
from oomguard._cli.main import main
from oomguard._events import (
    ExhaustedEvent,
    FailureSummary,
    FallbackEvent,
    JsonlSink,
    OOMEvent,
    ProgressEvent,
    RecoveredEvent,
    RelaxEvent,
)
from oomguard._ladder.plan import Phase


def _memory(peak: int) -> dict[str, Any]:
    return {"backend": "simulated", "allocated": peak // 2, "reserved": peak, "peak": peak, "capacity": 64 * MiB}


#: A short run as the guard logs it: three OOMs, two fallbacks, a batch given up, a step back up, two progress lines.
GOOD: list[dict[str, Any]] = [
    {"event": "progress", "step": 0, "memory": _memory(30 * MiB), "steps_by_rung": {"none": 1}},
    {"event": "oom", "step": 1, "memory": _memory(40 * MiB), "seconds": 0.25, "rung": None},
    {"event": "fallback", "step": 1, "memory": _memory(20 * MiB), "rung": "micro_batch"},
    {"event": "recovered", "step": 1, "memory": _memory(50 * MiB), "ooms": 1},
    {"event": "oom", "step": 2, "memory": _memory(40 * MiB), "seconds": 0.5, "rung": "micro_batch"},
    {"event": "fallback", "step": 2, "memory": _memory(20 * MiB), "rung": "amp"},
    {"event": "oom", "step": 3, "memory": _memory(40 * MiB), "seconds": 0.25, "rung": "amp"},
    {"event": "exhausted", "step": 3, "memory": _memory(20 * MiB), "reason": "ladder"},
    {"event": "relax", "step": 4, "memory": _memory(40 * MiB), "rung": "amp", "outcome": "held"},
    {"event": "progress", "step": 5, "memory": _memory(45 * MiB), "steps_by_rung": {"none": 1, "micro_batch": 4}},
]

#: Damaged lines, each with (part of) the reason the report gives for skipping it.
DAMAGED: dict[str, tuple[bytes, str]] = {
    "binary": (b"\xff\xfe\x00\x81 garbage \xc3\x28", "not UTF-8"),
    "cut by a crash": (b'{"event": "oom", "step": 4, "seco', "not JSON"),
    "nested too deep": (b"[" * 100_000, "not JSON"),
    "a list": (b"[1, 2, 3]", "not a JSON object"),
    "a string": (b'"oom"', "not a JSON object"),
    "no event name": (b'{"step": 3}', "no event name"),
    "step a string": (b'{"event": "oom", "step": "five", "seconds": 1.0}', "step"),
    "step null": (b'{"event": "recovered", "step": null}', "step"),
    "step a float": (b'{"event": "recovered", "step": 2.5}', "step"),
    "fallback without rung": (b'{"event": "fallback", "step": 2}', "fallback without a rung"),
    "fallback with empty rung": (b'{"event": "fallback", "step": 2, "rung": ""}', "fallback without a rung"),
    "fallback with list rung": (b'{"event": "fallback", "step": 2, "rung": ["amp"]}', "fallback without a rung"),
    "relax without rung": (b'{"event": "relax", "step": 4, "outcome": "held"}', "relax without a rung"),
    "memory a string": (b'{"event": "oom", "step": 3, "memory": "lots", "seconds": 1.0}', "memory"),
    "memory figure a string": (
        b'{"event": "progress", "step": 3, "memory": {"peak": "big", "allocated": 1}, "steps_by_rung": {}}',
        "memory",
    ),
    "progress without memory": (b'{"event": "progress", "step": 3, "steps_by_rung": {"none": 3}}', "memory"),
    "seconds a string": (b'{"event": "oom", "step": 3, "seconds": "slow"}', "seconds"),
    "seconds NaN": (b'{"event": "oom", "step": 3, "seconds": NaN}', "seconds"),
    "steps_by_rung a list": (
        b'{"event": "progress", "step": 3, "memory": {"peak": 1, "allocated": 1}, "steps_by_rung": [1, 2]}',
        "steps_by_rung",
    ),
    "steps_by_rung of strings": (
        b'{"event": "progress", "step": 3, "memory": {"peak": 1, "allocated": 1}, "steps_by_rung": {"amp": "x"}}',
        "steps_by_rung",
    ),
}


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _good_lines() -> list[bytes]:
    return [json.dumps(event).encode() for event in GOOD]


def _report(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    status = main(["report", str(path), *extra])
    captured = capsys.readouterr()
    assert status == 0 and "Traceback" not in captured.err
    return captured.out


@pytest.fixture
def clean_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The report of the undamaged log: what the good events of any damaged one must add up to."""
    out = _report(_write(tmp_path / "clean.jsonl", _good_lines()), capsys)
    assert "3 out-of-memory error(s)" in out and "| micro_batch | 1 | 4 |" in out and "skipped" not in out
    return out


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_the_report_skips_a_damaged_line_and_says_why(
    case: str, clean_table: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line, reason = DAMAGED[case]
    good = _good_lines()
    log = _write(tmp_path / "damaged.jsonl", [*good[:5], line, *good[5:]])
    out = _report(log, capsys)
    assert out.startswith(clean_table + "\n")  # the good events add up as without the damage; then one more line
    skipped = out.removeprefix(clean_table + "\n")
    assert skipped.count("\n") == 1 and skipped.startswith("1 unreadable line(s) skipped: 1 ") and reason in skipped


def test_the_report_of_a_log_with_every_kind_of_damage_counts_the_good_events_and_plots_them(
    clean_table: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = [line for line, _ in DAMAGED.values()]
    lines = [part for pair in zip(_good_lines(), damaged, strict=False) for part in pair] + damaged[len(GOOD) :]
    log = _write(tmp_path / "damaged.jsonl", [b"", *lines, b"   "])  # blank lines are not damage
    png = tmp_path / "memory.png"
    out = _report(log, capsys, "--plot", str(png))
    head = f"{clean_table}\nPlot written to {png}.\n\n"
    assert out.startswith(head)  # the table as without the damage, the plot, and the skipped lines last
    skipped = out.removeprefix(head)
    assert skipped.count("\n") == 1 and skipped.startswith(f"{len(DAMAGED)} unreadable line(s) skipped: ")
    for reason in ("not UTF-8", "not JSON", "not a JSON object", "fallback without a rung", "step"):
        assert reason in skipped
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_log_the_guard_writes_has_nothing_to_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = MemorySnapshot("simulated", allocated=10 * MiB, reserved=12 * MiB, peak=20 * MiB, capacity=None)
    failure = FailureSummary("OutOfMemoryError", "out of memory", Phase.BACKWARD, 1, None, snap)
    sink = JsonlSink(tmp_path / "guard.jsonl")
    for event in (
        ProgressEvent(0, {}, snap, loss=2.0, bucket=0, steps_by_rung={"none": 1}),
        OOMEvent(1, {}, snap, attempt=1, rung=None, error=failure, memory_after_recovery=snap, seconds=0.1),
        FallbackEvent(1, {}, snap, rung="micro_batch", previous_plan={}, memory_at_failure=snap, description="x"),
        RecoveredEvent(1, {}, snap, rungs=("micro_batch",), ooms=1, seconds_lost=0.1, description="x"),
        RelaxEvent(
            2, {}, snap, rung="micro_batch", previous_plan={}, outcome="held", next_try_after=0, description="x"
        ),
        ExhaustedEvent(3, {}, snap, reason="ladder", ooms=1, tried=({},)),
        ProgressEvent(3, {}, snap, loss=1.0, bucket=0, steps_by_rung={"none": 2, "micro_batch": 2}),
    ):
        sink(event)
    out = _report(sink.path, capsys, "--plot", str(tmp_path / "guard.png"))
    assert "4 steps logged (1 run(s)), 1 out-of-memory error(s), 1 batch(es) given up" in out
    assert "skipped" not in out and (tmp_path / "guard.png").is_file()


@pytest.mark.parametrize(
    "content",
    [b"# A README\n\nSome text.\n", b"\xff\xfe\x00binary", b'{"name": "a JSON document", "version": 1}\n'],
)
def test_the_report_refuses_a_file_that_is_not_an_event_log(
    content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `oomguard report README.md` printed an empty table and exited 0."""
    path = tmp_path / "README.md"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as done:
        main(["report", str(path)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"oomguard report: {path} is not an oomguard event log (") and " skipped: " in err
    empty = _write(tmp_path / "empty.jsonl", [])  # a job that has logged nothing yet: nothing wrong with the file
    assert "0 steps logged" in _report(empty, capsys)


def _job(log: Path, steps: int) -> OOMGuard:
    """A guard that ran ``steps`` steps logging to ``log`` (progress at each of the first 10 steps, then every 10th)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    guard = OOMGuard(lambda b: model(b).square().mean(), model=model, optimizer=torch.optim.SGD(model.parameters()),
                     log_file=log, log_every=10)  # fmt: skip
    for _ in range(steps):
        guard(torch.randn(4, 8))
    return guard


def _progress_steps(log: Path) -> list[int]:
    return [e["step"] for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "progress"]


@pytest.mark.parametrize("end", ["close", "drop"])
def test_the_report_counts_every_step_of_a_job_logged_every_tenth_step(
    end: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a 45-step job's log ended at its progress event of step 40, and the report counted 41 steps: the
    last step's progress, not logged by log_every, is written when the guard is closed or dropped."""
    log = tmp_path / "job.jsonl"
    guard = _job(log, 45)
    if end == "close":
        guard.close()
    else:
        del guard
        gc.collect()
    assert _progress_steps(log) == [*range(10), 10, 20, 30, 40, 44]
    assert _report(log, capsys).startswith("45 steps logged (1 run(s)), 0 out-of-memory error(s)")


def test_a_guard_closed_and_used_again_logs_each_step_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "job.jsonl"
    guard = _job(log, 45)
    guard.close()
    guard.close()  # (nothing held any more: nothing written twice)
    import torch

    for _ in range(6):  # steps 45 to 50: 50 is logged, nothing is held after it
        guard(torch.randn(4, 8))
    del guard
    gc.collect()
    assert _progress_steps(log) == [*range(10), 10, 20, 30, 40, 44, 50]
    assert _report(log, capsys).startswith("51 steps logged (1 run(s))")


_LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
}  # fmt: skip

#: Invalid configs: the file's bytes, and what the one-line answer must say.
BAD_CONFIGS: dict[str, tuple[bytes, str]] = {
    "a JSON list": (b'[{"model_type": "llama"}]', "not a JSON object"),
    "a JSON string": (b'"llama"', "not a JSON object"),
    "not JSON": (b"\xff\xfe garbage {", "not JSON"),
    "nested too deep": (b"[" * 100_000, "not JSON"),
    "a negative size": (json.dumps({**_LLAMA, "hidden_size": -1}).encode(), "hidden_size must be a positive int"),
    "a zero size": (json.dumps({**_LLAMA, "num_hidden_layers": 0}).encode(), "num_hidden_layers must be a positive"),
    "a size of the wrong type": (json.dumps({**_LLAMA, "num_hidden_layers": "two"}).encode(), "num_hidden_layers"),
    "a size that is a bool": (json.dumps({**_LLAMA, "vocab_size": True}).encode(), "vocab_size"),
    "a null vocabulary": (json.dumps({**_LLAMA, "vocab_size": None}).encode(), "vocab_size"),
    "an unknown model_type": (json.dumps({**_LLAMA, "model_type": "nosuchmodel"}).encode(), "'nosuchmodel'"),
    "not a causal LM": (json.dumps({"model_type": "t5"}).encode(), "causal"),
    "heads that do not divide": (json.dumps({**_LLAMA, "hidden_size": 10, "num_attention_heads": 3}).encode(), "10"),
    "an unknown activation": (json.dumps({**_LLAMA, "hidden_act": "nosuch"}).encode(), "nosuch"),
    "a rope_theta of the wrong type": (json.dumps({**_LLAMA, "rope_theta": "x"}).encode(), "model"),
}
_PLAN_ARGS = ["--gpu-memory", "80GiB", "--batch-size", "1", "--seq-len", "16"]
_PROGRESS = "oomguard plan: planning "


def _error_line(err: str) -> str:
    """The one line of an error on stderr: after the progress line where planning had begun, nothing else."""
    lines = err.splitlines()
    assert "Traceback" not in err and lines and err.endswith("\n"), err
    assert all(line.startswith(_PROGRESS) for line in lines[:-1]) and len(lines) <= 2, err
    return lines[-1]


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_plan_of_an_invalid_config_is_one_line_and_status_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, expected = BAD_CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", str(path), *_PLAN_ARGS])
    err = _error_line(capsys.readouterr().err)
    assert exit_info.value.code == 2, err
    assert err.startswith(f"oomguard plan: {path}") and expected in err, err
    assert len(err) < 400


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_the_plan_api_raises_value_error_for_an_invalid_config(case: str, tmp_path: Path) -> None:
    content, expected = BAD_CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=str(path)) as raised:
        plan(path, gpu_memory="80GiB", batch_size=1, seq_len=16)
    assert expected in str(raised.value)


def test_an_invalid_config_dict_names_itself() -> None:
    with pytest.raises(ValueError, match="the config dict: hidden_size must be a positive int, got -1"):
        plan({**_LLAMA, "hidden_size": -1}, gpu_memory="80GiB", batch_size=1, seq_len=16)


def test_other_bad_plan_arguments_also_exit_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="unknown model 'gpt-5'") as exit_info:
        main(["plan", "--model", "gpt-5"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith("oomguard plan: unknown model 'gpt-5'")


@pytest.mark.parametrize(
    ("fields", "answer"),
    [
        ({"hidden_size": -1}, "hidden_size must be a positive int, got -1; set it to the model's real size"),
        (  # transformers logs a warning about this one before it fails: that is not ours to print
            {"rope_scaling": {"rope_type": "bogus"}},
            "transformers cannot build a llama model from it: KeyError: 'bogus'; fix the config's fields",
        ),
    ],
)
@pytest.mark.subprocess
def test_the_command_exits_2_with_one_line_on_stderr(fields: dict[str, Any], answer: str, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_LLAMA, **fields}))
    done = subprocess.run(
        [sys.executable, "-m", "oomguard", "plan", "--model", str(path), *_PLAN_ARGS],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert _error_line(done.stderr) == f"oomguard plan: {path}: {answer}"


def test_a_short_run_is_reported_and_plotted_step_by_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 6-step job with one recovered OOM: the report covers all 6 steps, and every step is a point of the plot
    (progress events for each of the first log_every steps), not just step 0."""
    import torch

    from oomguard import oom_guard
    from oomguard.testing import SimulatedGPU

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "short.jsonl"
    step = oom_guard(lambda b: model(b).square().mean(), model=model, optimizer=optimizer, log_file=log)
    with SimulatedGPU("1MiB") as gpu:
        gpu.adopt(model)
        for _ in range(6):
            step(torch.randn(512, 64))
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(e["event"] == "oom" for e in events), "the batch did not fit at first"
    assert sorted(e["step"] for e in events if e["event"] == "progress") == [0, 1, 2, 3, 4, 5]
    out = _report(log, capsys, "--plot", str(tmp_path / "short.png"))
    assert "6 steps logged (1 run(s)), " in out and (tmp_path / "short.png").is_file()


#: Arguments ``oomguard plan`` cannot use (issue 23), and what its one-line answer must say.
BAD_PLAN_ARGUMENTS: dict[str, tuple[list[str], str]] = {
    "a LoRA rank past any int": (["--lora-rank", "99999999999999999999"], "LoRA rank"),
    "a LoRA rank larger than the layers": (["--lora-rank", "100000"], "LoRA rank"),
    "an infinite throughput": (["--gpu-tflops", "inf"], "gpu_tflops"),
    "an infinite bandwidth": (["--link-gbps", "inf"], "link_gbps"),
    "LoRA targets without a rank": (["--lora-targets", "q_proj"], "--lora-targets"),
}


@pytest.mark.parametrize("case", list(BAD_PLAN_ARGUMENTS))
def test_a_plan_argument_it_cannot_use_is_one_line_and_status_2(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Found in issue 23: a traceback (the rank), an answer computed from infinity (the throughput), targets
    silently ignored (LoRA targets without a rank)."""
    arguments, expected = BAD_PLAN_ARGUMENTS[case]
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "gpt2", *_PLAN_ARGS, *arguments])
    err = _error_line(capsys.readouterr().err)
    assert exit_info.value.code == 2, err
    assert err.startswith("oomguard plan: ") and expected in err, err
    assert len(err) < 400


def test_plan_json_is_strict_json_with_non_finite_numbers_as_null(capsys: pytest.CaptureFixture[str]) -> None:
    """Found in issue 23: a predicted time past the float range was printed as ``Infinity``, which no strict JSON
    reader (``jq``, ``json.loads(..., parse_constant=...)`` refusing it) accepts."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"non-standard JSON constant {constant}")

    status = main(["plan", "--model", "gpt2", *_PLAN_ARGS, "--target", "simulated", "--gpu-tflops", "1e-320", "--json"])
    answer = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert status == 0 and answer["fits"] is True
    assert answer["predicted_seconds"] is None and answer["non_finite"]["predicted_seconds"] == "inf"
    assert all(candidate["predicted_seconds"] is None for candidate in answer["candidates"])
    assert answer["non_finite"]["candidates.0.predicted_seconds"] == "inf"
