"""The quantized_optimizer rung: Adam's moments in block-wise 8-bit storage, the user's own AdamW stepping them
chunk by chunk. Issue 17's first done-when, and what users meet: checkpoints, schedulers, hooks, undo."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.batches import lm_batch
from helpers.models import make_llama
from helpers.steps import model_step, train_on, train_unguarded

from oomguard import GuardConfigError, LadderExhausted, OOMGuard, Plan, QuantizedOptimizer, RungContext
from oomguard._effects.quantized import Quantized, dequantize, quantize
from oomguard.testing import SimulatedGPU

BATCHES = [lm_batch(2, 16) for _ in range(3)]
LR = 1e-3


Trained = tuple[torch.nn.Module, OOMGuard, list[int], int]


def run(plan: Plan | None, budget: int | str = "1GiB", ladder: list[str] | None = None) -> Trained:
    """A fresh Llama trained on BATCHES: the model, the guard, each step's OOMs and the last step's peak."""
    model = make_llama(layers=2, hidden=64)
    guard, results, peak = train_on(model, torch.optim.AdamW(model.parameters(), lr=LR), BATCHES, plan, budget, ladder)
    return model, guard, [r.ooms for r in results], peak


def reference() -> torch.nn.Module:
    return train_unguarded(make_llama(layers=2, hidden=64), BATCHES, lr=LR)


def test_state_that_fits_only_in_8_bits_trains_after_one_oom_within_10_percent_of_the_fp32_update() -> None:
    *_, fp32_peak = run(Plan())
    *_, quantized_peak = run(Plan(quantized_optimizer=True))
    model, guard, ooms, _ = run(None, budget=(fp32_peak + quantized_peak) // 2, ladder=["quantized_optimizer"])
    assert ooms == [1, 0, 0] and guard.plan == Plan(quantized_optimizer=True)
    start, expected = make_llama(layers=2, hidden=64), reference()
    change = max((e - s).abs().max().item() for e, s in zip(expected.parameters(), start.parameters(), strict=True))
    error = max((m - e).abs().max().item() for m, e in zip(model.parameters(), expected.parameters(), strict=True))
    assert 0 < error <= 0.10 * change, f"update error {error / change:.1%} of the largest change"
    moments = [v for s in guard.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert sum(isinstance(m, Quantized) for m in moments) >= len(moments) // 2, "(biases and norms stay fp32)"
    fp32_bytes = sum(m.shape.numel() * 4 for m in moments)
    stored = sum(m.nbytes if isinstance(m, Quantized) else m.numel() * 4 for m in moments)
    assert stored <= 0.3 * fp32_bytes, f"state at {stored / fp32_bytes:.2f}x of fp32's"


def test_undo_gives_back_fp32_moments_equal_to_what_the_8_bits_stood_for() -> None:
    _, guard, _, _ = run(Plan(quantized_optimizer=True))
    before = {(id(p), k): dequantize(v) for p, s in guard.optimizer.state.items() for k, v in s.items()
              if isinstance(v, Quantized)}  # fmt: skip
    guard.close()
    after = {(id(p), k): v for p, s in guard.optimizer.state.items() for k, v in s.items() if (id(p), k) in before}
    assert before and before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) and after[key].dtype == torch.float32 for key in before)


@pytest.mark.parametrize("margin", [1.02, 1.1])
def test_a_plan_runs_within_a_budget_just_above_its_own_peak(margin: float) -> None:
    """Before: under 1.02x and 1.1x of its unconstrained peak the second step ran out of memory in the optimizer.
    Memory pressure sent the step down the undoable (journaled) path, whose copy of the state structure kept every
    old 8-bit code alive while the step made new ones; the codes are now rewritten in place (and journaled as any
    state tensor). The jump and the planner rely on a plan's peak being its peak."""
    *_, peak = run(Plan(quantized_optimizer=True))
    model, guard, ooms, _ = run(Plan(quantized_optimizer=True), budget=int(peak * margin))
    assert ooms == [0, 0, 0] and guard.transaction.journaled_steps >= 2, "journaled steps, under pressure"
    expected, _, _, _ = run(Plan(quantized_optimizer=True))
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), "the journaled path steps exactly as the fast one"


def test_checkpoints_schedulers_and_hooks_see_an_ordinary_adamw() -> None:
    model = make_llama(layers=2, hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    stepped: list[int] = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(1))
    guard = OOMGuard(model_step(model), model=model, optimizer=optimizer, scheduler=scheduler, ladder=[],
                     tune_after=None)  # fmt: skip
    guard.plan = Plan(quantized_optimizer=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a scheduler that thinks the step was overridden or skipped warns)
        for batch in BATCHES:
            guard(batch)
    assert len(stepped) == len(BATCHES), "the user's hooks run once a step, not once a chunk"
    assert scheduler.last_epoch == len(BATCHES)
    saved = optimizer.state_dict()
    moments = [v for s in saved["state"].values() for k, v in s.items() if k != "step"]
    assert moments and all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in moments)
    live = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    assert any(isinstance(v, Quantized) for v in live), "the live state is untouched"
    optimizer.load_state_dict(saved)  # fp32 loaded: quantized again while the rung is engaged
    again = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    assert [isinstance(v, Quantized) for v in again] == [isinstance(v, Quantized) for v in live]


def test_other_optimizers_are_skipped_by_the_rung_and_refused_by_a_plan() -> None:
    assert QuantizedOptimizer().escalate(Plan(), RungContext(batch_size=2, optimizer_quantizable=False)) is None
    model = make_llama(layers=2, hidden=64)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = OOMGuard(model_step(model), model=model, optimizer=sgd, ladder=["quantized_optimizer"])
    with SimulatedGPU("600KiB") as gpu:  # (the weights fit, a step does not)
        gpu.adopt(model)
        with pytest.raises(LadderExhausted):
            guard(BATCHES[0])
    guard.plan = Plan(quantized_optimizer=True)
    with pytest.raises(GuardConfigError, match="Adam and AdamW"):
        guard(BATCHES[0])


def test_offloading_the_state_ends_its_quantization() -> None:
    from oomguard import LayerOffload, OptimizerOffload

    quantized, context = Plan(quantized_optimizer=True), RungContext(batch_size=2, num_blocks=2)
    assert OptimizerOffload().escalate(quantized, context) == Plan(optimizer_offload=True)
    assert LayerOffload().escalate(quantized, context) == Plan(offload_layers=1)
    assert QuantizedOptimizer().escalate(Plan(optimizer_offload=True), context) is None


def test_8_bit_codes_keep_small_values_relative_to_themselves() -> None:
    """Within a block spanning four decades every value keeps about 3 significant bits (6.25 % at worst), and the
    square-root form keeps non-negative values the same way over twice the decades."""
    values = torch.logspace(-4, 0, 256) * torch.tensor([1.0, -1.0]).repeat(128)
    relative = ((dequantize(quantize(values)) - values) / values).abs()
    assert relative.max() <= 0.0625
    squares = values.square()
    assert ((dequantize(quantize(squares, root=True)) - squares) / squares).abs().max() <= 0.13
    assert quantize(torch.zeros(3)).nbytes == 256 + 4 and torch.equal(dequantize(quantize(torch.zeros(3))),
                                                                       torch.zeros(3))  # fmt: skip


def test_the_planner_measures_8_bit_state_as_training_does() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomguard._planner.engine import dry_run

    with FakeTensorMode():
        model = make_llama(layers=2, hidden=64)
        report = dry_run(
            model_step(model), lm_batch(2, 16), model=model, optimizer=torch.optim.AdamW(model.parameters()),
            capacity=2**40, target="simulated", label="llama", plans=[Plan(), Plan(quantized_optimizer=True)],
        )  # fmt: skip
    plain, quantized = (c.peak_bytes for c in report.candidates)
    *_, measured = run(Plan(quantized_optimizer=True))
    assert quantized < plain and quantized == pytest.approx(measured, rel=0.05)


def test_oomguard_plan_recommends_8_bit_state_when_its_ladder_has_it(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from oomguard._cli.main import main

    args = ["plan", "--model", "gpt2", "--gpu-memory", "2.5GiB", "--batch-size", "2", "--seq-len", "64", "--json"]
    assert main([*args, "--ladder", "micro_batch"]) == 1, "fp32 weights, gradients and Adam state do not fit"
    capsys.readouterr()
    assert main([*args, "--ladder", "micro_batch,quantized_optimizer"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] and answer["plan"]["quantized_optimizer"] is True
    with pytest.raises(SystemExit) as bad:
        main([*args, "--ladder", "micro_batch,quantize"])
    assert bad.value.code == 2 and "unknown rung 'quantize'" in capsys.readouterr().err
