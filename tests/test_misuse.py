"""Nothing silently wrong off the OOM path: interrupts, a step that runs backward itself, a second guard or a second
thread, leaves outside the model, errors that are not memory, the scheduler failing after a fast step, a first
call that fails before its state file is read. Each was found by trying the guard adversarially (issue 14)."""

from __future__ import annotations

import copy
import gc
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.models import make_mlp
from helpers.steps import mse_step
from torch.utils._python_dispatch import TorchDispatchMode

from oomguard import GuardConfigError, LadderExhausted, LossError, OOMGuard, Plan, RecoveryLimitExceeded, oom_guard
from oomguard.testing import SimulatedGPU


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every weight and optimizer-state tensor, copied."""
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [v.detach().clone() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return tensors


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class SignalAtCopy(TorchDispatchMode):  # type: ignore[misc]
    """Sends this process SIGINT at the ``n``-th tensor copy from when it is armed (inside the journal's undo)."""

    def __init__(self) -> None:
        super().__init__()
        self.countdown: int | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.countdown is not None and func is torch.ops.aten.copy_.default:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                signal.raise_signal(signal.SIGINT)
        return func(*args, **(kwargs or {}))


# -- interrupts never split a step ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("python_sigint")
def test_ctrl_c_during_the_journals_undo_waits_until_the_model_is_whole_again() -> None:
    """Before: the KeyboardInterrupt landed half-way through the undo, some tensors restored and some stepped."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, step_journal="always")
    guard(tuple_batch(seed=0))  # Adam's state exists: the undo has moments to put back too
    before = state(model, optimizer)
    mode = SignalAtCopy()

    def fail_after_stepping(*_: Any) -> None:  # the update happened; the step fails; the undo comes next
        mode.countdown = 2
        raise RuntimeError("a step post-hook failed")

    handle = optimizer.register_step_post_hook(fail_after_stepping)
    with mode, pytest.raises(KeyboardInterrupt):
        guard(tuple_batch(seed=1))
    handle.remove()
    assert same(state(model, optimizer), before), "every tensor back as it was before the call"
    assert guard.steps == 1
    assert guard(tuple_batch(seed=1)).step == 1, "the guard trains on"


class Preempted(BaseException):
    """What a job's own preemption handler raises (a signal the guard does not hold: SIGUSR1 here)."""


class InterruptAtCopy(TorchDispatchMode):  # type: ignore[misc]
    """At the ``n``-th tensor copy from when it is armed: a KeyboardInterrupt raised by code (as an exception set
    asynchronously from another thread lands), or SIGUSR1, whose handler raises :class:`Preempted`."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.countdown = how, None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.countdown is not None and func is torch.ops.aten.copy_.default:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                if self.how == "raised by code":
                    raise KeyboardInterrupt
                signal.raise_signal(signal.SIGUSR1)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("how", ["raised by code", "another signal's handler"])
def test_any_interrupt_during_the_journals_undo_waits_until_the_model_is_whole_again(how: str) -> None:
    """Issue 23's round-1 case: only SIGINT and SIGTERM were held, so an interrupt of another kind still landed
    half-way through the undo (weights as before [True, False, ...], Adam's step counters 1 and 2)."""
    previous = signal.signal(signal.SIGUSR1, lambda *_: (_ for _ in ()).throw(Preempted()))
    try:
        model = make_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, step_journal="always")
        guard(tuple_batch(seed=0))
        before, mode = state(model, optimizer), InterruptAtCopy(how)

        def fail_after_stepping(*_: Any) -> None:
            mode.countdown = 2  # the second copy of the undo
            raise RuntimeError("a step post-hook failed")

        handle = optimizer.register_step_post_hook(fail_after_stepping)
        with mode, pytest.raises(KeyboardInterrupt if how == "raised by code" else Preempted):
            guard(tuple_batch(seed=1))
        handle.remove()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert same(state(model, optimizer), before), "every tensor back as it was before the call"
    assert {int(s["step"]) for s in optimizer.state.values()} == {1}
    assert guard(tuple_batch(seed=1)).step == 1, "the guard trains on"


@pytest.mark.usefixtures("python_sigint")
def test_ctrl_c_during_a_fast_step_lands_after_the_step_is_committed_and_counted() -> None:
    """Before: it landed inside ``optimizer.step()`` and came out as StepRollbackError, the model half-stepped."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        guard(tuple_batch(seed=0))
        guard(tuple_batch(seed=1))  # measured: the next step may run without a journal
        journaled = guard.transaction.journaled_steps
        handle = optimizer.register_step_pre_hook(lambda *_: signal.raise_signal(signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            guard(tuple_batch(seed=2))
        handle.remove()
        assert guard.transaction.journaled_steps == journaled, "it was a fast step"
        assert guard.steps == 3, "the step was committed and counted before the interrupt surfaced"
        assert {int(s["step"]) for s in optimizer.state.values()} == {3}, "Adam stepped once, whole"
        assert guard(tuple_batch(seed=3)).step == 3


# -- the step function is forward-only -------------------------------------------------------------------------


@pytest.mark.parametrize("retain_graph", [True, False])
def test_a_step_that_runs_backward_itself_is_refused_before_anything_is_stepped(retain_graph: bool) -> None:
    """Before: with ``retain_graph=True`` the guard backpropagated again and stepped on doubled gradients."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = state(model, optimizer)

    @oom_guard(model=model, optimizer=optimizer)
    def step(batch: Any) -> torch.Tensor:
        loss = mse_step(model)(batch)
        loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
        return loss

    with pytest.raises(LossError, match="ran backward itself") as info:
        step(tuple_batch())
    assert "return the loss without calling loss.backward()" in str(info.value)
    assert same(state(model, optimizer), weights), "nothing was stepped"
    assert all(p.grad is None for p in model.parameters())


# -- one guard per model, one thread per guard --------------------------------------------------------------------


def blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])


def block_step(model: torch.nn.Module) -> Any:
    return lambda batch: model(batch).pow(2).mean()


def test_giving_up_puts_offloaded_layers_back_and_a_new_guard_trains_them() -> None:
    """Before: after LadderExhausted ("the model ... is unchanged") the offloaded blocks kept the first guard's
    hooks, and a new guard's gradients for them went to the first guard's host buffers: those blocks never
    trained again."""
    model = blocks()
    guard = OOMGuard(block_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     ladder=[])  # fmt: skip
    guard.plan = Plan(offload_layers=2)  # nothing to fall back to from here: an OOM gives up
    batch = torch.randn(8, 32)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        guard(batch)
        assert guard.effects.offloaded_layers == 2
        gpu.fail_allocation(1)
        with pytest.raises(LadderExhausted) as info:
            guard(batch)
        assert "the model, optimizer and scheduler are unchanged" in str(info.value)
        assert guard.effects.offloaded_layers == 0
        assert all(gpu.is_device(p) for p in model.parameters()), "every block is back on the device"
        del info, guard
        gc.collect()
        fresh = OOMGuard(block_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        before = [p.detach().clone() for p in model.parameters()]
        fresh(batch)
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "every block trained"


def test_a_dropped_guard_undoes_what_its_plan_did_to_the_model() -> None:
    model = blocks()
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        guard = OOMGuard(block_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        guard.plan = Plan(offload_layers=4, checkpointing="full")
        guard(torch.randn(8, 32))
        assert not any(gpu.is_device(p) for p in model.parameters())
        del guard
        gc.collect()
        assert all(gpu.is_device(p) for p in model.parameters()), "the blocks came back when the guard went"
    assert all("forward" not in vars(block) for block in model), "checkpointing is off again"
    assert sum(len(block._forward_pre_hooks) for block in model) == 0


def test_a_second_guard_on_a_model_another_guard_has_changed_is_refused() -> None:
    model = blocks()
    first = OOMGuard(block_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    first.plan = Plan(offload_layers=1)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        first(torch.randn(8, 32))
        with pytest.raises(GuardConfigError, match="another guard has changed this Sequential") as info:
            OOMGuard(block_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert "Call close() on the other guard first" in str(info.value)
        first.close()
        second = OOMGuard(block_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert second(torch.randn(8, 32)).ooms == 0, "once closed, the model is free"


def test_a_call_from_a_second_thread_while_one_runs_is_refused() -> None:
    """Before: the two calls interleaved their zero_grad, backward and optimizer steps."""
    model = make_mlp()
    inside, release = threading.Event(), threading.Event()

    def slow_step(batch: Any) -> torch.Tensor:
        inside.set()
        release.wait(timeout=10)
        return mse_step(model)(batch)

    guard = OOMGuard(slow_step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    worker = threading.Thread(target=guard, args=(tuple_batch(seed=0),))
    worker.start()
    try:
        assert inside.wait(timeout=10)
        with pytest.raises(GuardConfigError, match="already running a step in another thread"):
            guard(tuple_batch(seed=1))
    finally:
        release.set()
        worker.join(timeout=10)
    assert guard.steps == 1, "the first call alone stepped"


# -- leaves outside the model ---------------------------------------------------------------------------------


def test_a_leaf_outside_the_model_keeps_no_gradient_of_a_failed_attempt() -> None:
    """A learnable loss weight outside the model and its optimizer: before, the gradient that micro-batch 1 gave
    it in the failed attempt stayed, and the retry added the whole batch's again."""
    model = make_mlp()
    weight = torch.ones((), requires_grad=True)
    calls = [0]
    batch = tuple_batch(n=8)

    def reference() -> torch.Tensor:
        twin = copy.deepcopy(model)
        w = torch.ones((), requires_grad=True)
        (mse_step(twin)(batch) * w).backward()  # type: ignore[no-untyped-call]
        assert w.grad is not None
        return w.grad

    expected = reference()

    def step(part: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:  # the first attempt's second micro-batch, after the first one's backward
            gpu.fail_allocation(1)
        return mse_step(model)(part) * weight

    guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    guard.plan = Plan(micro_batch_size=4)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        result = guard(batch)
    assert result.ooms == 1
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad, expected, rtol=1e-5, atol=1e-7)


# -- errors that are not memory, and the errors that give up -------------------------------------------------------


def test_an_out_of_memory_text_raised_by_the_step_itself_stops_at_the_second_identical_failure() -> None:
    """Before: retried down the whole ladder (a call of the step per rung and halving), ending in LadderExhausted
    with neither the original message nor its traceback."""
    model = make_mlp()
    calls = [0]

    def step(batch: Any) -> torch.Tensor:
        calls[0] += 1
        raise RuntimeError("out of memory in my own cache")

    guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="out of memory in my own cache") as info:
        guard(tuple_batch())
    assert not isinstance(info.value, LadderExhausted)
    assert calls[0] == 2, "one retry, then the same error again: not memory"
    assert info.value.__traceback__ is not None, "raised as itself, traceback and all"


def test_an_error_raised_in_the_steps_own_oom_fallback_propagates_at_once() -> None:
    model = make_mlp()
    calls = [0]

    def step(batch: Any) -> torch.Tensor:
        calls[0] += 1
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError:
            raise ValueError("no fallback")  # noqa: B904 - raised while handling the OOM: its __context__

    guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="no fallback"):
        guard(tuple_batch())
    assert calls[0] == 1, "not retried"


def test_giving_up_keeps_the_last_error_as_its_cause() -> None:
    model = make_mlp(width=256)
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     ladder=["micro_batch"])  # fmt: skip
    with SimulatedGPU("40KiB") as gpu:
        gpu.adopt(model)
        with pytest.raises(LadderExhausted) as info:
            guard(tuple_batch(n=4))
    cause = info.value.__cause__
    assert isinstance(cause, torch.OutOfMemoryError)
    assert "CUDA out of memory" in str(cause)
    assert cause.__traceback__ is None, "its frames were released, to free the failed attempt's memory"
    notes = "\n".join(getattr(cause, "__notes__", []))
    assert "Traceback" in notes or not hasattr(cause, "add_note"), "where it began is kept as text"


def test_no_fallback_event_for_a_plan_the_attempt_bound_never_lets_run() -> None:
    model = make_mlp(width=256)
    # (walking blindly: the dry-run planner finds a plan that fits at once, bf16 master weights)
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     max_attempts=2, predictive=False)  # fmt: skip
    with SimulatedGPU("40KiB") as gpu:
        gpu.adopt(model)
        with pytest.raises(RecoveryLimitExceeded):
            guard(tuple_batch(n=16))
    kinds = [e.kind for e in guard.events]
    assert kinds == ["oom", "fallback", "oom", "exhausted"], kinds
    assert sum(guard.summary().fallbacks.values()) == 1


# -- the scheduler after a fast step, and a first call that fails early -------------------------------------------


class FlakyScheduler(torch.optim.lr_scheduler.LambdaLR):
    """Runs out of memory once, on its ``fail_at``-th step (counted outside its state, which a retry restores)."""

    def __init__(self, optimizer: torch.optim.Optimizer, fail_at: int) -> None:
        self.fail_at, self.calls = fail_at, [0]
        super().__init__(optimizer, lambda step: 1.0 / (1 + step))

    def step(self, epoch: Any = None) -> None:
        self.calls[0] += 1
        if self.calls[0] == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 B")
        super().step()


def test_an_oom_in_the_scheduler_after_a_fast_step_still_commits_one_whole_step() -> None:
    """Before: StepRollbackError, with the optimizer stepped and the scheduler not."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = FlakyScheduler(optimizer, fail_at=4)  # its constructor's step is call 1; steps 1 and 2 are 2 and 3
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, scheduler=scheduler)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        guard(tuple_batch(seed=0))
        guard(tuple_batch(seed=1))
        journaled = guard.transaction.journaled_steps
        result = guard(tuple_batch(seed=2))
    assert guard.transaction.journaled_steps == journaled, "it was a fast step"
    assert (result.step, guard.steps) == (2, 3)
    assert scheduler.last_epoch == 3, "the scheduler stepped once per call"
    assert {int(s["step"]) for s in optimizer.state.values()} == {3}


def test_a_first_call_that_fails_before_reading_the_state_file_reads_it_on_the_next_call(tmp_path: Path) -> None:
    """Before: the first call marked the guard started, failed opening its log, and every later call ran without
    the plans remembered in the state file."""
    plans = tmp_path / "plans.json"
    model = make_mlp(width=256)
    first = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                     state_file=plans)  # fmt: skip
    with SimulatedGPU("160KiB") as gpu:
        gpu.adopt(model)
        remembered = first(tuple_batch(n=64)).plan
    assert remembered != Plan(), "the first job needed micro-batches, and remembered them"
    del first
    blocker = tmp_path / "logs"
    blocker.write_text("a file where the log's folder should be")
    again = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                     state_file=plans, log_file=blocker / "deeper" / "events.jsonl")  # fmt: skip
    with SimulatedGPU("160KiB") as gpu:
        gpu.adopt(model)
        with pytest.raises((NotADirectoryError, FileExistsError)):  # its folder cannot be made under a file
            again(tuple_batch(n=64))
        assert again.steps == 0
        blocker.unlink()
        result = again(tuple_batch(n=64))
    assert (result.plan, result.ooms) == (remembered, 0), "started on the remembered plan"
    assert (blocker / "deeper" / "events.jsonl").exists()


# -- found in review --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("python_sigint")
def test_a_signal_whose_handler_only_notes_it_never_undoes_a_finished_step() -> None:
    """A job's SIGTERM handler that sets a flag (the usual preemption pattern) and returns: the step held the
    signal, finished, and must stay committed and counted; the handler runs once the call is done."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, step_journal="always")
    stop: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: stop.append(number))
    try:
        handle = optimizer.register_step_post_hook(lambda *_: signal.raise_signal(signal.SIGTERM))
        before = state(model, optimizer)
        result = guard(tuple_batch(seed=0))
        handle.remove()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (result.step, guard.steps, stop) == (0, 1, [signal.SIGTERM])
    assert not same(state(model, optimizer), before), "the step stayed committed"


@pytest.mark.usefixtures("python_sigint")
def test_two_signals_held_in_one_step_are_both_delivered_sigterm_first() -> None:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, step_journal="always")
    terms: list[int] = []

    def both(*_: Any) -> None:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda number, frame: terms.append(number))
    try:
        optimizer.register_step_post_hook(both)
        with pytest.raises(KeyboardInterrupt):
            guard(tuple_batch())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert terms == [signal.SIGTERM], "the job's SIGTERM handler (a checkpoint, say) ran before Ctrl-C ended it"


@pytest.mark.usefixtures("python_sigint")
def test_ctrl_c_during_a_dry_run_step_is_not_swallowed() -> None:
    from helpers.models import make_llama
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomguard._planner.engine import dry_run

    with FakeTensorMode():
        model = make_llama(layers=1, hidden=16)
        optimizer = torch.optim.AdamW(model.parameters())
        steps = [0]

        def second_step(*_: Any) -> None:  # past the warm-up's journaled step: a fast one
            steps[0] += 1
            if steps[0] == 2:
                signal.raise_signal(signal.SIGINT)

        optimizer.register_step_post_hook(second_step)
        ids = torch.zeros(2, 8, dtype=torch.long)
        with pytest.raises(KeyboardInterrupt):
            dry_run(lambda b: model(**b), {"input_ids": ids, "labels": ids}, model=model, optimizer=optimizer,
                    capacity=2**40, target="simulated", label="llama")  # fmt: skip


def test_a_dropped_guard_is_freed_at_once_and_frees_its_model_for_the_next_guard(tmp_path: Path) -> None:
    """Found in review: the state-file callback made a reference cycle, so a dropped guard (and its undo) waited
    for a full garbage collection; meanwhile a new guard on the same model was refused."""
    model = blocks()
    gc.disable()
    try:
        guard = OOMGuard(block_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         state_file=tmp_path / "plans.json")  # fmt: skip
        guard.plan = Plan(checkpointing="full")
        guard(torch.randn(8, 32))
        dropped = weakref.ref(guard)
        del guard
        assert dropped() is None, "freed by its reference count"
        assert all("forward" not in vars(block) for block in model), "and its checkpointing undone"
        again = OOMGuard(block_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert again(torch.randn(8, 32)).ooms == 0
    finally:
        gc.enable()


def test_a_fresh_input_that_requires_grad_keeps_no_gradient_of_a_failed_attempt() -> None:
    """An adversarial input made anew for each batch: found only through the batch, not by the first graph."""
    model = make_mlp()
    x, y = tuple_batch(n=8)
    calls = [0]

    def step(part: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 4:  # the second batch's first attempt, its second micro-batch
            gpu.fail_allocation(1)
        return torch.nn.functional.mse_loss(model(part[0]).squeeze(-1), part[1])

    guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    guard.plan = Plan(micro_batch_size=4)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        guard((x.clone().requires_grad_(), y))  # the first batch: its own leaf
        delta = x.clone().requires_grad_()
        assert guard((delta, y)).ooms == 1
    twin = copy.deepcopy(model)
    reference = x.clone().requires_grad_()
    torch.nn.functional.mse_loss(twin(reference).squeeze(-1), y).backward()  # type: ignore[no-untyped-call]
    assert delta.grad is not None and reference.grad is not None
    torch.testing.assert_close(delta.grad, reference.grad, rtol=1e-5, atol=1e-7)


def test_the_error_kept_as_a_cause_holds_no_frame_even_behind_from_none() -> None:
    from oomguard._guard.recovery import released

    def fail() -> None:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA out of memory while compiling") from None

    try:
        fail()
    except RuntimeError as error:
        kept = released(error)
    assert kept.__traceback__ is None
    assert kept.__context__ is not None and kept.__context__.__traceback__ is None, "the hidden context's too"


def test_a_state_file_that_is_a_dangling_link_fails_its_save_instead_of_spinning(tmp_path: Path) -> None:
    from oomguard._guard.persist import PlanStore

    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "plans.json"
    link.symlink_to(tmp_path / "elsewhere" / "plans.json")
    started = time.monotonic()
    with pytest.raises(OSError, match="could neither be opened nor created"):
        PlanStore(link, "f" * 16, "dev").save({1: Plan()})
    assert time.monotonic() - started < 5


def test_a_step_that_pops_its_labels_from_the_batch_still_has_them_when_retried() -> None:
    """A common pattern (``target = batch.pop("y")``): the first attempt on the whole batch popped the key from the
    user's own dict, so the retry in micro-batches after its OOM found no labels (a KeyError, found in issue 25
    for the Trainer's compute_loss). Each attempt on the whole batch gets its own shallow copy."""
    model, reference = make_mlp(), make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = tuple_batch(n=16)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        target = batch.pop("y")
        return torch.nn.functional.mse_loss(model(batch.pop("x")).squeeze(-1), target)

    guard = OOMGuard(step, model=model, optimizer=optimizer, ladder=["micro_batch"], predictive=False)
    with SimulatedGPU(_peak_of_whole_batch(x, y) - 1) as gpu:
        gpu.adopt(model)
        batch = {"x": x, "y": y}
        result = guard(batch)
    assert result.ooms >= 1 and result.micro_batches > 1, "the whole batch ran out and was retried split"
    assert set(batch) == {"x", "y"}, "the user's dict is as it was"
    torch.nn.functional.mse_loss(reference(x).squeeze(-1), y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _peak_of_whole_batch(x: torch.Tensor, y: torch.Tensor) -> int:
    """The simulated peak of one plain SGD step of a fresh MLP on the whole batch."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        torch.nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
        optimizer.step()
        return gpu.max_memory_allocated()


def test_a_parameter_group_added_after_the_guard_was_made_is_clipped_with_the_others() -> None:
    """Progressive unfreezing: a frozen layer unfrozen and added with ``add_param_group`` after the guard was made.
    Its gradients count in the clipped norm, as in an unguarded loop. Before: the guard clipped the parameters it had
    read at its construction (a norm of 151.9 reported where it was 203.9)."""

    def run(guarded: bool) -> tuple[list[float], list[torch.Tensor]]:
        model = make_mlp(width=64)
        model[0].requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, max_grad_norm=0.1, ladder=[])
        norms = []
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            for seed in range(4):
                if seed == 2:
                    model[0].requires_grad_(True)
                    optimizer.add_param_group({"params": list(model[0].parameters())})
                batch = tuple_batch(seed=seed)
                if guarded:
                    norms.append(guard(batch).grad_norm)
                    continue
                mse_step(model)(batch).backward()
                params = [p for group in optimizer.param_groups for p in group["params"]]
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.1)))
                optimizer.step()
                optimizer.zero_grad()
        return norms, state(model, optimizer)

    guarded, plain = run(True), run(False)
    assert guarded[0] == plain[0]
    assert same(guarded[1], plain[1])
