"""The dry-run planner: its peaks match SimulatedGPU's measurements, its CLI answers for every preset, and
preplan=True starts a job that would run out of memory on a fitting plan."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import lm_batch
from helpers.models import make_llama
from helpers.steps import model_step
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import OOMGuard, Plan, oom_guard, plan
from oomguard._backends.units import format_bytes
from oomguard._cli import planning
from oomguard._cli.main import main
from oomguard._planner.engine import dry_run
from oomguard._planner.presets import PRESETS
from oomguard._planner.report import device_overhead, tensor_budget
from oomguard.testing import SimulatedGPU

LAYERS, HIDDEN = 2, 32
EVERY_RUNG = [
    Plan(),
    Plan(micro_batch_size=2),
    Plan(precision="bf16"),
    Plan(checkpointing="partial"),
    Plan(checkpointing="full"),
    Plan(activation_offload=True),
    Plan(offload_layers=1),
    Plan(micro_batch_size=2, precision="bf16", checkpointing="full", activation_offload=True, offload_layers=LAYERS),
]


def measured_peaks(n: int, length: int, hidden: int) -> list[int]:
    """SimulatedGPU's peak of a real training step on each plan, with Adam's state resident (the second step:
    what the planner predicts)."""
    peaks = []
    for forced in EVERY_RUNG:
        model = make_llama(layers=LAYERS, hidden=hidden)
        guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[])
        guard.plan = forced
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            batch = lm_batch(n, length)
            guard(batch)
            gpu.reset_peak_memory_stats()
            guard(batch)
            peaks.append(gpu.max_memory_allocated())
    return peaks


def predicted_peaks(n: int, length: int, hidden: int) -> list[int]:
    """The planner's peaks for the same plans, from fake tensors."""
    with FakeTensorMode():
        model = make_llama(layers=LAYERS, hidden=hidden)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = lm_batch(n, length)
        report = dry_run(
            lambda b: model(**b), batch, model=model, optimizer=optimizer, capacity=2**40, target="simulated",
            label="llama", plans=EVERY_RUNG,
        )  # fmt: skip
    return [candidate.peak_bytes for candidate in report.candidates]


# The optimizer-bound case uses wider layers: with tiny ones, the simulator's 512-byte rounding of Adam's
# scalar step tensors (host memory on CUDA) alone is a few percent of the peak.
@pytest.mark.parametrize(
    ("n", "length", "hidden", "regime"), [(8, 32, HIDDEN, "activations"), (1, 4, 4 * HIDDEN, "optimizer step")]
)
def test_predicted_peaks_are_within_5_percent_of_simulated_gpu_for_every_rung(
    n: int, length: int, hidden: int, regime: str
) -> None:
    measured, predicted = measured_peaks(n, length, hidden), predicted_peaks(n, length, hidden)
    weights = sum(p.numel() * 4 for p in make_llama(layers=LAYERS, hidden=hidden).parameters())
    if regime == "optimizer step":  # weights + gradients + Adam's two moments: the optimizer step is the peak
        assert 4 * weights <= measured[0] < 5 * weights
    else:
        assert measured[0] > 6 * weights, "activations dominate"
    for forced, real, fake in zip(EVERY_RUNG, measured, predicted, strict=True):
        assert abs(fake - real) <= 0.05 * real, f"{forced.describe(n)}: predicted {fake}, measured {real}"


# The plans that put something of their own on the host (and the plain one, whose host memory is the journal).
HOST_PLANS = [
    *(plan for plan in EVERY_RUNG if plan == Plan() or plan.activation_offload or plan.offload_layers),
    Plan(optimizer_offload=True),
    Plan(precision="bf16", optimizer_offload="master"),
    Plan(offload_layers=1, optimizer_offload=True),
    Plan(activation_offload=True, optimizer_offload=True),
]


def measured_host_peaks(n: int, length: int, hidden: int) -> list[int]:
    """SimulatedGPU's host peak over two steady steps on each plan, each journaled as the first step on a new plan
    is (``step_journal="always"``), its copies kept on the host into the next step."""
    peaks = []
    for forced in HOST_PLANS:
        model = make_llama(layers=LAYERS, hidden=hidden)
        optimizer = torch.optim.AdamW(model.parameters())
        guard = OOMGuard(model_step(model), model=model, optimizer=optimizer, ladder=[], step_journal="always")
        guard.plan = forced
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            batch = lm_batch(n, length)
            guard(batch)  # (Adam's state made: the steps after it are the steady ones)
            gpu.reset_peak_memory_stats()
            guard(batch)
            guard(batch)
            peaks.append(gpu.max_host_memory_allocated())
        guard.close()
    return peaks


@pytest.mark.parametrize(("n", "length", "hidden"), [(8, 32, HIDDEN), (1, 4, 4 * HIDDEN)])
def test_predicted_host_bytes_are_within_5_percent_of_simulated_host_for_every_rung(
    n: int, length: int, hidden: int
) -> None:
    """Before: no host figure at all (then 0 for every plan but the ones whose state was still on the host)."""
    measured = measured_host_peaks(n, length, hidden)
    with FakeTensorMode():
        model = make_llama(layers=LAYERS, hidden=hidden)
        report = dry_run(
            lambda b: model(**b), lm_batch(n, length), model=model, optimizer=torch.optim.AdamW(model.parameters()),
            capacity=2**40, target="simulated", label="llama", plans=HOST_PLANS,
        )  # fmt: skip
    weights = sum(p.numel() * 4 for p in make_llama(layers=LAYERS, hidden=hidden).parameters())
    assert measured[0] >= 3 * weights, "the plain step's journal: the weights and Adam's two moments"
    assert measured[HOST_PLANS.index(Plan(optimizer_offload=True))] >= 6 * weights, "state, copies and journal"
    for forced, real, candidate in zip(HOST_PLANS, measured, report.candidates, strict=True):
        fake = candidate.host_bytes
        assert abs(fake - real) <= 0.05 * real, f"{forced.describe(n)}: predicted {fake} host bytes, measured {real}"
        assert candidate.to_dict(n)["host_bytes"] == fake
    assert report.to_dict()["host_bytes"] == report.chosen.host_bytes
    assert "| host memory |" in report.table()


def test_a_plans_host_figure_is_its_steady_steps_whatever_the_bench_measured_before() -> None:
    """Optimizer offload keeps host buffers from one step to the next, made by its first step: the step measured
    starts with them, as every step but the plan's first does, whether or not an earlier plan on the bench made them
    (before, a plan measured first missed them, where its activations on the host peak beside them: llama-3.2-1b's
    activation offload was 2.3 GB lower measured first than after another plan)."""
    offloaded = Plan(checkpointing="full", activation_offload=True, optimizer_offload=True)

    def host_bytes(plans: list[Plan]) -> int:
        with FakeTensorMode():
            model = make_llama(layers=LAYERS, hidden=4 * HIDDEN)
            report = dry_run(
                lambda b: model(**b), lm_batch(4, 64), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                capacity=2**40, target="simulated", label="llama", plans=plans,
            )  # fmt: skip
        return next(c.host_bytes for c in report.candidates if c.plan == offloaded)

    assert host_bytes([offloaded]) == host_bytes([Plan(optimizer_offload=True), offloaded])


def planned_with_host(host_budget: int | None, capacity: int = 4_500_000, ladder: Any = None) -> Any:
    """The walk down optimizer_offload and quantized_optimizer for a model whose Adam state does not fit 4.5 MB
    (plain: 5.4 MB; state on the host: 2.5 MB and 9.1 MB of host memory; 8-bit state: 3.7 MB, 1.9 MB of host)."""
    with FakeTensorMode():
        model = make_llama(layers=LAYERS, hidden=4 * HIDDEN)
        return dry_run(
            lambda b: model(**b), lm_batch(1, 4), model=model, optimizer=torch.optim.AdamW(model.parameters()),
            capacity=capacity, target="simulated", label="llama",
            ladder=ladder or ["optimizer_offload", "quantized_optimizer"], host_budget=host_budget,
        )  # fmt: skip


def test_a_plan_past_the_host_budget_does_not_fit_and_the_walk_goes_another_way() -> None:
    """Before: dry_run took no host budget; the walk recommended the offloaded state whatever the host had."""
    assert planned_with_host(None).recommended == Plan(optimizer_offload=True)
    report = planned_with_host(3_000_000)
    offloaded = next(c for c in report.candidates if c.plan == Plan(optimizer_offload=True))
    assert not offloaded.fits and offloaded.phase is None and not offloaded.host_fits, "only the host is short"
    reason = offloaded.to_dict(1, report.host_budget_bytes)["reason"]
    assert reason.startswith("host memory: needs ") and "of the 2.9 MiB host budget" in reason
    assert report.recommended == Plan(quantized_optimizer=True), "the ladder's next rung, which the host has room for"
    answer = report.to_dict()
    assert answer["fits"] and answer["host_memory_bytes"] == 3_000_000
    assert all(c["host_bytes"] <= 3_000_000 for c in answer["candidates"] if c["fits"])
    assert "| no (host memory) |" in report.table()


def test_the_report_counts_the_fake_steps_it_ran() -> None:
    """One warm-up step, then one fake step per plan measured; a walk is never cut short for time."""
    report = planned_with_host(None)
    assert report.fake_steps == len(report.candidates) + 1 and report.complete
    assert report.to_dict()["fake_steps"] == report.fake_steps


def test_the_walk_goes_no_deeper_from_a_plan_the_host_has_no_room_for() -> None:
    """Before: from offloaded state that fit neither the device nor the host, the walk went on offloading layers,
    each plan as far past the host budget (TinyLlama at 6 GiB: 15 more plans measured, 20.5 GiB of host each)."""
    ladder = ["optimizer_offload", "layer_offload", "quantized_optimizer"]
    report = planned_with_host(3_000_000, capacity=2_000_000, ladder=ladder)
    offloaded = [c for c in report.candidates if c.plan.optimizer_offload]
    assert len(offloaded) == 1 and not offloaded[0].host_fits and offloaded[0].phase is not None, "both short"
    assert [c.plan.offload_layers for c in report.candidates[2:]] == [1, 2], "on another way: layers, not state"
    assert not report.fits and report.to_dict()["reason"].startswith("host memory: needs "), "the 2 layers' host"


def test_where_nothing_fits_because_the_host_budget_stopped_the_walk_the_answer_names_host_memory() -> None:
    """Before: the answer named only the last plan's device shortfall (TinyLlama at 6 GiB beside 8 GiB of host:
    "device memory runs out in optimizer"), although the plans that fit the device were refused for the host."""
    ladder = ["micro_batch", "amp", "checkpointing", "optimizer_offload", "layer_offload"]
    report = planned_with_host(3_000_000, capacity=2_000_000, ladder=ladder)
    assert not report.fits and report.chosen.host_fits and report.chosen.phase is not None, "the last: device short"
    streamed = next(c for c in report.candidates if c.plan.offload_layers == 2)
    assert streamed.phase is None and not streamed.host_fits, "2 layers streamed fit the device, not the host"
    reason = report.to_dict()["reason"]
    assert reason.startswith("device memory runs out in ") and "host memory: the plans past the 2.9 MiB" in reason
    assert f"needs {format_bytes(streamed.host_bytes)}" in reason and reason in report.table()
    assert "or more host memory" in report.table()


def test_the_walk_recommends_the_first_fitting_plan_and_it_really_fits() -> None:
    batch_args = (16, 48)
    with FakeTensorMode():
        model = make_llama(layers=4, hidden=64)
        report = dry_run(
            lambda b: model(**b), lm_batch(*batch_args), model=model, optimizer=torch.optim.AdamW(model.parameters()),
            capacity=6 * 2**20, target="simulated", label="llama",
        )  # fmt: skip
    assert not report.candidates[0].fits and report.baseline_peak_bytes > 6 * 2**20
    assert report.recommended is not None and report.fits
    assert report.predicted_peak_bytes <= 6 * 2**20
    assert [c.fits for c in report.candidates].index(True) > 0
    # and training on the recommended plan really stays within 6 MiB
    model = make_llama(layers=4, hidden=64)
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[])
    guard.plan = report.recommended
    with SimulatedGPU("6MiB") as gpu:
        gpu.adopt(model)
        for _ in range(2):
            guard(lm_batch(*batch_args))
    assert guard.summary().ooms == 0


def test_preplan_starts_on_a_fitting_plan_with_no_oom(caplog: pytest.LogCaptureFixture) -> None:
    ooms = {}
    for preplan in (False, True):
        model = make_llama(layers=4, hidden=64)
        optimizer = torch.optim.AdamW(model.parameters())
        step = oom_guard(model_step(model), model=model, optimizer=optimizer, preplan=preplan)
        with SimulatedGPU("8MiB") as gpu, caplog.at_level(logging.INFO, logger="oomguard"):
            gpu.adopt(model)
            for _ in range(3):
                result = step(lm_batch(16, 48))
        ooms[preplan] = step.guard.summary().ooms
        assert all(torch.isfinite(p).all() for p in model.parameters()), "the real weights were put back"
        assert result.loss == result.loss, "trained on real tensors"
    assert ooms[False] > 0 and ooms[True] == 0
    assert "preplan: starting on" in caplog.text


def test_preplan_gives_way_to_a_step_it_cannot_run_on_fake_tensors(caplog: pytest.LogCaptureFixture) -> None:
    model = make_llama(layers=2, hidden=32)

    @oom_guard(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), preplan=True)
    def step(batch: dict[str, torch.Tensor]) -> Any:
        assert torch.unique(batch["input_ids"]).numel() > 1  # an output sized by values: unknowable on fake tensors
        return model(**batch)

    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        result = step(lm_batch(4, 16))
    assert result.ooms == 0 and "dry run of this step failed" in caplog.text


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_cli_plans_every_preset(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["plan", "--model", preset, "--gpu-memory", "80GiB", "--batch-size", "1", "--seq-len", "16",
                   "--json"])  # fmt: skip
    answer = json.loads(capsys.readouterr().out)
    assert status == 0 and answer["fits"] is True
    for key in ("baseline_peak_bytes", "predicted_peak_bytes", "device_overhead_bytes"):
        assert isinstance(answer[key], int) and answer[key] > 0
    assert answer["plan"]["micro_batch_size"] == 1 and answer["plan"]["rungs"] == []
    assert answer["predicted_peak_bytes"] == answer["baseline_peak_bytes"]  # the plain step fits 80 GiB


def test_the_cli_plans_for_the_host_memory_given_or_this_machines(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: no --host-memory, no host bytes in the answer."""
    args = ["plan", "--model", "gpt2", "--gpu-memory", "80GiB", "--batch-size", "1", "--seq-len", "16", "--json"]
    assert main([*args, "--host-memory", "64GiB"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["host_memory_bytes"] == 64 * 2**30
    journal = 3 * 124_000_000 * 4  # the journal: gpt2's 124M weights and AdamW's two moments (and step counters)
    assert roomy["host_bytes"] == roomy["candidates"][0]["host_bytes"] > journal
    assert roomy["candidates"][0]["journaled"] is True
    assert main([*args, "--host-memory", "100MiB"]) == 0  # no room for the journal: skipped, the plan still fits
    tight = json.loads(capsys.readouterr().out)
    assert tight["fits"] and tight["host_bytes"] == 0 and tight["candidates"][0]["journaled"] is False
    monkeypatch.setattr(planning, "total_host_memory", lambda: 6 * 2**30)  # (less 1 GiB: the margin's least)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["host_memory_bytes"] == 5 * 2**30, "this machine's, by default"
    with pytest.raises(SystemExit, match="cannot read 'lots' as a memory size"):
        main([*args, "--host-memory", "lots"])


def test_a_config_json_path_plans_like_its_preset(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["gpt2"], "architectures": ["GPT2LMHeadModel"]}))
    by_path = plan(path, gpu_memory="80GiB", batch_size=1, seq_len=16)
    by_name = plan("gpt2", gpu_memory="80GiB", batch_size=1, seq_len=16)
    assert by_path.baseline_peak_bytes == by_name.baseline_peak_bytes


def test_the_text_answer_shows_every_plan_tried(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["plan", "--model", "gpt2", "--gpu-memory", "2.5GiB", "--batch-size", "8", "--seq-len", "128",
                   "--target", "simulated", "--table"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and "| whole batch (baseline) |" in out and "| no (runs out in forward) |" in out
    assert "Recommended: micro-batches of " in out and "(rungs: chunked_loss, micro_batch)" in out


def test_when_nothing_fits_the_answer_says_so() -> None:
    report = plan("gpt2", gpu_memory="1GiB", batch_size=1, seq_len=16, ladder=[])
    assert not report.fits and report.recommended is None
    assert report.baseline_peak_bytes + report.device_overhead_bytes > 2**30
    assert "Nothing on the ladder fits" in report.table() and report.to_dict()["fits"] is False


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
        (["--model", "gpt2", "--seq-len", "4096"], "longer than the model's 1024 positions"),
        (["--model", "gpt2", "--gpu-memory", "-1"], "memory"),
        (["--model", "gpt2", "--batch-size", "0"], "batch_size must be a positive int"),
        (["--model", "gpt2", "--lora-rank", "0"], "LoRA rank must be a positive int"),
        (["--model", "gpt2", "--lora-rank", "8", "--lora-targets", "q_proj"], r"no layer named \['q_proj'\]"),
    ],
)
def test_bad_plan_arguments_get_a_clear_error(args: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["plan", *args])


def test_device_overhead_is_counted_when_deciding_what_fits() -> None:
    budget = tensor_budget(6 * 2**30, "cuda")
    assert budget + device_overhead(budget) <= 6 * 2**30 < budget + 2**20 + device_overhead(budget + 2**20)
    assert tensor_budget(6 * 2**30, "simulated") == 6 * 2**30


@pytest.mark.slow
def test_tinyllama_at_8_x_1024_is_planned_within_two_minutes() -> None:
    """Issue 16's done-when: it fits moving at most a quarter of the 67.4 GiB the layer-streaming plan moved
    per step, and the recommendation is the fitting candidate predicted fastest."""
    report = plan("tinyllama-1.1b", gpu_memory="6GiB", batch_size=8, seq_len=1024)
    assert report.seconds < 120 and report.fits
    assert report.to_dict()["transfer_bytes_per_step"] <= 67.4 * 2**30 / 4
    fitting = [c for c in report.candidates if c.fits]
    assert report.recommended == min(fitting, key=lambda c: c.predicted_seconds).plan
    assert report.recommended is not None and report.recommended.optimizer_offload == "master"


#: The demo's Llama (oomguard.testing.demo_model), as a config the planner builds: width 64, a byte vocabulary.
SMALL_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 168,
               "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128,
               "tie_word_embeddings": False}  # fmt: skip


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [  # (0.58x and 0.3x the plain step's peak on 16 x 64 tokens, 16.3 MB)
        (9_476_587, "whole batch, chunked loss, full checkpointing, activations offloaded"),
        (4_901_683, "micro-batches of 4 (x4), chunked loss, full checkpointing, activations offloaded"),
    ],
)
def test_a_small_model_is_split_into_no_more_micro_batches_than_its_exact_rungs_leave_needed(
    capacity: int, expected: str
) -> None:
    """The ladder splits the batch before it recomputes or offloads activations; on a small model each micro-batch
    costs more than the work it holds. Before splitting, the walk measures the whole batch with checkpointing and
    activation offload as deep as they go (with room for it: it fits, and the walk ends there); where it does not
    fit, the same configuration at the largest micro-batch that fits, beside the walk's own plan."""
    report = plan({**SMALL_LLAMA, "num_hidden_layers": 2}, gpu_memory=capacity, batch_size=16, seq_len=64,
                  target="simulated", host_memory="8GiB")  # fmt: skip
    assert report.recommended is not None and report.recommended.describe(16) == expected
    split = [c for c in report.candidates if c.plan.micro_batches(16) > 1 and c.plan.checkpointing is None]
    if report.recommended.micro_batches(16) == 1:
        assert not split, "no micro-batch measured"
    else:  # (the walk's own plan: micro-batches of 2, chunked loss)
        walked = max((c for c in split if c.fits), key=lambda c: c.plan.effective_micro_batch_size(16))
        assert walked.plan.micro_batches(16) == 8 and walked.predicted_seconds > report.candidates[-1].predicted_seconds


def test_a_fake_tensors_device_is_answered_by_the_planners_outer_mode_and_counted_as_no_operation() -> None:
    """The autograd engine asks each fake tensor's device through the dispatcher, half of a fake step's dispatches:
    the placeholder-reads mode answers (as FakeTensorMode would) without passing the question down to the modes
    below it, and the FLOP count counts no operation for it (no device runs one for a real tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from oomguard._planner.reads import PlaceholderReads
    from oomguard._planner.speed import FlopCount

    class Seen(TorchDispatchMode):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.funcs: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    reads, counted = PlaceholderReads(), FlopCount()
    with FakeTensorMode(), Seen() as seen, reads, reads.counting(counted):  # (seen: below the reads, as the probe)
        weight = torch.nn.Parameter(torch.ones(8, 8))
        loss = (weight @ torch.ones(8, 4)).relu().sum()
        loss.backward()
        device = weight.grad.device  # type: ignore[union-attr]
    assert device == torch.device("cpu") and weight.grad.shape == (8, 8)  # type: ignore[union-attr]
    assert seen.funcs and "prim.device.default" not in seen.funcs  # (the matmul and its gradient did reach it)
    assert counted.ops == len(seen.funcs)  # (every other operation counted once)
