"""The master level's stepped weights go up to the device bucket by bucket as the host step goes on (issue 27): each
bucket's as soon as the host has stepped it, while it steps the next, with no synchronize per copy; the same bits as
one upload after the whole step, and a step that raises half-way leaves the device copies as they were."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.steps import mse_step

from oomguard import OOMGuard, Plan
from oomguard.testing import SimulatedGPU

MASTER = Plan(precision="bf16", optimizer_offload="master")
#: A bucket of the host step, in elements (a 32 x 32 weight and a bias or two): one or two parameters a bucket.
SMALL_BUCKET = 1100


def make_model() -> torch.nn.Module:
    """An MLP of six linear layers (twelve parameters) taking 16 features to one output."""
    torch.manual_seed(0)
    inner = [torch.nn.Linear(32, 32) for _ in range(4)]
    return torch.nn.Sequential(torch.nn.Linear(16, 32), *inner, torch.nn.Linear(32, 1))


def make_guard(model: torch.nn.Module, **options: Any) -> OOMGuard:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, ladder=[], tune_after=None, **options)
    guard.plan = MASTER
    return guard


@pytest.fixture
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", SMALL_BUCKET)


def spy_on_kernel(monkeypatch: pytest.MonkeyPatch, events: list[Any], fail_at: int | None = None) -> None:
    """Each call of torch's fused AdamW kernel noted in ``events`` as ("step", the sizes of its parameters); the
    ``fail_at``-th (1-based) raises instead."""
    kernel = torch._fused_adamw_

    def spy(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        events.append(("step", [p.numel() for p in params]))
        if fail_at is not None and sum(kind == "step" for kind, _ in events) == fail_at:
            raise RuntimeError("a bug in the host step")
        return kernel(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)


def spy_on_uploads(gpu: SimulatedGPU, events: list[Any]) -> None:
    """Each copy into a device tensor noted in ``events`` as ("up", its size)."""
    upload = gpu.upload

    def spy(device: torch.Tensor, host: torch.Tensor) -> None:
        events.append(("up", host.numel()))
        upload(device, host)

    gpu.upload = spy  # type: ignore[method-assign]


def count_synchronizes(gpu: SimulatedGPU, waits: list[int]) -> None:
    """Each synchronize of ``gpu`` noted in ``waits``."""
    synchronize = gpu.synchronize

    def counted() -> None:
        waits.append(1)
        synchronize()

    gpu.synchronize = counted  # type: ignore[method-assign]


def weights(model: torch.nn.Module, guard: OOMGuard) -> list[torch.Tensor]:
    """The device copies (bf16) and the fp32 masters on the host, copied."""
    effect = next(e for e in guard.effects._effects if type(e).__name__ == "OptimizerOffloadEffect")
    level = effect._level  # type: ignore[attr-defined]
    return [p.detach().clone() for p in model.parameters()] + [m.clone() for m in level.masters.values()]


@pytest.mark.usefixtures("small_buckets")
def test_each_bucket_goes_up_as_soon_as_the_host_has_stepped_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, every weight went up after the whole host step, the link idle while the host stepped."""
    model = make_model()
    guard = make_guard(model)
    events: list[Any] = []
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(tuple_batch(seed=1))  # (the plan engaged: the masters on the host)
        spy_on_kernel(monkeypatch, events)
        spy_on_uploads(gpu, events)
        guard(tuple_batch(seed=2))
    steps = [sizes for kind, sizes in events if kind == "step"]
    assert len(steps) >= 4, f"the host step ran in buckets: {steps}"
    assert sorted(n for sizes in steps for n in sizes) == sorted(p.numel() for p in model.parameters())
    # Each bucket stepped, then its weights up, before the next bucket steps.
    assert events == [event for sizes in steps for event in [("step", sizes), *(("up", n) for n in sizes)]]


def test_buckets_step_and_upload_the_bits_one_step_over_every_weight_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same elementwise maths however the parameters are grouped: device copies and masters bit for bit."""
    found = []
    for bucket in (SMALL_BUCKET, 1 << 30):
        monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", bucket)
        model = make_model()
        guard = make_guard(model)
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            for seed in range(3):
                guard(tuple_batch(seed=seed))
            found.append(weights(model, guard))
    assert all(torch.equal(a, b) for a, b in zip(*found, strict=True))


def test_the_uploads_wait_for_no_synchronize_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady step synchronizes as often with a bucket a parameter as with one bucket for all: a few times a
    step (the plan's new state moved, the gradients landed, the checksums read, the step journal's copies), never
    once per copy."""
    counts = []
    for bucket in (SMALL_BUCKET, 1 << 30):
        monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", bucket)
        model = make_model()
        guard = make_guard(model)
        waits: list[int] = []
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            guard(tuple_batch(seed=1))
            count_synchronizes(gpu, waits)
            uploads: list[Any] = []
            spy_on_uploads(gpu, uploads)
            guard(tuple_batch(seed=2))
        counts.append(len(waits))
        assert len(uploads) == len(list(model.parameters())), "every weight went up once"
    parameters = len(list(make_model().parameters()))
    assert counts[0] == counts[1] < parameters / 2, f"synchronizes: {counts[0]} in buckets, {counts[1]} in one"


@pytest.mark.usefixtures("small_buckets")
def test_a_host_step_that_raises_after_some_buckets_went_up_leaves_the_device_weights_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device copies of the buckets already sent are put back from the masters the step journal restored;
    called again, the guard steps as one that never failed, bit for bit."""
    reference = make_model()
    plain = make_guard(reference, step_journal="always")
    model = make_model()
    guard = make_guard(model, step_journal="always")
    events: list[Any] = []
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model, reference)
        for seed in (1, 2):
            plain(tuple_batch(seed=seed))
        guard(tuple_batch(seed=1))
        before = weights(model, guard)
        with monkeypatch.context() as patched:
            spy_on_kernel(patched, events, fail_at=3)
            spy_on_uploads(gpu, events)
            with pytest.raises(RuntimeError, match="a bug in the host step"):
                guard(tuple_batch(seed=2))
        failed = [i for i, (kind, _) in enumerate(events) if kind == "step"][2]
        assert ("up", 32 * 32) in events[:failed], "buckets went up before the step raised"
        assert all(torch.equal(a, b) for a, b in zip(weights(model, guard), before, strict=True))
        guard(tuple_batch(seed=2))
    assert all(torch.equal(a, b) for a, b in zip(weights(model, guard), weights(reference, plain), strict=True))
