"""The dry runs leave nothing behind. The jump after an OOM, ``preplan=True`` and tuning run the user's step on
fake tensors, on the user's own model object; whatever the step or the model made and kept then was fake, and
later real steps computed on it in silence (issue 23: NaN losses, fake gradients, checkpoints of FakeTensors). Now
what the step and the model keep is put back after each dry run, fakes that escape anyway are named and never
trained on, and a step whose loss is fake or not finite commits nothing."""

from __future__ import annotations

import copy
import gc
import logging
import math
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import MAPPING_LEAVES, as_mapping_leaf, lm_batch, tuple_batch
from helpers.models import make_llama, make_mlp
from helpers.scenarios import SCENARIOS, scenario_batches
from helpers.steps import mse_step
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.optim.optimizer import register_optimizer_step_post_hook

from oomguard import LossError, NonFiniteLoss, OOMGuard, Plan, oom_guard
from oomguard._planner.fakes import preplan
from oomguard._planner.speed import measure_speed
from oomguard.testing import SimulatedGPU

WIDTH, SAMPLES = 256, 256


def fakes_alive() -> set[int]:
    gc.collect()
    return {id(o) for o in gc.get_objects() if type(o) is FakeTensor}


def fakes_reachable(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Every FakeTensor the model (parameters, buffers, state_dict, module attributes and what they hold) or the
    optimizer (state, param_groups) reaches."""
    found, seen = [], set()

    def look(value: Any, where: str, depth: int = 3) -> None:
        if id(value) in seen or depth < 0:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if is_fake(value):
                found.append(where)
        elif isinstance(value, dict):
            for key, item in value.items():
                look(item, f"{where}[{key!r}]", depth - 1)
        elif isinstance(value, (list, tuple, set)):
            for index, item in enumerate(value):
                look(item, f"{where}[{index}]", depth - 1)

    look(model.state_dict(), "state_dict")
    for name, module in model.named_modules():
        look(vars(module), f"module {name!r}")
    look(optimizer.state_dict(), "optimizer.state_dict()")
    look(dict(optimizer.state), "optimizer.state")
    return found


class Caching(torch.nn.Module):
    """A model that makes and keeps tensors in forward: a buffer registered lazily, a constant cached as an
    attribute, and a cache keyed by the input's shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, WIDTH), torch.nn.Linear(WIDTH, 1)
        self.cache: dict[torch.Size, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.ones(WIDTH))
        if x.shape not in self.cache:
            self.cache[x.shape] = torch.linspace(0, 1, WIDTH).expand(x.shape[0], WIDTH).clone()
        if not hasattr(self, "mix"):
            self.mix = torch.tensor(0.5)
        return self.b(torch.tanh(self.a(x)) * self.scale + self.cache[x.shape] * self.mix)


def caching_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 16, generator=generator), torch.randn(SAMPLES, generator=generator)


def test_what_a_model_makes_and_keeps_during_the_jump_is_never_fake_afterwards() -> None:
    """Before: losses [nan, nan, nan] (unguarded: finite), and the model's cache held FakeTensors."""
    model, reference = Caching(), Caching()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer)
    expected = []
    for _ in range(3):  # the unguarded reference: the same batch, whole
        loss = mse_step(reference)(caching_batch())
        loss.backward()
        expected_optimizer.step()
        expected_optimizer.zero_grad()
        expected.append(loss.item())
    alive = fakes_alive()
    with SimulatedGPU("600KiB") as gpu:
        gpu.adopt(model)
        results = [step(caching_batch()) for _ in range(3)]
    assert results[0].ooms == 1 and results[0].plan.micro_batch_size is not None, "settled by a jump"
    assert [r.loss for r in results] == pytest.approx(expected, rel=1e-5)
    assert fakes_reachable(model, optimizer) == [] and fakes_alive() <= alive
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def counting_fake_calls(step: Any) -> Any:
    """``step``, counting its calls on fake tensors in an attribute of its own (which no dry run puts back): the
    proof that a dry run ran."""

    def counted(batch: Any) -> Any:
        leaves = batch.values() if isinstance(batch, dict) else batch
        counted.fake_calls += any(is_fake(leaf) for leaf in leaves)  # type: ignore[attr-defined]
        return step(batch)

    counted.fake_calls = 0  # type: ignore[attr-defined]
    return counted


def model_step(model: torch.nn.Module) -> Any:
    return lambda batch: model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


SCENARIOS_AND_LLAMA = {**SCENARIOS, "llama": lambda: (make_llama(layers=2, hidden=64), model_step, _adamw)}


def _adamw(model: torch.nn.Module) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=1e-3), None


#: The default run keeps one model per way in (the cheapest); every other combination is in the slow suite (the
#: full matrix takes about 5 CPU minutes, half the default run's budget).
_EVERY_RUN = {("nanogpt", "jump and tuning"), ("peft-lora", "preplan")}


@pytest.mark.parametrize(
    ("name", "how"),
    [
        pytest.param(name, how, marks=() if (name, how) in _EVERY_RUN else pytest.mark.slow)
        for name in sorted(SCENARIOS_AND_LLAMA)
        for how in ("jump and tuning", "preplan")
    ],
)
def test_after_the_dry_runs_no_fake_tensor_is_alive_and_the_model_is_freed_when_dropped(name: str, how: str) -> None:
    """On each real model the suite trains: after a jump and tuning (or preplan), no FakeTensor the dry runs made
    is alive anywhere, none is reachable from the model or the optimizer, and the model is freed when dropped
    (before: a finalizer cycle through the planner's device kept the runner, and with it the model, for ever)."""
    model, forward, make = SCENARIOS_AND_LLAMA[name]()
    plain = copy.deepcopy(model)
    optimizer, scheduler = make(plain)
    with SimulatedGPU("4GiB") as gpu:
        gpu.adopt(plain)
        for batch in scenario_batches()[:2]:
            forward(plain)(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        budget = gpu.max_memory_allocated() // 4
    alive = fakes_alive()
    optimizer, scheduler = make(model)
    options = {"preplan": True} if how == "preplan" else {"tune_after": 1}
    step = counting_fake_calls(forward(model))
    guard = OOMGuard(step, model=model, optimizer=optimizer, scheduler=scheduler, **options)
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        results = [guard(batch) for batch in scenario_batches()[:1]]
        planned = step.fake_calls
        results += [guard(batch) for batch in scenario_batches() * 2]
    assert planned > 0, "a dry run before or during the first step"
    if how == "preplan":
        assert not any(r.ooms for r in results), "planned before the first step"
    else:
        assert results[0].ooms >= 1 and step.fake_calls > planned, "jumped, then tuning's dry run"
    assert all(math.isfinite(r.loss) for r in results)
    assert fakes_reachable(model, optimizer) == []
    assert fakes_alive() <= alive, "no fake tensor of the dry runs is alive"
    dropped = weakref.ref(model)
    del guard, model, optimizer, scheduler, forward, step
    gc.collect()
    assert dropped() is None, "the model is freed once the user drops it"


def test_thirty_jumps_keep_memory_flat() -> None:
    """Before: about 700 objects and 0.2 MB more per jump, never freed."""
    model = make_mlp(width=WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, tune_after=None)
    counts = []
    with SimulatedGPU("200KiB") as gpu:
        gpu.adopt(model)
        for jump in range(30):
            guard.plan = Plan()  # forget what fitted: the next call's OOM jumps again
            assert guard(tuple_batch(n=SAMPLES, seed=jump)).ooms == 1
            if jump in (9, 29):
                gc.collect()
                counts.append(len(gc.get_objects()))
    assert counts[1] - counts[0] < 500, f"{counts[1] - counts[0]} objects more after 20 more jumps"


def test_a_fake_that_escapes_where_nothing_puts_it_back_is_named_and_never_trained_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cache in another module's globals is beyond what the planner puts back: the warning names it, the planner
    is off for the step from then on, and a step that computes on the fake raises LossError, nothing stepped."""
    helpers = types.ModuleType("oomguard_test_helpers")
    exec(  # (a module of the user's, with a cache keyed by shape)
        "import torch\nCACHE = {}\ndef offset(x):\n    if x.shape not in CACHE:\n"
        "        CACHE[x.shape] = torch.linspace(0, 1, 256)\n    return CACHE[x.shape]\n",
        helpers.__dict__,
    )
    sys.modules[helpers.__name__] = helpers
    model = make_mlp(width=WIDTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @oom_guard(model=model, optimizer=optimizer)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        hidden = torch.tanh(model[0](x)) + helpers.offset(x)
        return torch.nn.functional.mse_loss(model[2](hidden).squeeze(-1), y)

    try:
        before = [p.detach().clone() for p in model.parameters()]
        with SimulatedGPU("600KiB") as gpu:
            gpu.adopt(model)
            with pytest.raises(LossError, match="FakeTensor"):
                step(tuple_batch(n=SAMPLES))
        assert f"{helpers.__name__}.CACHE[torch.Size([128, 16])]" in caplog.text
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "nothing stepped"
        assert optimizer.state == {}
        caplog.clear()
        with SimulatedGPU("600KiB") as gpu, caplog.at_level(logging.INFO, logger="oomguard"):
            gpu.adopt(model)
            with pytest.raises(LossError):
                step(tuple_batch(n=SAMPLES))
        assert "off for this step" in caplog.text, "not planned again"
    finally:
        del sys.modules[helpers.__name__]


def test_what_the_step_counts_is_not_moved_by_the_dry_runs() -> None:
    """Before: a counter the step advanced moved by hundreds of samples in one jump. A closure, a module
    attribute and a global the step names are put back after each dry run."""
    model = make_mlp(width=WIDTH)
    counted: dict[str, int] = {"samples": 0, "real": 0}
    module_counts: list[int] = []
    model.losses = []  # type: ignore[assignment]
    inner = mse_step(model)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        global COUNTED_BY_A_GLOBAL
        COUNTED_BY_A_GLOBAL += len(batch[0])
        counted["samples"] += len(batch[0])
        counted["real"] += 0 if is_fake(batch[0]) else len(batch[0])
        module_counts.append(len(batch[0]))
        loss = inner(batch)
        model.losses.append(loss.item())  # type: ignore[operator]
        return loss

    counted_step = counting_fake_calls(step)
    guard = OOMGuard(counted_step, model=model, optimizer=torch.optim.AdamW(model.parameters()), tune_after=1)
    with SimulatedGPU("200KiB") as gpu:
        gpu.adopt(model)
        results = [guard(tuple_batch(n=SAMPLES, seed=seed)) for seed in range(8)]
    assert results[0].ooms == 1 and counted_step.fake_calls > 10, "the dry runs ran the step"
    assert counted["samples"] == counted["real"] == COUNTED_BY_A_GLOBAL == sum(module_counts)
    assert all(loss != 1.0 for loss in model.losses), "no placeholder read of the dry runs was kept"  # type: ignore[attr-defined]


COUNTED_BY_A_GLOBAL = 0


def test_global_optimizer_hooks_see_only_real_steps() -> None:
    """Before: 8-9 steps for 3 calls (the dry runs' fake steps)."""
    stepped: list[int] = []
    handle = register_optimizer_step_post_hook(lambda *_: stepped.append(1))
    try:
        model = make_mlp(width=WIDTH)
        guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()))
        with SimulatedGPU("200KiB") as gpu:
            gpu.adopt(model)
            assert guard(tuple_batch(n=SAMPLES)).ooms == 1
            guard(tuple_batch(n=SAMPLES, seed=2))
            guard(tuple_batch(n=SAMPLES, seed=3))
    finally:
        handle.remove()
    assert len(stepped) == guard.steps == 3


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_the_cyclic_collector_is_paused_during_a_dry_run_and_left_as_it_was(
    enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run makes and drops objects by the hundred thousand: Python's cyclic collector, paused inside it, makes
    no full pass over the process's objects there (0.1-0.2 s, landing on some jump by chance); it is as the user had
    it after, and the dry run's garbage is collected with it."""
    from oomguard._planner import fakes

    seen: list[bool] = []
    dry_run = fakes.dry_run
    monkeypatch.setattr(fakes, "dry_run", lambda *a, **k: seen.append(gc.isenabled()) or dry_run(*a, **k))
    model = make_mlp(width=WIDTH)
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()))
    alive = fakes_alive()  # (what other tests in this process left)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with SimulatedGPU("200KiB") as gpu:
            gpu.adopt(model)
            assert guard(tuple_batch(n=SAMPLES)).ooms == 1
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False] and after is enabled, "the jump's dry run ran with the collector paused"
    assert fakes_alive() <= alive


def test_measuring_the_device_allocates_nothing_a_simulated_budget_counts() -> None:
    with SimulatedGPU("1MiB") as gpu:
        before = gpu.allocations, gpu.memory_allocated()
        measure_speed(torch.device("cpu"), gpu)
        assert (gpu.allocations, gpu.memory_allocated()) == before


def test_a_step_that_loops_on_a_tensor_condition_is_not_planned_and_the_guard_walks_the_ladder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: ``while not done.all():`` read False on fake tensors for ever, and the jump never returned."""
    model = make_mlp(width=WIDTH)
    inner = mse_step(model)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        done = torch.zeros(3, dtype=torch.bool)
        while not done.all():  # real values end the loop at once
            done = done | True
        return inner(batch)

    guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters()), tune_after=None)
    with SimulatedGPU("200KiB") as gpu:
        gpu.adopt(model)
        result = guard(tuple_batch(n=SAMPLES))
    assert result.ooms >= 1 and math.isfinite(result.loss)
    assert "read more than" in caplog.text and "walking the ladder instead" in caplog.text


@pytest.mark.parametrize(
    ("ladder", "budget"),
    [(["checkpointing"], 0.7), (["micro_batch", "layer_offload"], 0.3)],
)
def test_tuning_runs_when_the_settled_plan_checkpoints_or_offloads(
    ladder: list[str], budget: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the planner refused the model the guard's own effects held ("another guard has changed this
    model"), so a job that settled on checkpointing or an offload rung was never tuned."""
    model = make_llama(layers=4, hidden=64)
    reference = copy.deepcopy(model)
    batches = scenario_batches() * 2
    optimizer = torch.optim.AdamW(reference.parameters())
    with SimulatedGPU("4GiB") as gpu:
        gpu.adopt(reference)
        for batch in batches:
            model_step(reference)(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        peak = gpu.max_memory_allocated()
    step = counting_fake_calls(model_step(model))
    guard = OOMGuard(step, model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=ladder, tune_after=1)
    results, planned = [], []
    with SimulatedGPU(int(peak * budget)) as gpu:
        gpu.adopt(model)
        for batch in batches:
            results.append(guard(batch))
            planned.append(step.fake_calls)
    guard.close()
    first = next(index for index, result in enumerate(results) if result.ooms)
    assert results[first].rungs[-1] == ladder[-1], "settled on the rung"
    assert planned[-1] > planned[first], "tuning's dry run ran"
    assert "another guard" not in caplog.text
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)  # every plan tried is exact


def test_a_non_finite_loss_commits_nothing() -> None:
    """Before: a NaN loss stepped AdamW on NaN gradients: every weight NaN, silently, for ever after."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    inner = mse_step(model)
    factor = {"value": 1.0}
    guard = OOMGuard(lambda batch: inner(batch) * factor["value"], model=model, optimizer=optimizer,
                     scheduler=scheduler)  # fmt: skip
    guard(tuple_batch())
    before = [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())
    for value in (math.nan, math.inf):
        factor["value"] = value
        with pytest.raises(NonFiniteLoss, match="nothing was stepped"):
            guard(tuple_batch(seed=2))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[0], strict=True))
    assert optimizer.state_dict()["state"][0]["step"] == before[1]["state"][0]["step"]
    assert scheduler.last_epoch == 1 and guard.steps == 1 and all(p.grad is None for p in model.parameters())
    factor["value"] = 1.0
    assert guard(tuple_batch(seed=2)).step == 1, "and it trains on"


def test_a_non_finite_gradient_norm_commits_nothing_when_clipping() -> None:
    model = make_mlp()
    inner = mse_step(model)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        weight = model[0].weight[0, 0]
        return inner(batch) + torch.sqrt(weight - weight.detach())  # adds 0 to the loss, an infinite gradient

    guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteLoss, match="gradient norm"):
        guard(tuple_batch())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.integration
def test_a_trainer_planned_before_its_first_step_logs_the_metrics_of_its_real_steps(tmp_path: Path) -> None:
    """Before: with preplan=True, TRL's SFTTrainer logged what compute_loss recorded on the dry run's fake tensors
    (its first entropy 1.85 for 5.54: a placeholder's, and num_tokens 2 too high on every later line). The same
    job restarted from the plan it saved (no dry run at all) logs the same figures."""
    pytest.importorskip("trl")
    from helpers.trl_example import assert_same_metrics, trl_sft

    plans = str(tmp_path / "plans.json")
    trainer = trl_sft.build(3, str(tmp_path / "planned"), oomguard={"preplan": True, "state_file": plans})
    trl_sft.train(trainer, "16MiB")
    assert trainer.oomguard.summary().ooms == 0, "planned before the first step: no OOM"
    assert trainer.oomguard.plan.micro_batch_size is not None, "on a split plan"
    restarted = trl_sft.build(3, str(tmp_path / "restarted"), oomguard={"state_file": plans})
    trl_sft.train(restarted, "16MiB")
    assert restarted.oomguard.plan == trainer.oomguard.plan and restarted.oomguard.summary().ooms == 0
    assert_same_metrics(trainer, restarted)


def test_a_dry_run_while_master_weights_hold_the_model_plans_the_users_fp32_model_and_leaves_it_halved() -> None:
    """The master level's weights are bf16 on the device and its hooks run forwards under bf16 autocast: for the
    dry run they step aside (each parameter its fp32 master, no hook), so a plan measures what it would on the
    user's own model; afterwards the halves are back and training goes on as if no dry run had happened."""
    from oomguard._planner.fakes import preplan

    batches = scenario_batches()
    models = [make_llama(layers=2, hidden=64) for _ in range(2)]
    fresh = copy.deepcopy(models[0])
    guards = [OOMGuard(model_step(m), model=m, optimizer=torch.optim.AdamW(m.parameters()), ladder=["amp"],
                       tune_after=None) for m in models]  # fmt: skip
    master = Plan(micro_batch_size=4, precision="bf16", optimizer_offload="master")
    plain = Plan(micro_batch_size=4)
    with SimulatedGPU("256MiB") as gpu:
        gpu.adopt(*models)
        for guard in guards:
            guard.plan = master
            guard(batches[0])
        halves = [(p, p.data_ptr(), p.dtype) for p in models[0].parameters()]
        assert {dtype for *_, dtype in halves} == {torch.bfloat16}, "halved"
        report = preplan(model_step(models[0]), batches[1], guards[0].options, gpu, bf16=True, plans=[plain],
                         effects=guards[0].effects)  # fmt: skip
        assert all(p.data_ptr() == data and p.dtype == dtype for p, data, dtype in halves), "left halved"
        losses = [guard(batches[1]).loss for guard in guards]
    assert report is not None and losses[0] == losses[1], "trains on as if nothing had run"
    fresh_guard = OOMGuard(model_step(fresh), model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    with SimulatedGPU("256MiB") as gpu:
        gpu.adopt(fresh)
        fresh_guard(batches[0])  # (Adam's state exists, as on the halved model)
        expected = preplan(model_step(fresh), batches[1], fresh_guard.options, gpu, bf16=True, plans=[plain])
    assert expected is not None
    assert report.candidates[0].peak_bytes == expected.candidates[0].peak_bytes, "the user's fp32 model, planned"


@pytest.mark.parametrize("kind", MAPPING_LEAVES)
def test_a_mapping_batch_torch_pytree_takes_for_a_leaf_is_faked_in_the_dry_run_and_planned_as_a_dict(
    kind: str,
) -> None:
    """Issue 45, finding 13: a tokenizer's ``BatchEncoding`` (or a ``UserDict``) is a leaf to torch's pytree, so the
    dry run handed the step its real tensors, and the planner's measurement left the batch's own bytes out. Its
    tensors are now faked as a dict's are: the step sees only fakes, and the planner measures what it measures for
    the same batch as a dict."""
    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters())

    def step(batch: Any) -> Any:
        step.fake.append(is_fake(batch["input_ids"]))  # type: ignore[attr-defined]  # (no dry run puts it back)
        return model(**batch).loss

    step.fake = []  # type: ignore[attr-defined]
    guard = OOMGuard(step, model=model, optimizer=optimizer, tune_after=None)
    batch = lm_batch(8, 64)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        peaks = {}
        for name, made in (("dict", dict(batch)), (kind, as_mapping_leaf(kind, batch))):
            report = preplan(step, made, guard.options, gpu, bf16=False)
            assert report is not None and report.recommended == Plan(), "the batch fits whole"
            peaks[name] = [candidate.peak_bytes for candidate in report.candidates]
    assert step.fake and all(step.fake), f"the step saw real tensors in {step.fake.count(False)} fake step(s)"  # type: ignore[attr-defined]
    assert peaks[kind] == peaks["dict"], peaks
