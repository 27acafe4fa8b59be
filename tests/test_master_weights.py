"""optimizer_offload's second level: bf16 weights on the device, fp32 master weights and the optimizer on the host.
Half the device memory for weights and gradients, 4 bytes per parameter moved a step, amp's maths, undone bit
for bit."""

from __future__ import annotations

import copy
import io
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.batches import lm_batch, tuple_batch
from helpers.models import make_llama, make_mlp
from helpers.steps import model_step, mse_step, train_on
from helpers.sweep import TINY, clone_state, sweep
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import LayerOffload, OOMGuard, OptimizerOffload, Plan, RungContext
from oomguard._backends.memory import CpuMemory
from oomguard._effects.descent import Descent
from oomguard._effects.fingerprint import ROW, Fingerprints
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
    # bf16 gradients down, bf16 parameters up, and the weights' checksums twice (after the upload and before the
    # next step: 8 bytes a tensor of under 65,521 elements) to find writes that bypass the version counters.
    checksums = 2 * 8 * len(list(make_llama(layers=2, hidden=64).parameters()))
    assert master_results[-1].transfer_bytes == weights + checksums


def test_each_gradient_leaves_the_device_as_backward_makes_it() -> None:
    """Issue 27: an 8 x 512^2 MLP's steady step on the master level peaked at 2.00x its bf16 weights, every bf16
    gradient resident until the end of backward; now a bounded slice of them is (about 2.5 layers' worth here)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(8)])
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    guard.plan = MASTER
    batch = (torch.randn(2, 512), torch.randn(2, 512))
    halves = sum(p.numel() * 2 for p in model.parameters())
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(batch)
        gpu.reset_peak_memory_stats()
        guard(batch)
        peak = gpu.max_memory_allocated()
    assert peak <= 1.4 * halves, f"the steady step peaked at {peak / halves:.2f}x the bf16 weights"


def test_a_gradient_sent_down_twice_in_one_backward_is_summed_whole() -> None:
    """A parameter whose gradient backward accumulates twice (used in two reentrant checkpoints) is sent twice: the
    second copy may not overwrite the first before it is summed."""
    weight = SimpleNamespace(master=torch.zeros(3), grad=None, staging=None, summed=False)
    descent, backend = Descent(), CpuMemory()
    descent.send(weight, torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), backend)
    descent.send(weight, torch.tensor([10.0, 20.0, 30.0], dtype=torch.bfloat16), backend)
    descent.land(backend)
    assert weight.summed and torch.equal(weight.grad, torch.tensor([11.0, 22.0, 33.0]))
    descent.send(weight, torch.tensor([1.0, 1.0, 1.0], dtype=torch.bfloat16), backend)
    descent.drop()  # (a failed attempt: nothing sent is summed)
    descent.land(backend)
    assert torch.equal(weight.grad, torch.tensor([11.0, 22.0, 33.0]))


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


def _planned(capacity: int, plans: list[Plan] | None = None) -> Any:
    """The dry run of one short sequence of a clipped Llama (its weights, not its activations, set the peak)."""
    with FakeTensorMode():
        model = make_llama(layers=2, hidden=64)
        return dry_run(
            model_step(model), lm_batch(1, 4), model=model, optimizer=torch.optim.AdamW(model.parameters()),
            capacity=capacity, target="simulated", label="llama", plans=plans, max_grad_norm=1.0,
        )  # fmt: skip


def test_the_planner_measures_master_weights_instead_of_offloaded_layers() -> None:
    """One short sequence, clipped: fp32 weights and gradients alone exceed the budget in the clipping phase, so
    the walk goes from the state offloaded to offloaded layers (mixed precision does not relieve them); the
    planner also measures the master level, which fits, moves less and is predicted faster."""
    planned = _planned
    state, master = (c.peak_bytes for c in planned(2**40, [STATE, MASTER]).candidates)
    report = planned((state + master) // 2)
    assert any(c.plan.offload_layers and c.fits for c in report.candidates), "the walk ended on offloaded layers"
    (fitting,) = [c for c in report.candidates if c.plan.optimizer_offload == "master" and c.fits]
    assert report.recommended == fitting.plan
    layers = [c for c in report.candidates if c.plan.offload_layers and c.fits]
    assert all(fitting.transfer_bytes < c.transfer_bytes for c in layers)


def test_the_planner_measures_master_weights_where_the_walk_ends_on_offloaded_state() -> None:
    """A budget the state's level just fits in fp32 (amp does not relieve the clipping phase): the walk stops there,
    yet the master level, a third of its traffic a step, is measured too and recommended."""
    fp32_state = Plan(optimizer_offload=True)
    state = next(c for c in _planned(2**40, [fp32_state]).candidates)
    report = _planned(state.peak_bytes + 1024)
    fits = {c.plan: c for c in report.candidates if c.fits}
    assert fp32_state in fits and not any(plan.offload_layers for plan in fits), "the walk ended on the state's level"
    assert report.recommended == MASTER and fits[MASTER].transfer_bytes < fits[fp32_state].transfer_bytes


def test_the_master_level_is_offered_only_where_it_can_run() -> None:
    rung, context = OptimizerOffload(), RungContext(batch_size=8)
    assert rung.escalate(STATE, context) == MASTER
    assert rung.escalate(Plan(optimizer_offload=True), context) is None, "fp32 plans: no bf16 weights"
    assert rung.escalate(STATE.replace(offload_layers=2), context) is None
    # (under DDP too: the guard's ranks all-reduce the fp32 sums themselves, never through DDP's fp32 buckets)
    assert rung.escalate(STATE, RungContext(batch_size=8, distributed=True)) == MASTER
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


# -- the device weight is the truth between steps: writes that bypass the version counter ----------------------


def master_guard(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Any = None, scheduler: Any = None
) -> OOMGuard:
    """A guard on ``model`` running the master level alone (no ladder, no tuning)."""
    forward = step if step is not None else (lambda batch: model(**batch))
    guard = OOMGuard(forward, model=model, optimizer=optimizer, scheduler=scheduler, ladder=[], tune_after=None)
    guard.plan = MASTER
    return guard


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(
        torch.int16) if b.dtype == torch.bfloat16 else b)  # fmt: skip


def test_weight_clipping_through_p_data_in_the_loop_stays_clipped() -> None:
    """WGAN-style clipping after each step: ``p.data.clamp_()`` writes through an alias with its own version
    counter. The clamped weights are the masters at once (``state_dict()``) and train on from there."""
    clip, lr = 0.01, 1e-3
    model = make_llama(layers=2, hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.5, total_iters=4)
    guard = master_guard(model, optimizer, scheduler=schedule)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for batch in BATCHES:
            guard(batch)
            for param in model.parameters():
                param.data.clamp_(-clip, clip)
            # The masters hold what the device holds: the clamped values, to within the rounding of bf16 (where a
            # weight's bf16 value did not change, its master keeps its fp32 bits).
            bound = torch.tensor(clip, dtype=torch.bfloat16).item()
            assert max(v.bfloat16().abs().max().item() for v in model.state_dict().values()) <= bound
        guard(BATCHES[0])
    largest = max(p.abs().max().item() for p in model.parameters())
    assert largest <= clip + 4 * lr, f"one AdamW step from clipped weights moves them about lr, not to {largest}"
    assert schedule.last_epoch == len(BATCHES) + 1, "(a schedule stepped with every step)"


def test_an_ema_swap_through_p_data_is_what_the_masters_give_and_swapping_back_keeps_every_fp32_bit() -> None:
    model, guard, _, _ = trained(MASTER)
    masters = {name: value.clone() for name, value in model.state_dict().items()}
    ema = {name: value * 0.5 for name, value in masters.items()}  # (an fp32 EMA of the weights, kept aside)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        kept = [param.data.clone() for param in model.parameters()]
        for name, param in model.named_parameters():
            param.data.copy_(ema[name])  # evaluate on the EMA weights...
        swapped = model.state_dict()
        for name, value in swapped.items():
            assert same_bits(value.bfloat16(), ema[name].bfloat16()), "the masters are what the device holds"
        for param, value in zip(model.parameters(), kept, strict=True):
            param.data.copy_(value)  # ... and swap the training weights back
        for name, value in model.state_dict().items():
            assert torch.equal(value, masters[name]), "nothing written: every master as it was, to the last bit"
        guard(BATCHES[0])


def test_a_write_to_one_element_changes_only_that_element_of_its_master() -> None:
    model, guard, _, _ = trained(MASTER)  # (the guard kept: dropped, it would undo the level)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    name, param = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    assert guard.plan == MASTER and param.dtype == torch.bfloat16
    param.data[3, 5] = 0.5
    after = model.state_dict()
    expected = before[name].clone()
    expected[3, 5] = 0.5
    assert torch.equal(after[name], expected), "the written element, exactly; the others keep their fp32 bits"
    assert all(torch.equal(after[n], before[n]) for n in before if n != name)


def test_vector_to_parameters_replaces_the_weights_and_they_train_on_as_bf16_copies() -> None:
    model = make_llama(layers=2, hidden=64)
    guard = master_guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(BATCHES[0])
        vector = torch.nn.utils.parameters_to_vector(model.parameters())
        assert vector.dtype == torch.bfloat16, "(between steps the weights on the device are bf16)"
        torch.nn.utils.vector_to_parameters(torch.full(vector.shape, 0.02), model.parameters())  # p.data = ...
        assert all(torch.equal(v, torch.full_like(v, 0.02)) for v in model.state_dict().values())
        guard(BATCHES[1])
        assert all(p.dtype == torch.bfloat16 and gpu.is_device(p) for p in model.parameters())
    assert all((v - 0.02).abs().max() < 4e-3 for v in model.state_dict().values()), "one step from 0.02"


# -- fp32 accumulation of micro-batches ---------------------------------------------------------------------------


def sgd_step(plan: Plan, batch: Any) -> dict[str, torch.Tensor]:
    """The fp32 weights (the masters, where there are) after one guarded SGD step of the MLP over ``batch``."""
    model = make_mlp(width=64)
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     ladder=[], tune_after=None)  # fmt: skip
    guard.plan = plan
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(batch)
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_micro_batches_accumulate_in_fp32_within_twice_amps_distance() -> None:
    """One SGD step over 256 samples in micro-batches of 1: summed in bf16, 256 gradients landed 6.8 times amp's
    distance from fp32 (2.1 % against 0.30 %); summed in fp32 on the host, within twice amp's."""
    batch = tuple_batch(256)
    start = make_mlp(width=64).state_dict()
    fp32 = sgd_step(Plan(), batch)
    amp = sgd_step(AMP.replace(micro_batch_size=1), batch)
    master = sgd_step(MASTER.replace(micro_batch_size=1), batch)

    def far(a: dict[str, torch.Tensor]) -> float:
        gap = sum((a[k] - fp32[k]).square().sum() for k in fp32)
        return float((gap / sum((fp32[k] - start[k]).square().sum() for k in fp32)).sqrt())

    assert far(master) <= 2 * far(amp), (far(master), far(amp))


def test_an_oom_part_way_through_the_micro_batches_leaves_no_gradient_summed_on_the_host() -> None:
    """Faults at the start of every micro-batch's forward and backward but the first: the gradients already
    summed on the host are dropped with the attempt, and the step that succeeds equals a fault-free one."""
    plan = MASTER.replace(micro_batch_size=2)

    def starts(step: int, phases: list[str]) -> list[int]:  # (each micro-batch's first allocation of each phase)
        return [i for i in range(2, len(phases) + 1) if phases[i - 1] != phases[i - 2]][1:]

    result = sweep(plan, starts, workload=TINY, steps=1)
    assert not result.failures, "\n".join(result.failures[:10])
    assert result.injected >= 4 and result.survived == result.injected


# -- outside the step, the user's model -------------------------------------------------------------------------


def test_the_optimizer_loads_its_state_in_fp32_on_the_host_and_trains_on_as_before() -> None:
    """torch casts a loaded state to its parameter's dtype and device: bf16 on the device for a halved weight."""
    runs = []
    for reload in (False, True):
        model = make_llama(layers=2, hidden=64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = master_guard(model, optimizer)
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            guard(BATCHES[0])
            if reload:
                saved = clone_state(optimizer.state_dict())
                optimizer.load_state_dict(saved)
                for state in optimizer.state.values():
                    for key, value in state.items():
                        assert value.dtype == torch.float32 and not gpu.is_device(value), (key, value.dtype)
                loaded = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
                originals = [v for s in saved["state"].values() for k, v in s.items() if k != "step"]
                assert all(torch.equal(a, b) for a, b in zip(loaded, originals, strict=True)), "bit for bit"
                del saved, originals  # (cloned on the device: what the optimizer holds now is its own, on the host)
            guard(BATCHES[1])
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0]), "the reload changed nothing"


def test_an_eval_forward_outside_the_step_runs_as_the_steps_own_bf16_forward() -> None:
    model = make_mlp(width=64)
    guard = master_guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mse_step(model))
    inputs, _ = tuple_batch(8)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(tuple_batch(8))
        model.eval()
        with torch.no_grad():
            output = model(inputs)  # fp32 inputs, bf16 weights
            with torch.autocast("cpu", dtype=torch.bfloat16):
                expected = model(inputs)
            assert torch.equal(output, expected), "bf16 autocast, as the guard's own forward runs"
            assert model[0](inputs).shape == (8, 64), "a layer called on its own, too"
            assert not torch.is_autocast_enabled("cpu"), "and autocast is off again after the forward"
            with pytest.raises(RuntimeError):
                model(torch.randn(8, 3))  # (a wrong shape: the forward raises)
            assert not torch.is_autocast_enabled("cpu"), "even after a forward that raised"
        model.train()
        guard(tuple_batch(8))


def linear_root() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 1)  # (a model that owns its parameters itself: the copy meets them first)


@pytest.mark.parametrize("make", [lambda: make_llama(layers=2, hidden=64), linear_root], ids=["llama", "linear"])
def test_a_copy_of_the_model_is_the_users_model_with_the_fp32_masters_as_its_weights(make: Any) -> None:
    model = make()
    llama = not isinstance(model, torch.nn.Linear)
    batch = BATCHES[0] if llama else tuple_batch(8)

    def step_of(net: torch.nn.Module) -> Any:
        return (lambda b: net(**b)) if llama else mse_step(net)

    guard = master_guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), step_of(model))
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(batch)
        next(model.parameters()).data.mul_(0.5)  # (a write on the device since the step: the copies take it)
        masters = model.state_dict()
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copies = [copy.deepcopy(model), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)]
        for twin in copies:
            assert all(p.dtype == torch.float32 for p in twin.parameters())
            assert all(torch.equal(twin.state_dict()[n], masters[n]) for n in masters), "the masters, bit for bit"
            assert all(torch.equal(p, masters[n]) for n, p in twin.named_parameters())
            out = twin(**batch).loss if llama else twin(batch[0])
            assert out.dtype == torch.float32, "an fp32 model: no autocast"
        guard(batch)  # the original trains on, and the copies do not move with it
    for twin in copies:
        assert all(torch.equal(twin.state_dict()[n], masters[n]) for n in masters)
        other = OOMGuard(step_of(twin), model=twin, optimizer=torch.optim.SGD(twin.parameters(), lr=0.1), ladder=[])
        other(batch)  # a copy is a model of its own: another guard may take it


def test_the_checksums_see_one_changed_element_anywhere_and_a_swap_and_agree_on_the_host() -> None:
    """The check behind the master level's write detection: row sums of the bit patterns, position-weighted."""
    with SimulatedGPU("1GiB") as gpu:
        torch.manual_seed(0)
        big = torch.randn(64 * ROW + 7).bfloat16()  # (more than one block of rows, and a short last row)
        small = torch.randn(5, 3).bfloat16()
        prints = Fingerprints()
        prints.prepare([big, small])
        gpu.reset_peak_memory_stats()
        allocated = gpu.memory_allocated()
        prints.record([big, small], gpu)
        assert gpu.max_memory_allocated() == allocated, "a prepared record allocates nothing on the device"
        on_host = Fingerprints()
        on_host.record_host([gpu.to_host(big), gpu.to_host(small)])
        assert torch.equal(on_host._known, prints._known), "the same sums, whoever adds them up"
        assert prints.changed([big, small], gpu) == [False, False]
        bits = big.view(torch.int16)
        for index in (0, ROW - 1, ROW, 63 * ROW + 5, 64 * ROW + 6):
            bits[index] += 1  # (one bit pattern, one step up)
            assert prints.changed([big, small], gpu) == [True, False], index
            bits[index] -= 1
            assert prints.changed([big, small], gpu) == [False, False], index
        for first, second in ((10, 20), (ROW - 2, ROW + 3)):  # within a row, across rows
            assert big[first] != big[second]
            big[first], big[second] = big[second].clone(), big[first].clone()
            assert prints.changed([big, small], gpu) == [True, False], (first, second)
        assert prints.changed([None, small], gpu) == [True, False], "a tensor not checked counts as changed"


def test_applying_the_level_holds_one_bf16_copy_beside_the_fp32_weights_not_all_of_them() -> None:
    """Halving made every bf16 copy before any parameter let its fp32 weight go: 6 bytes a parameter at once, so a
    plan the planner found fits ran out of memory as it was applied (a 14-block stack at 35 % of its plain peak: the
    jump's master-weights plan failed in apply, then 19 more OOMs down the ladder). Now a parameter at a time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(8)])
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    weights = sum(p.numel() * 4 for p in model.parameters())
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        gpu.reset_peak_memory_stats()
        guard.effects.apply(MASTER, gpu)
        peak = gpu.max_memory_allocated()
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    one_copy = 256 * 256 * 2
    assert peak <= weights + one_copy, f"{peak / weights:.2f}x the fp32 weights while halving"
    guard.close()
    assert all(p.dtype == torch.float32 for p in model.parameters())
