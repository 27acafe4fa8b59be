"""optimizer_offload's second level: bf16 weights on the device, fp32 master weights and the optimizer on the host.
Half the device memory for weights and gradients, 4 bytes per parameter moved a step, amp's maths, undone bit
for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import make_llama, train_on
from test_planner import lm_batch, model_step
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import LayerOffload, OptimizerOffload, Plan, RungContext
from oomguard._planner.engine import dry_run
from oomguard.testing import SimulatedGPU

BATCHES = [lm_batch(2, 16) for _ in range(3)]
AMP = Plan(precision="bf16")
STATE = AMP.replace(optimizer_offload=True)
MASTER = AMP.replace(optimizer_offload="master")


def trained(plan: Plan | None, ladder: list[str] | None = None, budget: int | str = "1GiB") -> tuple[Any, ...]:
    """A fresh Llama trained on BATCHES on ``plan`` (None: down ``ladder``); the model, the guard, the results and
    the peak of the last step."""
    model = make_llama(layers=2, hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard, results, peak = train_on(model, optimizer, BATCHES, plan, budget, ladder)
    return model, guard, results, peak


def distance(a: torch.nn.Module, b: torch.nn.Module, start: torch.nn.Module) -> float:
    """How far ``a``'s weights are from ``b``'s, relative to how far ``b`` moved from ``start``."""
    gap = sum((p.float() - q).square().sum() for p, q in zip(a.parameters(), b.parameters(), strict=True))
    moved = sum((q - s).square().sum() for q, s in zip(b.parameters(), start.parameters(), strict=True))
    return float((gap / moved).sqrt())


def test_master_weights_halve_weights_and_gradients_on_the_device_and_move_four_bytes_a_parameter() -> None:
    weights = sum(p.numel() * 4 for p in make_llama(layers=2, hidden=64).parameters())
    _, _, state_results, state_peak = trained(STATE)
    _, _, master_results, master_peak = trained(MASTER)
    assert state_peak - master_peak >= weights, "fp32 weights and gradients (8 B) become bf16 (4 B)"
    assert state_results[-1].transfer_bytes == 3 * weights, "level 1: parameters and gradients down, parameters up"
    assert master_results[-1].transfer_bytes == weights, "bf16 gradients down, bf16 parameters up"


def test_master_weights_train_within_amps_tolerance() -> None:
    start = make_llama(layers=2, hidden=64)
    fp32, *_ = trained(Plan())
    amp, _, amp_results, _ = trained(AMP)
    master, _, master_results, _ = trained(MASTER)
    assert distance(amp, fp32, start) < 1.0, "(amp itself is close to fp32)"
    assert distance(master, fp32, start) <= 2 * distance(amp, fp32, start)
    for ours, theirs in zip(master_results, amp_results, strict=True):
        assert ours.loss == pytest.approx(theirs.loss, rel=1e-2)


def test_closing_puts_every_fp32_master_back_on_the_device_bit_for_bit() -> None:
    model, guard, _, _ = trained(MASTER)
    effect = next(e for e in guard.effects._effects if type(e).__name__ == "OptimizerOffloadEffect")
    masters = {id(p): m.clone() for p, m in effect._masters.items()}
    assert masters and all(p.dtype == torch.bfloat16 for p in model.parameters() if id(p) in masters)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard.close()
        assert all(gpu.is_device(p) for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for p in model.parameters():
        assert torch.equal(p, masters[id(p)])
    for state in guard.optimizer.state.values():
        assert all(v.dtype == torch.float32 for v in state.values() if v.dim() > 0)


def test_the_ladder_reaches_master_weights_where_fp32_weights_do_not_fit() -> None:
    *_, state_peak = trained(STATE)
    *_, master_peak = trained(MASTER)
    budget = (state_peak + master_peak) // 2
    _, guard, results, _ = trained(None, ladder=["amp", "optimizer_offload"], budget=budget)
    assert guard.plan.optimizer_offload == "master" and guard.plan.precision == "bf16"
    assert sum(r.ooms for r in results[1:]) == 0 and results[0].ooms <= 3
    assert guard.summary().fallbacks.get("optimizer_offload", 0) >= 1


def test_the_planner_measures_master_weights_instead_of_offloaded_layers() -> None:
    """One short sequence, clipped: fp32 weights and gradients alone exceed the budget in the clipping phase, so
    the walk goes from the state offloaded to offloaded layers (mixed precision does not relieve them); the
    planner also measures the master level, which fits, moves less and is predicted faster."""

    def planned(capacity: int, plans: list[Plan] | None = None) -> Any:
        with FakeTensorMode():
            model = make_llama(layers=2, hidden=64)
            return dry_run(
                model_step(model), lm_batch(1, 4), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                capacity=capacity, target="simulated", label="llama", plans=plans, max_grad_norm=1.0,
            )  # fmt: skip

    state, master = (c.peak_bytes for c in planned(2**40, [STATE, MASTER]).candidates)
    report = planned((state + master) // 2)
    assert any(c.plan.offload_layers and c.fits for c in report.candidates), "the walk ended on offloaded layers"
    (fitting,) = [c for c in report.candidates if c.plan.optimizer_offload == "master" and c.fits]
    assert report.recommended == fitting.plan
    layers = [c for c in report.candidates if c.plan.offload_layers and c.fits]
    assert all(fitting.transfer_bytes < c.transfer_bytes for c in layers)


def test_the_master_level_is_offered_only_where_it_can_run() -> None:
    rung, context = OptimizerOffload(), RungContext(batch_size=8)
    assert rung.escalate(STATE, context) == MASTER
    assert rung.escalate(Plan(optimizer_offload=True), context) is None, "fp32 plans: no bf16 weights"
    assert rung.escalate(STATE.replace(offload_layers=2), context) is None
    assert rung.escalate(STATE, RungContext(batch_size=8, distributed=True)) is None, "DDP's buckets are fp32"
    deeper = LayerOffload().escalate(MASTER, RungContext(batch_size=8, num_blocks=2))
    assert deeper == STATE.replace(offload_layers=1), "offloaded blocks keep fp32 weights"
    assert rung.relax(MASTER, 8) == STATE and rung.relax(STATE, 8) == AMP
    assert Plan.from_dict(MASTER.to_dict()) == MASTER and "fp32 master weights" in MASTER.describe(8)
    with pytest.raises(ValueError, match="'master'"):
        Plan(optimizer_offload="weights")  # type: ignore[arg-type]


def test_state_dict_and_load_state_dict_see_the_fp32_masters() -> None:
    """A checkpoint saved while the weights are halved is exact, one loaded is written exactly, and a parameter
    written in place on the device some other way becomes its master's value at the next step."""
    model, guard, _, _ = trained(MASTER)
    effect = next(e for e in guard.effects._effects if type(e).__name__ == "OptimizerOffloadEffect")
    saved = model.state_dict()
    assert all(v.dtype == torch.float32 for v in saved.values())
    for name, param in model.named_parameters():
        assert torch.equal(saved[name], effect._masters[param]) and param.dtype == torch.bfloat16
    fresh = make_llama(seed=7, layers=2, hidden=64).state_dict()
    model.load_state_dict(fresh)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        first = next(model.parameters())
        with torch.no_grad():
            first.fill_(0.5)  # (written on the device, bypassing the state_dict)
        guard(BATCHES[0])
        assert (effect._masters[first] - 0.5).abs().max() < 0.01, "the write reached its master"
        guard.close()
    for name, param in list(model.named_parameters())[1:]:
        assert (param - fresh[name]).abs().max() < 0.01, "trained one step from the loaded weights"
    model.load_state_dict(fresh)  # no longer halved: the hooks are gone, an ordinary load
    assert all(torch.equal(p, fresh[n]) for n, p in model.named_parameters())
