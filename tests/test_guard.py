"""The guard's core contract on small models: exact accumulation, recovery, one optimizer step per call."""

from __future__ import annotations

import gc
import json
import logging
import traceback
import weakref
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.events import first_event
from helpers.models import clone_model, make_mlp, same_weights
from helpers.optimizers import RecordingSGD
from helpers.steps import LADDER_WITHOUT_OPTIMIZER_OFFLOAD, mse_step

from oomguard import (
    GuardConfigError,
    LadderExhausted,
    LossError,
    OOMGuard,
    Plan,
    RecoveryLimitExceeded,
    StepResult,
    StepRollbackError,
    oom_guard,
)
from oomguard.testing import SimulatedGPU


def grads_of(model: torch.nn.Module, batch: Any, plan: Plan, **options: Any) -> list[torch.Tensor]:
    """The gradients one guarded step on ``plan`` hands to the optimizer."""
    optimizer = RecordingSGD(model.parameters())
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, **options)
    guard.plan = plan
    guard(batch)
    grads = optimizer.seen[0]
    assert all(g is not None for g in grads)
    return [g for g in grads if g is not None]


def test_happy_path_equals_the_hand_written_step() -> None:
    guarded, manual = make_mlp(), make_mlp()
    opt_g = torch.optim.AdamW(guarded.parameters(), lr=1e-2)
    opt_m = torch.optim.AdamW(manual.parameters(), lr=1e-2)
    step = oom_guard(mse_step(guarded), model=guarded, optimizer=opt_g)
    for seed in range(3):
        batch = tuple_batch(seed=seed)
        result = step(batch)
        loss = mse_step(manual)(batch)
        loss.backward()
        opt_m.step()
        opt_m.zero_grad(set_to_none=True)
        assert result.loss == pytest.approx(loss.item(), rel=0, abs=0)
        assert same_weights(guarded, manual)
    assert isinstance(result, StepResult)
    assert (result.micro_batch_size, result.rungs, result.ooms, result.step) == (8, (), 0, 2)
    assert all(p.grad is None for p in guarded.parameters()), "the guard owns zero_grad"


@pytest.mark.parametrize("micro", [1, 2, 3, 5])
def test_tuple_batch_accumulation_is_exact(micro: int) -> None:
    batch = tuple_batch(n=8)
    whole = grads_of(make_mlp(), batch, Plan())
    split = grads_of(make_mlp(), batch, Plan(micro_batch_size=micro))
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_sum_reduction_adds_micro_batch_losses() -> None:
    def summed(model: torch.nn.Module):  # type: ignore[no-untyped-def]
        return lambda batch: ((model(batch[0]).squeeze(-1) - batch[1]) ** 2).sum()

    batch = tuple_batch(n=6)
    results = []
    for plan in (Plan(), Plan(micro_batch_size=4)):
        model = make_mlp()
        optimizer = RecordingSGD(model.parameters())
        guard = OOMGuard(summed(model), model=model, optimizer=optimizer, reduction="sum")
        guard.plan = plan
        results.append((guard(batch).loss, optimizer.seen[0]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_oom_splits_the_same_batch_and_keeps_the_effective_batch() -> None:
    model = make_mlp(width=256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen_sizes: list[int] = []

    @oom_guard(model=model, optimizer=optimizer)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen_sizes.append(batch[0].shape[0])
        return mse_step(model)(batch)

    batch = tuple_batch(n=64)
    with SimulatedGPU("128KiB") as gpu:
        gpu.adopt(model)
        result = step(batch)
    assert result.ooms >= 1
    assert result.rungs == ("micro_batch",)
    assert result.micro_batch_size < 64
    assert result.micro_batches * result.micro_batch_size >= 64
    # The successful attempt saw every sample exactly once.
    tail = seen_sizes[-result.micro_batches :]
    assert sum(tail) == 64
    assert step.guard.plan.micro_batch_size == result.micro_batch_size


def test_memory_returns_to_baseline_and_failed_frames_are_dropped() -> None:
    model = make_mlp(width=256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_retry: list[bool] = []

    @oom_guard(model=model, optimizer=optimizer)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        alive_at_retry.extend(ref() is not None for ref in refs)
        hidden = model[1](model[0](batch[0]))  # an activation the failed attempt's frames would keep alive
        refs.append(weakref.ref(hidden))
        return torch.nn.functional.mse_loss(model[2](hidden).squeeze(-1), batch[1])

    with SimulatedGPU("128KiB") as gpu:
        gpu.adopt(model)
        batch = tuple_batch(n=64)
        baseline = gpu.memory_allocated()  # weights and the batch
        result = step(batch)
        after = gpu.memory_allocated()
    assert result.ooms >= 1
    ooms = [e for e in step.guard.events if e.kind == "oom"]
    assert all(e.memory_after_recovery.allocated == baseline for e in ooms)  # type: ignore[attr-defined]
    assert all(e.error.memory.allocated > baseline for e in ooms)  # type: ignore[attr-defined]
    assert not any(alive_at_retry), "a failed attempt's activations were still alive when the retry began"
    assert after == baseline, "SGD without momentum keeps no state: memory must be back to the weights"
    assert gpu.empty_cache_calls >= result.ooms


def test_oom_in_first_adam_step_leaves_no_half_built_state() -> None:
    model, reference = make_mlp(), make_mlp()
    # Two parameter groups: torch builds Adam's state group by group, stepping the first before the second.
    groups = [
        {"params": [model[0].weight, model[2].weight]},
        {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    ref_groups = [
        {"params": [reference[0].weight, reference[2].weight]},
        {"params": [reference[0].bias, reference[2].bias], "weight_decay": 0.0},
    ]
    ref_optimizer = torch.optim.AdamW(ref_groups, lr=1e-2)
    calls: list[int] = []
    entry: list[int] = []
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer)

    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)

        def arm_fault_inside_state_creation(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            calls.append(1)
            entry.append(gpu.allocations)
            if len(calls) == 1:
                gpu.fail_allocation(5)  # after the first group's state and update, inside the second group

        optimizer.register_step_pre_hook(arm_fault_inside_state_creation)
        result = step(tuple_batch())
    assert result.ooms == 1
    assert first_event(step.guard.events, "oom").error.phase == "optimizer"
    assert len(calls) == 2, "the optimizer step ran once, failed, and ran once more"
    assert [int(optimizer.state[p]["step"]) for p in model.parameters()] == [1, 1, 1, 1]
    ref_optimizer.zero_grad()
    mse_step(reference)(tuple_batch()).backward()
    ref_optimizer.step()
    # The retry ran on two micro-batches (rounding differs in the last bits), yet the step happened once.
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            optimizer.state[p]["exp_avg_sq"], ref_optimizer.state[q]["exp_avg_sq"], rtol=1e-4, atol=1e-9
        )


def test_oom_in_a_later_adam_step_is_undone_before_the_retry() -> None:
    model, reference = make_mlp(), make_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=True)
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, ladder=LADDER_WITHOUT_OPTIMIZER_OFFLOAD)
    entry: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: entry.append(gpu.allocations))
    batches = [tuple_batch(seed=s) for s in range(4)]
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        step(batches[0])
        start = gpu.allocations
        step(batches[1])
        before_step = entry[-1] - start  # allocations of forward, backward (and item counting) on this batch
        journaled = step.guard.transaction.journaled_steps
        # foreach Adam: steps += 1, moments updated in place, then sqrt allocates: fail that allocation.
        gpu.fail_allocation(before_step + 2)
        result = step(batches[2])
        step(batches[3])
    assert result.ooms == 1
    assert first_event(step.guard.events, "oom").error.phase == "optimizer"
    assert step.guard.transaction.journaled_steps == journaled + 1, "the faulty step ran journaled"
    for batch in batches:
        ref_optimizer.zero_grad()
        mse_step(reference)(batch).backward()
        ref_optimizer.step()
    assert [int(optimizer.state[p]["step"]) for p in model.parameters()] == [4] * 4
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_an_unjournaled_step_that_fails_after_changing_tensors_says_so() -> None:
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, step_journal="never")
    entry: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: entry.append(gpu.allocations))
    batches = [tuple_batch(seed=s) for s in range(3)]
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        step(batches[0])
        start = gpu.allocations
        step(batches[1])
        gpu.fail_allocation(entry[-1] - start + 2)  # the same allocation as in the journaled test above
        with pytest.raises(StepRollbackError, match="cannot be undone") as info:
            step(batches[2])
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_steady_state_steps_skip_the_journal() -> None:
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        for seed in range(5):
            step(tuple_batch(seed=seed))
    assert step.guard.transaction.journaled_steps == 1, "only the first step (which builds Adam's state) is journaled"


class Boom(ValueError):
    pass


def test_non_oom_errors_propagate_unchanged_without_retry(tmp_path: Any) -> None:
    model = make_mlp()
    before = clone_model(model)
    raised = Boom("not a memory problem")
    calls: list[int] = []

    @oom_guard(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), log_file=tmp_path / "log.jsonl")
    def step(batch: Any) -> torch.Tensor:
        calls.append(1)
        model(batch[0]).sum().backward()  # leave gradients behind: the guard must drop them
        raise raised

    with pytest.raises(Boom) as info:
        step(tuple_batch())
    assert info.value is raised
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "step" in frames, "the original traceback (down to the raising frame) is intact"
    assert calls == [1]
    assert step.guard.events == []
    assert not (tmp_path / "log.jsonl").exists()
    assert same_weights(model, before)
    assert all(p.grad is None for p in model.parameters())


def test_fatal_device_error_is_not_retried() -> None:
    model = make_mlp()
    calls: list[int] = []

    @oom_guard(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    def step(batch: Any) -> torch.Tensor:
        calls.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        step(tuple_batch())
    assert calls == [1]


def test_ladder_exhausted_says_what_was_tried_and_leaves_the_model_unchanged() -> None:
    model = make_mlp(width=256)
    optimizer = torch.optim.AdamW(model.parameters())
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, ladder=["micro_batch"])
    before = clone_model(model)
    with SimulatedGPU("40KiB") as gpu:
        gpu.adopt(model)
        batch = tuple_batch(n=4)
        baseline = gpu.memory_allocated()
        with pytest.raises(LadderExhausted) as info:
            step(batch)
        after = gpu.memory_allocated()
    error = info.value
    message = str(error)
    assert "every plan on the ladder ran out of memory" in message
    assert "Tried:" in message and "whole batch" in message and "micro-batches of 1" in message
    assert "capacity 40.0 KiB" in message and "tried to allocate" in message
    assert "What you can do" in message
    assert [plan.micro_batch_size for plan, _ in error.tried] == [None, 2, 1]
    assert error.memory.allocated == baseline == after
    assert same_weights(model, before)
    assert not optimizer.state, "no Adam state was left half-built"
    assert step.guard.events[-1].kind == "exhausted"


def test_attempt_bound_raises_recovery_limit_exceeded() -> None:
    model = make_mlp(width=256)
    step = oom_guard(  # (walking blindly: the dry-run planner finds a plan that fits at once, bf16 master weights)
        mse_step(model),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        max_attempts=2,
        predictive=False,
    )
    with SimulatedGPU("40KiB") as gpu:
        gpu.adopt(model)
        with pytest.raises(RecoveryLimitExceeded, match="bound of 2 attempts") as info:
            step(tuple_batch(n=16))
    assert len(info.value.tried) == 2


def test_a_real_cpu_allocator_oom_is_recovered() -> None:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    @oom_guard(model=model, optimizer=optimizer)
    def step(batch: Any) -> torch.Tensor:
        if batch[0].shape[0] > 2:
            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the real DefaultCPUAllocator refuses
        return mse_step(model)(batch)

    result = step(tuple_batch(n=8))
    assert (result.micro_batch_size, result.ooms) == (2, 2)
    oom = first_event(step.guard.events, "oom")
    assert "DefaultCPUAllocator" in oom.error.message  # type: ignore[attr-defined]
    assert oom.error.requested_bytes == 2**50  # type: ignore[attr-defined]


def test_events_are_json_lines_and_one_log_line_each(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    model = make_mlp(width=256)
    log = tmp_path / "events.jsonl"
    received: list[Any] = []
    step = oom_guard(
        mse_step(model),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        log_file=log,
        sinks=[received.append],
    )
    with caplog.at_level(logging.INFO, logger="oomguard"), SimulatedGPU("128KiB") as gpu:
        gpu.adopt(model)
        result = step(tuple_batch(n=64))
        step(tuple_batch(n=64))  # the learned plan fits: no OOM event, only its progress (one of the first 10)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    *lines, second = lines
    assert (second["event"], second["step"], second["steps_by_rung"]) == ("progress", 1, {"micro_batch": 2})
    kinds = [line["event"] for line in lines]
    assert kinds == ["oom", "fallback"] * result.ooms + ["recovered", "progress"]
    for line in lines:
        assert {"event", "step", "plan", "memory", "time"} <= line.keys()
        assert line["step"] == 0
        assert line["memory"]["capacity"] == 128 * 1024
    assert lines[1]["rung"] == "micro_batch"
    assert lines[0]["error"]["phase"] in ("forward", "backward")
    assert lines[-2]["rungs"] == ["micro_batch"]
    assert lines[-1]["steps_by_rung"] == {"micro_batch": 1}
    # One line each on the oomguard logger (progress lines at DEBUG, below this capture's level).
    assert [r.getMessage() for r in caplog.records] == [e.describe() for e in step.guard.events if e.kind != "progress"]
    assert received == step.guard.events
    summary = step.guard.summary()
    assert (summary.steps, summary.ooms, summary.fallbacks) == (2, result.ooms, {"micro_batch": result.ooms})
    assert "micro_batch" in str(summary)


def test_scheduler_steps_once_per_call_despite_ooms() -> None:
    model = make_mlp(width=256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step_calls: list[int] = []
    optimizer.register_step_post_hook(lambda *_: step_calls.append(1))
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, scheduler=scheduler)
    with SimulatedGPU("128KiB") as gpu:
        gpu.adopt(model)
        results = [step(tuple_batch(n=64, seed=s)) for s in range(3)]
    assert results[0].ooms >= 1
    assert len(step_calls) == 3
    assert scheduler.last_epoch == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_gradient_clipping_uses_the_whole_batch_norm() -> None:
    batch = tuple_batch(n=8)
    norms = []
    for plan in (Plan(), Plan(micro_batch_size=3)):
        model = make_mlp()
        guard = OOMGuard(
            mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.01
        )
        guard.plan = plan
        norms.append(guard(batch).grad_norm)
    assert norms[0] is not None and norms[1] is not None
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda loss: loss.detach(), "does not require grad"),
        (lambda loss: loss.expand(3), "single number"),
        (lambda loss: {"logits": loss}, "no loss"),
        (lambda loss: {"loss": None}, "loss is None"),
        (lambda loss: "0.5", "with no loss"),
    ],
)
def test_unusable_losses_get_clear_errors(returned: Any, message: str) -> None:
    model = make_mlp()
    step = oom_guard(
        lambda b: returned(mse_step(model)(b)), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    )
    with pytest.raises(LossError, match=message):
        step(tuple_batch())


def test_configuration_errors_name_the_problem() -> None:
    model, other = make_mlp(), make_mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"optimizer": torch.optim.SGD(other.parameters(), lr=0.1)}, "not the model's"),
        ({"ladder": ["micro_batch", "warp_drive"]}, "unknown rung 'warp_drive'"),
        ({"ladder": "micro_batch"}, "not a string"),
        ({"reduction": "avg"}, "reduction must be"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"step_journal": "sometimes"}, "step_journal"),
        ({"scheduler": torch.optim.lr_scheduler.StepLR(torch.optim.SGD(other.parameters()), 1)}, "different optimizer"),
    ]
    for options, message in cases:
        settings: dict[str, Any] = {"model": model, "optimizer": sgd, **options}
        with pytest.raises(GuardConfigError, match=message):
            OOMGuard(mse_step(model), **settings)
    with pytest.raises(GuardConfigError, match="no parameters"):
        OOMGuard(lambda b: b, model=torch.nn.ReLU(), optimizer=sgd)


def test_decorator_keeps_the_function_identity() -> None:
    model = make_mlp()

    @oom_guard(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    def train_step(batch: Any) -> torch.Tensor:
        """Docstring kept."""
        return mse_step(model)(batch)

    assert train_step.__name__ == "train_step"
    assert train_step.__doc__ == "Docstring kept."
    assert isinstance(train_step.guard, OOMGuard)
    assert "whole batch" in repr(train_step)
    gc.collect()


def spurious_job(spurious: bool, budget: str = "1GiB") -> tuple[torch.nn.Module, OOMGuard, SimulatedGPU]:
    model = make_mlp(width=64)
    guard = OOMGuard(
        mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), tune_after=None
    )
    return model, guard, SimulatedGPU(budget, spurious_ooms=spurious)


def test_a_one_off_oom_on_a_plan_that_ran_clean_is_tried_again_on_that_plan_where_the_allocator_can_fail_so() -> None:
    """An allocator that can fail while the memory it needs is pending (CUDA's caching allocator: pytorch#189504)
    raises an OOM on the plan that ran three clean steps: the same plan once more fits, no rung moves, the step is
    the one an unguarded loop takes; a ``retry`` event says so and the summary counts it. Where the allocator
    cannot (the default simulator), the same fault moves down the ladder as before."""
    model, guard, gpu = spurious_job(True)
    reference = clone_model(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    with gpu:
        gpu.adopt(model, reference)
        for seed in range(4):
            batch = tuple_batch(seed=seed)
            if seed == 3:
                gpu.fail_allocation(2)
            result = guard(batch)
            mse_step(reference)(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert result.ooms == 1 and result.plan == Plan(), result.plan
    assert [e.kind for e in guard.events if e.kind in ("oom", "retry", "fallback", "recovered")] == [
        "oom",
        "retry",
        "recovered",
    ]
    assert guard.summary().retries == 1 and "same plan once more" in str(guard.summary())
    assert same_weights(model, reference)

    model, guard, gpu = spurious_job(False)
    with gpu:
        gpu.adopt(model)
        for seed in range(4):
            batch = tuple_batch(seed=seed)
            if seed == 3:
                gpu.fail_allocation(2)
            result = guard(batch)
    assert result.ooms == 1 and result.plan != Plan() and not any(e.kind == "retry" for e in guard.events)


def test_the_same_plan_is_tried_once_a_call_and_not_after_three_tries_ran_out_again() -> None:
    """A real OOM on a plan that ran clean (the device has less memory from now on): one try on it, then the
    ladder; after three such tries ran out of memory again, none. Five times: a clean step on the plain plan, then
    a device short of memory."""
    model, guard, gpu = spurious_job(True)
    tried = []
    with gpu:
        gpu.adopt(model)
        for seed in range(5):
            batch = tuple_batch(seed=seed)
            guard.plan = Plan()  # (every bucket on the plain plan again)
            gpu.capacity = 1 << 30
            assert guard(batch).plan == Plan()
            gpu.capacity = gpu.memory_allocated() + 2048  # (the plain step cannot fit: its activations alone)
            result = guard(batch)
            tried.append((sum(e.kind == "retry" for e in guard.events), result.plan == Plan()))
    assert tried == [(1, False), (2, False), (3, False), (3, False), (3, False)], tried
