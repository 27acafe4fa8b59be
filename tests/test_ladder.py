"""The full ladder on a small transformers Llama: every rung lowers the simulated peak and keeps the maths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import lm_batch as planner_batch
from helpers.batches import tuple_batch
from helpers.events import first_event
from helpers.models import make_llama, make_mlp
from helpers.optimizers import RecordingSGD
from helpers.steps import LADDER_WITHOUT_OPTIMIZER_OFFLOAD, model_step, mse_step
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import Amp, LadderExhausted, OOMGuard, Plan, RungContext, oom_guard
from oomguard._ladder.ladder import resolve_ladder
from oomguard._planner.engine import dry_run
from oomguard._planner.search import configurations
from oomguard.testing import SimulatedGPU

LAYERS, HIDDEN = 4, 64


def lm_batch(n: int = 16, length: int = 48, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def measure(plan: Plan, batch: dict[str, torch.Tensor]) -> tuple[int, list[torch.Tensor], float]:
    """Peak device memory above the resident weights for one step on ``plan``; the gradients; the loss."""
    model = make_llama(layers=LAYERS, hidden=HIDDEN)
    optimizer = RecordingSGD(model.parameters())
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=optimizer, ladder=[])
    guard.plan = plan
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        base = gpu.memory_allocated()
        gpu.reset_peak_memory_stats()
        loss = guard(batch).loss
        peak = gpu.max_memory_allocated() - base
    return peak, [g for g in optimizer.seen[0] if g is not None], loss


@pytest.fixture(scope="module")
def reference() -> tuple[int, list[torch.Tensor], float]:
    return measure(Plan(), lm_batch())


@pytest.mark.parametrize(
    "plan",
    [
        Plan(checkpointing="partial"),
        Plan(checkpointing="full"),
        Plan(activation_offload=True),
        Plan(offload_layers=2),
        Plan(offload_layers=LAYERS),
        Plan(checkpointing="full", offload_layers=LAYERS),  # streaming under recompute
        Plan(micro_batch_size=4, offload_layers=LAYERS),  # streaming across micro-batches
    ],
    ids=lambda plan: plan.describe(),
)
def test_exact_rungs_lower_the_peak_and_keep_gradients_identical(plan: Plan, reference: Any) -> None:
    peak, grads, loss = measure(plan, lm_batch())
    ref_peak, ref_grads, ref_loss = reference
    assert peak < ref_peak
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    exact = plan.micro_batch_size is None  # micro-batches change float summation order, nothing else
    for a, b in zip(ref_grads, grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp_lowers_the_peak_within_a_documented_tolerance(precision: str, reference: Any) -> None:
    peak, grads, loss = measure(Plan(precision=precision), lm_batch())  # type: ignore[arg-type]
    ref_peak, ref_grads, ref_loss = reference
    assert peak < 0.9 * ref_peak, "activations are stored in half precision"
    # Documented tolerance: the loss within 1%, each gradient within 5% of its largest entry (half precision
    # keeps 8 (bf16) or 11 (fp16) bits of mantissa in the matmuls).
    assert loss == pytest.approx(ref_loss, rel=1e-2)
    for a, b in zip(ref_grads, grads, strict=True):
        assert (a - b).abs().max() <= 0.05 * a.abs().max() + 1e-6


@pytest.mark.parametrize("activation_offload", [False, True], ids=["layer offload", "layer and activation offload"])
def test_offload_under_amp_keeps_amps_gradients_exactly(activation_offload: bool) -> None:
    """Weights' half-precision copies are made again in backward rather than kept: the same casts, so the same
    gradients, bit for bit, as amp alone."""
    batch = lm_batch()
    amp_peak, amp_grads, amp_loss = measure(Plan(precision="bf16"), batch)
    plan = Plan(precision="bf16", activation_offload=activation_offload, offload_layers=LAYERS)
    peak, grads, loss = measure(plan, batch)
    assert peak < amp_peak
    assert loss == amp_loss
    for a, b in zip(amp_grads, grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_generic_model_checkpointing_wraps_its_repeated_blocks() -> None:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(6)])

    x, y = torch.randn(256, 16), torch.randn(256, 16)
    results = []
    for plan in (Plan(), Plan(checkpointing="full")):
        model = build()
        optimizer = RecordingSGD(model.parameters())
        guard = OOMGuard(
            lambda b, m=model: torch.nn.functional.mse_loss(m(b[0]), b[1]), model=model, optimizer=optimizer
        )
        guard.plan = plan
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            gpu.reset_peak_memory_stats()
            guard((x, y))
            results.append((gpu.max_memory_allocated(), optimizer.seen[0]))
        guard.close()
        assert "forward" not in vars(model[0]), "checkpointing is undone"
    (peak_plain, grads_plain), (peak_ckpt, grads_ckpt) = results
    assert peak_ckpt < peak_plain
    for a, b in zip(grads_plain, grads_ckpt, strict=True):
        assert torch.equal(a, b)


def steady_peak(plan: Plan, batch: dict[str, torch.Tensor]) -> int:
    """The device peak of a second AdamW step on ``plan`` (weights, Adam's state and the step's own memory)."""
    model = make_llama(layers=LAYERS, hidden=HIDDEN)
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[])
    guard.plan = plan
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(batch)
        gpu.reset_peak_memory_stats()
        guard(batch)
        return gpu.max_memory_allocated()


def test_when_micro_batch_one_does_not_fit_in_fp32_the_guard_goes_deeper(tmp_path: Path) -> None:
    batch = lm_batch(n=4, length=256)  # long enough that activations, not weights, set the peak
    fp32, bf16 = (
        steady_peak(Plan(micro_batch_size=1), batch),
        steady_peak(Plan(micro_batch_size=1, precision="bf16"), batch),
    )
    assert bf16 < fp32
    model = make_llama(layers=LAYERS, hidden=HIDDEN)
    log = tmp_path / "events.jsonl"
    # The walk itself, rung by rung (predictive=False: no jump to the planner's prediction, tests/test_jump.py).
    step = oom_guard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()), log_file=log,
                     predictive=False)  # fmt: skip
    with SimulatedGPU((fp32 + bf16) // 2) as gpu:
        gpu.adopt(model)
        results = [step(batch) for _ in range(4)]
    assert sum(r.ooms for r in results) >= 3
    assert "amp" in results[-1].rungs, "a rung beyond micro-batching was needed"
    assert results[-1].ooms == 0, "the plan it settled on keeps fitting"
    assert results[-1].loss < results[0].loss
    fallbacks = [json.loads(line) for line in log.read_text().splitlines() if '"fallback"' in line]
    rungs = [event["rung"] for event in fallbacks]
    # (the chunked loss first: the Llama's loss is transformers' own, so the first rung applies)
    assert rungs[:4] == ["chunked_loss", "micro_batch", "micro_batch", "amp"], "then micro-batches halve, then amp"
    for event in fallbacks:  # the log names each rung with memory at the failure and after recovery
        assert event["memory_at_failure"]["allocated"] > event["memory"]["allocated"]
    # After a deeper rung engages the batch is tried whole again: the guard settles on the plan with the largest
    # micro-batches that fits.
    assert fallbacks[3]["plan"]["micro_batch_size"] is None


@pytest.mark.slow  # (about 70 s: the walk goes through every rung to the last; the fault sweep's layer-offload
# configurations and tests/test_traffic.py keep layer offload in the default run)
def test_state_larger_than_the_device_trains_only_through_layer_offload() -> None:
    model = make_llama(layers=8, hidden=64)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(2.5 * params)  # weights + gradients + two Adam moments = 4x the weights: cannot fit
    step = oom_guard(
        lambda b: model(**b),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        ladder=LADDER_WITHOUT_OPTIMIZER_OFFLOAD,
    )  # (optimizer_offload would answer first: its own test)
    batch = lm_batch(n=2, length=16)
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        results = [step(batch) for _ in range(3)]
        peak = gpu.max_memory_allocated()
    assert "layer_offload" in results[-1].rungs
    assert step.guard.plan.offload_layers > 0
    assert step.guard.summary().fallbacks["layer_offload"] >= 1
    assert results[-1].loss < results[0].loss
    assert peak <= budget
    # ...and only through it: every other rung together does not make the step fit.
    model = make_llama(layers=8, hidden=64)
    others = ["micro_batch", "amp", "checkpointing", "activation_offload"]
    step = oom_guard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=others)
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        with pytest.raises(LadderExhausted):
            step(batch)


def test_with_every_layer_offloaded_less_than_the_weights_stays_on_the_device() -> None:
    model = make_llama(layers=8, hidden=64)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[])
    guard.plan = Plan(offload_layers=8)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for _ in range(2):
            guard(lm_batch(n=2, length=16))
            between_steps = gpu.memory_allocated()
            assert between_steps < params / 2, (between_steps, params)


@pytest.mark.slow  # (about 40 s: every rung walked; tests/test_host_memory.py and test_chunked_loss.py end in
# LadderExhausted in the default run)
def test_a_budget_nothing_fits_ends_in_ladder_exhausted() -> None:
    model = make_llama(layers=2, hidden=64)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    step = oom_guard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()))
    with SimulatedGPU(int(1.05 * params)) as gpu:
        gpu.adopt(model)
        with pytest.raises(LadderExhausted) as info:
            step(lm_batch(n=2, length=16))
    message = str(info.value)
    assert "every plan on the ladder ran out of memory" in message
    for name in ("bf16", "checkpointing", "activations offloaded", "layer(s) offloaded"):
        assert name in message, f"{name} is listed among the plans tried"
    assert "What you can do" in message


def test_every_rung_is_undone_cleanly() -> None:
    model = make_llama(layers=LAYERS, hidden=HIDDEN)
    optimizer = torch.optim.AdamW(model.parameters())
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=optimizer, ladder=[])
    guard.plan = Plan(
        micro_batch_size=4, precision="bf16", checkpointing="full", activation_offload=True, offload_layers=2
    )
    batch = lm_batch()
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(batch)
        assert not all(gpu.is_device(p) for p in model.parameters())
        guard.close()
        assert all(gpu.is_device(p) for p in model.parameters()), "parameters are back on the device"
        assert all(gpu.is_device(t) for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
        guard.plan = Plan()  # and a relaxed plan trains as before
        result = guard(batch)
    assert result.rungs == ()
    assert not any(block.gradient_checkpointing for block in model.model.layers)
    for block in model.model.layers:
        assert not block._forward_hooks and not block._forward_pre_hooks
        for p in block.parameters():
            assert not p._post_accumulate_grad_hooks


def test_fp16_scaler_state_survives_a_retry_unchanged() -> None:
    model, reference = make_mlp(), make_mlp()
    step = oom_guard(
        mse_step(model),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        ladder=["micro_batch", Amp(dtype="fp16")],
    )
    ref = OOMGuard(
        mse_step(reference), model=reference, optimizer=torch.optim.Adam(reference.parameters(), lr=1e-3), ladder=[]
    )
    step.guard.plan = ref.plan = Plan(precision="fp16")
    entry: list[int] = []
    step.guard.optimizer.register_step_pre_hook(lambda *_: entry.append(gpu.allocations))
    batches = [tuple_batch(seed=s) for s in range(3)]
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        step(batches[0])
        start = gpu.allocations
        step(batches[1])
        gpu.fail_allocation(entry[-1] - start + 1)  # inside the optimizer step that scaler.step runs
        result = step(batches[2])
    for batch in batches:
        ref(batch)
    assert result.ooms == 1
    assert first_event(step.guard.events, "oom").error.phase == "optimizer"
    assert step.guard.effects._scaler_state == ref.effects._scaler_state, (
        "scale and growth tracker as without the fault"
    )


@pytest.mark.parametrize(
    "plan",
    [
        Plan(micro_batch_size=1, precision="bf16"),
        Plan(offload_layers=2),
        Plan(micro_batch_size=1, checkpointing="full", offload_layers=LAYERS),
        Plan(activation_offload=True, checkpointing="partial"),
    ],
    ids=lambda plan: plan.describe(),
)
def test_memory_is_back_to_baseline_after_an_oom_anywhere_in_the_step(plan: Plan) -> None:
    """Faults at sampled allocations of a step, on each rung: nothing the failed attempt held stays behind.

    Two leaks this caught: a backward that raises leaves its queued gradients in autograd's engine until the
    next backward, and a block whose streaming-in failed half-way was not released.
    """
    model = make_llama(layers=LAYERS, hidden=HIDDEN)
    guard = OOMGuard(lambda b: model(**b), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[])
    guard.plan = plan
    batch = lm_batch(n=2, length=16)
    leaks = []
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(batch)
        start = gpu.allocations
        guard(batch)
        per_step = gpu.allocations - start
        for index in range(1, per_step, max(1, per_step // 12)):
            guard.close()  # giving up undoes every effect of the plan: the baseline is the model without them
            baseline = gpu.memory_allocated()
            gpu.fail_allocation(index)
            with pytest.raises(LadderExhausted):
                guard(batch)
            if gpu.memory_allocated() != baseline:
                phase = [e for e in guard.events if e.kind == "oom"][-1].error.phase  # type: ignore[attr-defined]
                leaks.append((index, phase, gpu.memory_allocated() - baseline))
    assert not leaks, f"(allocation index, phase, bytes left behind): {leaks}"


def test_the_effects_keep_the_device_type_they_were_built_on() -> None:
    """Found in review: the device type was read from the first parameter at each forward, and layer offload
    points offloaded parameters at host copies, so a CUDA model's autocast (and GradScaler) would have been the
    CPU's: bf16 planned, fp32 run, nothing relieved. Here the first parameter moves to the meta device."""
    from oomguard._effects.base import EffectTarget

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    target = EffectTarget(model, torch.optim.SGD(model.parameters(), lr=0.1), list(model))
    model[0].weight = torch.nn.Parameter(torch.empty(4, 4, device="meta"))  # the first parameter is elsewhere now
    assert target.device_type == "cpu"


# -- a plan says what runs: optimizer offload's master level (issue 23) ------------------------------------------

MASTER = Plan(precision="bf16", optimizer_offload="master")


@pytest.mark.parametrize(
    "fields",
    [{}, {"precision": "fp16"}, {"precision": "bf16", "offload_layers": 1}],
    ids=["fp32", "fp16", "offloaded layers"],
)
def test_a_master_plan_that_would_not_keep_master_weights_is_refused_where_it_is_written(fields: Any) -> None:
    """Found in issue 23: ``Plan(optimizer_offload="master")`` without bf16 (or with offloaded layers) ran the first
    level (fp32 weights on the device) but was described, reported and logged as the master level."""
    with pytest.raises(ValueError, match=r"optimizer_offload='master' keeps .* only with precision='bf16' and no "):
        Plan(optimizer_offload="master", **fields)
    with pytest.raises(ValueError, match="optimizer_offload=True"):  # the error names the plan that would run
        Plan.from_dict({"optimizer_offload": "master", **fields})


def test_a_change_that_takes_away_what_the_master_level_needs_takes_the_master_level_away() -> None:
    """Everything that derives plans (relaxing a rung, the ranks' agreement, the planner's search) changes fields
    one at a time: a plan that loses bf16 or gains offloaded layers keeps its optimizer state on the host, no more."""
    for changed in (MASTER.replace(precision=None), MASTER.replace(precision="fp16"), MASTER.replace(offload_layers=2)):
        assert changed.optimizer_offload is True and "master" not in changed.describe(), changed
    rung, relaxed = resolve_ladder(["optimizer_offload", "amp"]).relax(MASTER, 8)  # amp engaged before the master
    assert (rung.name, relaxed.precision, relaxed.optimizer_offload) == ("amp", None, True)
    ladder = resolve_ladder(None)
    fp16_rank = Plan(precision="fp16", optimizer_offload=True)
    levels = [max(a, b) for a, b in zip(ladder.levels(MASTER, 8), ladder.levels(fp16_rank, 8), strict=True)]
    assert ladder.at_levels(MASTER, levels, 8) == fp16_rank, "the ranks agree on fp16: no master weights"
    context = RungContext(batch_size=8, num_blocks=2)
    planned = [plan for _, plan in configurations(MASTER, ladder, context)]
    assert Plan(optimizer_offload=True) in planned and all(
        plan.precision == "bf16" for plan in planned if plan.optimizer_offload == "master"
    )


def test_the_planner_without_bf16_recommends_no_master_weights(tmp_path: Path) -> None:
    """The master level keeps bf16 weights: ``oomguard plan --no-bf16`` measured it in bf16 and offered it as
    fp16 with fp32 masters, a plan that runs the first level (whose peak it had not measured)."""

    def planned(capacity: int, plans: list[Plan] | None = None, bf16: bool = True) -> Any:
        with FakeTensorMode():
            model = make_llama(layers=2, hidden=64)
            return dry_run(
                model_step(model), planner_batch(1, 4), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                capacity=capacity, target="simulated", label="llama", plans=plans, max_grad_norm=1.0, bf16=bf16,
            )  # fmt: skip

    state, master = (c.peak_bytes for c in planned(2**40, [MASTER.replace(optimizer_offload=True), MASTER]).candidates)
    report = planned((state + master) // 2, bf16=False)  # where the master level is the only plan without streaming
    assert report.candidates and all(c.plan.precision != "bf16" for c in report.candidates)
    assert not any(c.plan.optimizer_offload == "master" for c in report.candidates), report.table()
    assert report.recommended is None or report.recommended.offload_layers > 0
