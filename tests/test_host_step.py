"""The optimizer step on the host: what the offload rungs step there runs torch's per-parameter loop where the user
asked for ``foreach`` (the multi-tensor path holds a copy of the model's size at its peak), with the same bits."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch
from helpers.batches import ragged_lm_batch, tuple_batch
from helpers.models import make_llama, make_mlp
from helpers.steps import model_step, mse_step

from oomguard import GuardConfigError, OOMGuard, Plan
from oomguard._effects.hoststep import LOOPED_OPTIMIZERS, HostStep
from oomguard.testing import SimulatedGPU

SETTINGS: dict[type[torch.optim.Optimizer], list[dict[str, Any]]] = {
    torch.optim.Adam: [
        {"lr": 1e-2},
        {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True},
        {"lr": 1e-2, "maximize": True},
    ],
    torch.optim.AdamW: [{"lr": 1e-2}, {"lr": 1e-2, "weight_decay": 0.5, "betas": (0.8, 0.95)}],
    torch.optim.Adamax: [{"lr": 1e-2}],
    torch.optim.Adagrad: [{"lr": 0.1}, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1}],
    torch.optim.RMSprop: [{"lr": 1e-2}, {"lr": 1e-2, "momentum": 0.5, "centered": True}],
    torch.optim.SGD: [{"lr": 0.1}, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}],
}


def _stepped(cls: type[torch.optim.Optimizer], foreach: bool, settings: dict[str, Any]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(64, 33), (17,), (5, 5, 5)]]
    optimizer = cls(params, foreach=foreach, **settings)  # type: ignore[call-arg]
    for _ in range(4):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    state = [value for entry in optimizer.state.values() for value in entry.values() if torch.is_tensor(value)]
    return [param.detach().clone() for param in params] + state


@pytest.mark.parametrize("cls", LOOPED_OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_torchs_loop_gives_the_multi_tensor_paths_bits_on_cpu_for_every_optimizer_looped_on_the_host(
    cls: type[torch.optim.Optimizer],
) -> None:
    assert cls in SETTINGS, "an optimizer looped on the host is checked here"
    for settings in SETTINGS[cls]:
        looped, multi = _stepped(cls, False, settings), _stepped(cls, True, settings)
        assert all(torch.equal(a, b) for a, b in zip(looped, multi, strict=True)), f"{cls.__name__}({settings})"


def _host_peak(plan: Plan, foreach: bool) -> tuple[int, list[torch.Tensor], list[bool]]:
    """Three steps of a Llama on ``plan`` with AdamW(foreach=...): the host peak, the weights, each group's foreach."""
    model = make_llama(layers=4, hidden=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    guard = OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer)
    guard.plan = plan
    batch = ragged_lm_batch([8, 8], seq_len=8)
    with SimulatedGPU("4GiB") as gpu:
        gpu.adopt(model)
        for _ in range(3):
            guard(batch)
        peak = gpu.max_host_memory_allocated()
    guard.close()
    return peak, [p.detach().clone() for p in model.parameters()], [g["foreach"] for g in optimizer.param_groups]


@pytest.mark.parametrize(
    "plan",
    [Plan(offload_layers=4), Plan(optimizer_offload=True), Plan(precision="bf16", optimizer_offload="master")],
    ids=["layer_offload", "optimizer_offload", "master"],
)
def test_a_foreach_optimizer_stepping_on_the_host_peaks_there_as_the_loop_does_with_the_same_bits(plan: Plan) -> None:
    looped, looped_weights, _ = _host_peak(plan, foreach=False)
    multi, multi_weights, groups = _host_peak(plan, foreach=True)
    assert multi == looped, f"foreach=True peaked at {multi:,} host bytes, the loop at {looped:,}"
    assert all(torch.equal(a, b) for a, b in zip(looped_weights, multi_weights, strict=True))
    assert groups == [True], "the user's foreach is put back after each step"


# -- the fused host step (host_step="fused", the default) and its exact alternative ----------------------------------

ADAMS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.AdamW, {}),
    (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.AdamW, {"maximize": True, "amsgrad": True}),
]


def _two_groups(model: torch.nn.Module, cls: type[torch.optim.Optimizer], **settings: Any) -> torch.optim.Optimizer:
    """``cls`` over ``model`` (a :func:`make_mlp`) in two groups of their own learning rate and weight decay."""
    first, _, last = model  # type: ignore[misc]
    groups = [{"params": first.parameters(), "lr": 1e-2, "weight_decay": 0.1}, {"params": last.parameters()}]
    return cls(groups, lr=3e-3, weight_decay=0.0, **settings)  # type: ignore[call-arg]


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))


def _fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of torch's fused Adam kernels as each runs (a spy on both)."""
    calls: list[str] = []
    for name in ("_fused_adam_", "_fused_adamw_"):
        kernel = getattr(torch, name)

        def spy(*args: Any, _kernel: Any = kernel, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    return calls


def _plain_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seeds: range, scheduler: Any = None) -> None:
    """Unguarded steps of ``model`` (a :func:`make_mlp`) on a batch of each seed."""
    for seed in seeds:
        mse_step(model)(tuple_batch(seed=seed)).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()


def _guarded_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seeds: range, **options: Any) -> None:
    """Guarded steps on ``Plan(optimizer_offload=True)`` under a SimulatedGPU (the guard closed after)."""
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, ladder=[], tune_after=None, **options)
    guard.plan = Plan(optimizer_offload=True)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for seed in seeds:
            guard(tuple_batch(seed=seed))
        guard.close()


def _train(
    cls: type[torch.optim.Optimizer], settings: dict[str, Any], guarded: dict[str, Any] | None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Four steps of an MLP in two groups under a LambdaLR: guarded with the options ``guarded``, or (None)
    unguarded. The model, its optimizer."""
    model = make_mlp()
    optimizer = _two_groups(model, cls, **settings)
    scheduler = _schedule(optimizer)
    if guarded is None:
        _plain_steps(model, optimizer, range(4), scheduler)
    else:
        _guarded_steps(model, optimizer, range(4), scheduler=scheduler, **guarded)
    return model, optimizer


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.detach(), theirs.detach()
    return float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))


@pytest.mark.filterwarnings("error:Seems like `optimizer.step")  # (the scheduler's: "overridden", or stepped first)
@pytest.mark.parametrize(("cls", "settings"), ADAMS, ids=["AdamW", "Adam-amsgrad", "AdamW-maximize-amsgrad"])
def test_adam_stepped_on_the_host_runs_torchs_fused_kernel_with_the_loops_maths_within_rounding(
    cls: type[torch.optim.Optimizer], settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two groups of their own lr and weight decay, a LambdaLR: the fused host step follows the user's unfused loop
    to float rounding, and leaves the groups as the user built them."""
    reference, _ = _train(cls, settings, guarded=None)
    calls = _fused_calls(monkeypatch)
    model, optimizer = _train(cls, settings, guarded={})
    kernel = "_fused_adamw_" if cls is torch.optim.AdamW else "_fused_adam_"
    assert calls and set(calls) == {kernel}, f"torch's fused CPU kernel ran on the host ({calls})"
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert _relative(ours, theirs) < 1e-6
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == [(None, None)] * 2, "the user's flags"
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2 / 5, 3e-3 / 5], "the scheduler's learning rates"


@pytest.mark.parametrize(("cls", "settings"), ADAMS, ids=["AdamW", "Adam-amsgrad", "AdamW-maximize-amsgrad"])
def test_host_step_exact_steps_adam_on_the_host_bit_for_bit_as_the_users_loop(
    cls: type[torch.optim.Optimizer], settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, expected = _train(cls, settings, guarded=None)
    calls = _fused_calls(monkeypatch)
    model, optimizer = _train(cls, settings, guarded={"host_step": "exact"})
    assert not calls, "no fused kernel"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    for ours, theirs in zip(optimizer.state.values(), expected.state.values(), strict=True):
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "the state, bit for bit"


def test_a_state_the_fused_host_step_made_loads_into_the_users_unfused_optimizer_and_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A state the unfused optimizer made steps on fused under the guard; saved from there and loaded into a fresh
    unguarded AdamW, it steps on as the guarded one does: both end where six unguarded steps do, within rounding."""
    reference = make_mlp()
    _plain_steps(reference, _two_groups(reference, torch.optim.AdamW), range(6))
    model = make_mlp()
    optimizer = _two_groups(model, torch.optim.AdamW)
    _plain_steps(model, optimizer, range(2))  # (the user's own, unfused state)
    calls = _fused_calls(monkeypatch)
    _guarded_steps(model, optimizer, range(2, 4))  # (fused, on that state)
    assert calls == ["_fused_adamw_"] * 4, "two steps of two groups, fused"
    saved = copy.deepcopy(optimizer.state_dict())
    assert {(s["step"].dtype, s["step"].device.type) for s in saved["state"].values()} == {(torch.float32, "cpu")}
    twin = make_mlp()
    twin.load_state_dict(model.state_dict())
    plain = _two_groups(twin, torch.optim.AdamW)
    plain.load_state_dict(saved)  # (the user's unfused optimizer takes the state as it is)
    _guarded_steps(model, optimizer, range(4, 6))
    _plain_steps(twin, plain, range(4, 6))
    for ours, loaded, theirs in zip(model.parameters(), twin.parameters(), reference.parameters(), strict=True):
        assert _relative(ours, theirs) < 1e-6 and _relative(loaded, theirs) < 1e-6
    assert {int(s["step"]) for s in optimizer.state.values()} == {int(s["step"]) for s in plain.state.values()} == {6}


def _adam_calls(monkeypatch: pytest.MonkeyPatch, gpu: SimulatedGPU, fail: bool = False) -> list[Any]:
    """Each call of torch's ``adam`` (one a group, inside the optimizer's step): its fused and foreach flags and
    where its parameters are (device: True). ``fail``: the call raises instead (a bug in the step, say)."""
    calls: list[Any] = []
    module = importlib.import_module("torch.optim.adam")  # (torch.optim's namespace hides its module of that name)
    adam = module.adam

    def spy(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        calls.append((bool(kwargs["fused"]), bool(kwargs["foreach"]), {gpu.is_device(p) for p in params}))
        if fail:
            raise RuntimeError("a bug in the step")
        return adam(params, *args, **kwargs)

    monkeypatch.setattr(module, "adam", spy)
    return calls


def test_a_mixed_group_steps_its_host_part_fused_and_its_device_part_as_the_user_built_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer offload streams the blocks, the embeddings and head stay on the device: one group steps on both. Only
    its host part goes fused; the device part keeps the user's foreach (on CUDA: its kernels). The scheduler and
    the user's step hooks see the one group the user built."""
    model = make_llama(layers=2, hidden=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    guard = OOMGuard(model_step(model), model=model, optimizer=optimizer, scheduler=_schedule(optimizer), ladder=[],
                     tune_after=None)  # fmt: skip
    guard.plan = Plan(offload_layers=2)
    hooked: list[int] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: hooked.append(len(opt.param_groups)))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: hooked.append(len(opt.param_groups)))
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        calls = _adam_calls(monkeypatch, gpu)
        for _ in range(2):
            guard(ragged_lm_batch([8, 8], seq_len=8))
        guard.close()
    assert calls == [(False, True, {True}), (True, False, {False})] * 2, "split: device part foreach, host fused"
    assert hooked == [1] * 4, "the user's hooks see their own group"
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["foreach"] is True
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters())), "every parameter back"
    assert optimizer.param_groups[0]["lr"] == 1e-3 / 3, "the scheduler stepped the user's group"


def test_a_host_step_that_raises_leaves_the_groups_as_the_user_built_them(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_llama(layers=2, hidden=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    groups, params = optimizer.param_groups, list(optimizer.param_groups[0]["params"])
    guard = OOMGuard(model_step(model), model=model, optimizer=optimizer, ladder=[], tune_after=None)
    guard.plan = Plan(offload_layers=1)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        calls = _adam_calls(monkeypatch, gpu, fail=True)
        with pytest.raises(RuntimeError, match="a bug in the step"):
            guard(ragged_lm_batch([8, 8], seq_len=8))
        guard.close()
    assert calls[0] == (False, True, {True}), "the step that raised was split: its device part first"
    assert optimizer.param_groups is groups and len(groups) == 1
    assert groups[0]["params"] == params and (groups[0]["fused"], groups[0]["foreach"]) == (None, True)
    assert "step" not in vars(optimizer), "the optimizer's own step method back"


def test_host_step_fp16_with_its_gradient_scaler_runs_fused_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GradScaler asks ``_step_supports_amp_scaling`` (False: the user built AdamW unfused) and unscales the
    gradients itself; the fused kernel then steps them as the loop would."""
    finals = []
    host_steps: tuple[HostStep, ...] = ("exact", "fused")
    for host_step in host_steps:
        calls = _fused_calls(monkeypatch)
        model = make_llama(layers=2, hidden=32)
        guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), ladder=[],
                         tune_after=None, host_step=host_step)  # fmt: skip
        guard.plan = Plan(precision="fp16", optimizer_offload=True)
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            for seed in (2, 3):
                guard(ragged_lm_batch([8, 8], seq_len=8, seed=seed))
            guard.close()
        assert bool(calls) == (host_step == "fused"), host_step
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(_relative(a, b) < 1e-6 for a, b in zip(*finals, strict=True))


def test_a_host_step_that_is_neither_fused_nor_exact_is_refused_naming_both() -> None:
    model = make_mlp()
    with pytest.raises(GuardConfigError, match=r"host_step must be 'fused'.*or 'exact'.*got 'fast'"):
        OOMGuard(mse_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()), host_step="fast")
