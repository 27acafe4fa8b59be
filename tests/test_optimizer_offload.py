"""The optimizer_offload rung: Adam's state in host memory and its step run there, the parameters on the device.
Exact in fp32, undone bit for bit, and the planner knows what it saves and moves."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.batches import lm_batch
from helpers.models import make_llama
from helpers.steps import model_step, train_unguarded

from oomguard import GuardConfigError, OOMGuard, Plan, oom_guard
from oomguard.testing import SimulatedGPU

BATCHES = [lm_batch(2, 16) for _ in range(3)]


def peak_of(plan: Plan) -> int:
    """SimulatedGPU's peak of a second AdamW step on ``plan`` (Adam's state exists)."""
    model = make_llama(layers=2, hidden=64)
    guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[])
    guard.plan = plan
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(BATCHES[0])
        gpu.reset_peak_memory_stats()
        guard(BATCHES[1])
        peak = gpu.max_memory_allocated()
    guard.close()
    return peak


def reference() -> torch.nn.Module:
    return train_unguarded(make_llama(layers=2, hidden=64), BATCHES)


def test_state_that_does_not_fit_trains_with_the_optimizer_on_the_host_after_one_oom() -> None:
    plain, offloaded = peak_of(Plan()), peak_of(Plan(optimizer_offload=True))
    weights = sum(p.numel() * 4 for p in make_llama(layers=2, hidden=64).parameters())
    assert plain - offloaded >= 2 * weights, "Adam's two moments leave the device"
    model = make_llama(layers=2, hidden=64)
    step = oom_guard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                     ladder=["optimizer_offload"])  # fmt: skip
    with SimulatedGPU((plain + offloaded) // 2) as gpu:  # weights, gradients and activations fit; Adam's state not
        gpu.adopt(model)
        results = [step(batch) for batch in BATCHES]
        assert [r.ooms for r in results] == [1, 0, 0]
        assert results[0].rungs == ("optimizer_offload",)
        assert results[2].transfer_bytes == 3 * weights, "parameters and gradients down, parameters up"
        state = step.guard.optimizer.state
        assert all(not gpu.is_device(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
    for p, q in zip(model.parameters(), reference().parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_undo_brings_the_state_back_to_the_device_bit_for_bit() -> None:
    model = make_llama(layers=2, hidden=64)
    twin = copy.deepcopy(model)
    guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[],
                     host_step="exact")  # fmt: skip
    plain = OOMGuard(model_step(twin), model=twin, optimizer=torch.optim.AdamW(twin.parameters()), ladder=[])
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model, twin)
        guard(BATCHES[0])
        plain(BATCHES[0])
        before = copy.deepcopy(guard.optimizer.state_dict())
        guard.plan = Plan(optimizer_offload=True)
        guard(BATCHES[1])
        plain(BATCHES[1])
        guard.close()
        state = guard.optimizer.state
        assert all(gpu.is_device(s[k]) for s in state.values() for k in ("exp_avg", "exp_avg_sq"))
        assert guard.optimizer.state_dict()["state"][0]["step"] == before["state"][0]["step"] + 1
    for ours, theirs in zip(guard.optimizer.state.values(), plain.optimizer.state.values(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[key], theirs[key]), "the host step is the device step's maths, bit for bit"
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_capturable_optimizer_is_not_offloaded() -> None:
    model = make_llama(layers=2, hidden=64)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.param_groups[0]["capturable"] = True
    guard = OOMGuard(model_step(model), model=model, optimizer=optimizer, ladder=["optimizer_offload"])
    guard.plan = Plan(optimizer_offload=True)
    with pytest.raises(GuardConfigError, match="capturable=False"):
        guard(BATCHES[0])


@pytest.mark.usefixtures("python_sigint")
def test_an_interrupt_while_the_stepped_parameters_go_back_waits_until_all_are_back() -> None:
    """Driven from outside (the Trainer's optimizer step): SIGINT lands as the first updated parameter is copied
    back to the device; it surfaces only once every parameter is back, never on a half-copied step."""
    import signal

    model = make_llama(layers=2, hidden=64)
    twin = copy.deepcopy(model)
    optimizer, reference = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(twin.parameters())
    guard = OOMGuard(model_step(model), model=model, optimizer=optimizer, ladder=[], host_step="exact")
    guard.plan = Plan(optimizer_offload=True)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model, twin)
        guard.accumulate(BATCHES[0])
        model_step(twin)(BATCHES[0]).loss.backward()
        reference.step()
        upload, calls = gpu.upload, []

        def interrupted(device: torch.Tensor, host: torch.Tensor) -> None:
            if not calls:  # (to this thread: os.kill may reach another thread, too late; and Python's handler,
                signal.raise_signal(signal.SIGINT)  # whatever a test runner's worker put in place)
            calls.append(1)
            upload(device, host)

        gpu.upload = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            guard.protected_step(optimizer.step, lambda: None)
    assert len(calls) == len(list(model.parameters())), "every parameter went back before the interrupt"
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fp16_with_its_gradient_scaler_steps_the_offloaded_state_as_the_device_would() -> None:
    """The GradScaler unscales the device's gradients and skips the step where they overflowed: the host step must
    see them unscaled, and be skipped alike (the Adam state and weights untouched, the scale backed off)."""
    finals = []
    for offload in (False, True):
        model = make_llama(layers=2, hidden=64)
        guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[],
                         tune_after=None)  # fmt: skip
        guard.plan = Plan(precision="fp16", optimizer_offload=offload)
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            guard(BATCHES[0])
            before = [p.detach().clone() for p in model.parameters()]
            state = guard.effects._scaler_state
            assert state is not None
            guard.effects._scaler_state = {**state, "scale": 2.0**40}  # fp16 gradients overflow: a skipped step
            guard(BATCHES[1])
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "skipped"
            assert guard.effects._scaler_state["scale"] == 2.0**39, "backed off"
            guard.effects._scaler_state = state
            guard(BATCHES[2])
            assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "stepped"
            guard.close()
        steps = {int(s["step"]) for s in guard.optimizer.state.values()}
        assert steps == {2}, "Adam counted the two steps taken, not the skipped one"
        finals.append([p.detach().clone() for p in model.parameters()])
    for on_device, on_host in zip(*finals, strict=True):
        torch.testing.assert_close(on_host, on_device, rtol=1e-6, atol=1e-6)


def test_a_loaded_optimizer_state_goes_to_the_host_and_stays_off_the_device() -> None:
    """torch's load_state_dict casts each state tensor to its parameter's device: a checkpoint loaded with
    ``map_location`` the device left Adam's moments there (running it out of memory) until the next step moved
    them back; loaded on the host, they would have been copied to the device."""
    model = make_llama(layers=2, hidden=64)
    optimizer = torch.optim.AdamW(model.parameters())
    guard = OOMGuard(model_step(model), model=model, optimizer=optimizer, ladder=[])
    guard.plan = Plan(optimizer_offload=True)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(BATCHES[0])
        saved = copy.deepcopy(optimizer.state_dict())
        for entry in saved["state"].values():  # (as torch.load(..., map_location="cuda") gives it)
            entry.update({key: gpu.to_device(value) for key, value in entry.items()})
        gpu.reset_peak_memory_stats()
        before = gpu.memory_allocated()
        optimizer.load_state_dict(saved)
        assert gpu.max_memory_allocated() == before, "the load made nothing on the device"
        state = optimizer.state
        assert all(not gpu.is_device(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
        loaded = [v for s in state.values() for v in s.values()]
        originals = [v for s in saved["state"].values() for v in s.values()]
        assert all(torch.equal(a, b) for a, b in zip(loaded, originals, strict=True)), "bit for bit"
        del originals
        del saved, entry  # (the checkpoint's device copies: freed)
        guard(BATCHES[1])
    guard.close()
    assert all(gpu.is_device(s["exp_avg"]) for s in optimizer.state.values()), "undo brings it to the device"


def test_giving_up_says_the_optimizer_state_could_not_come_back() -> None:
    """Before: "0 offloaded block(s) could not be brought back to the device", whatever stayed on the host."""
    from oomguard import LadderExhausted

    model = make_llama(layers=2, hidden=64)
    guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[])
    guard.plan = Plan(optimizer_offload=True)
    with SimulatedGPU(peak_of(Plan(optimizer_offload=True)) * 11 // 10) as gpu:
        gpu.adopt(model)
        guard(BATCHES[0])  # Adam's state is on the host now, and would not fit back beside the weights
        with pytest.raises(LadderExhausted, match="the optimizer state on the host could not be brought back"):
            guard(lm_batch(16, 16))
