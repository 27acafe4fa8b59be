"""The optimizer step on the host: what the offload rungs step there runs torch's per-parameter loop where the user
asked for ``foreach`` (the multi-tensor path holds a copy of the model's size at its peak), with the same bits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.batches import ragged_lm_batch
from helpers.models import make_llama

from oomguard import OOMGuard, Plan
from oomguard._effects.hoststep import LOOPED_OPTIMIZERS
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
