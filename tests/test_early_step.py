"""The master level's host step begun during the last backward (issue 27): each bucket steps as soon as backward has
finished its gradients, on a host thread, while backward goes on. The same bits as the step after backward; undone
whole when the attempt fails after it; not begun where anything looks at every gradient before the step."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.steps import mse_step
from torch.utils.checkpoint import checkpoint

from oomguard import OOMGuard, Plan
from oomguard._effects.early import EarlyStep
from oomguard._step.runner import StepRunner
from oomguard.testing import SimulatedGPU

MASTER = Plan(precision="bf16", optimizer_offload="master")
#: About one 32 x 32 weight and its bias a bucket.
SMALL_BUCKET = 1100


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", SMALL_BUCKET)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    inner = [torch.nn.Linear(32, 32) for _ in range(4)]
    return torch.nn.Sequential(torch.nn.Linear(16, 32), *inner, torch.nn.Linear(32, 1))


def make_guard(
    model: torch.nn.Module, optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, **options: Any
) -> OOMGuard:
    plan = options.pop("plan", MASTER)
    step = options.pop("step", None) or mse_step(model)
    made = optimizer(model.parameters(), lr=1e-2)
    guard = OOMGuard(step, model=model, optimizer=made, ladder=[], tune_after=None, **options)
    guard.plan = plan
    return guard


def level(guard: OOMGuard) -> Any:
    effect = next(e for e in guard.effects._effects if type(e).__name__ == "OptimizerOffloadEffect")
    return effect._level  # type: ignore[attr-defined]


def state(model: torch.nn.Module, guard: OOMGuard) -> list[torch.Tensor]:
    """The device copies, the fp32 masters and every tensor of the optimizer's state, copied."""
    moments = [v.clone() for s in guard.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return (
        [p.detach().clone() for p in model.parameters()] + [m.clone() for m in level(guard).masters.values()] + moments
    )


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def trained(
    early: bool, monkeypatch: pytest.MonkeyPatch, seeds: range = range(4), **options: Any
) -> tuple[list[torch.Tensor], list[int]]:
    """A fresh model trained on the master level, its step begun during backward or not (``early``); its state,
    and the elements each call stepped during backward."""
    with monkeypatch.context() as patched:
        if not early:
            patched.setattr(StepRunner, "_steps_alone", lambda self, job: False)
        model = make_model()
        guard = make_guard(model, **options)
        stepped = []
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            for seed in seeds:
                guard(tuple_batch(seed=seed))
                stepped.append(guard.effects.stepped_early)
            return state(model, guard), stepped


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"plan": MASTER.replace(micro_batch_size=2)},
        {"host_step": "exact"},
        {"optimizer": lambda params, lr: torch.optim.Adam(params, lr=lr, amsgrad=True, weight_decay=0.1)},
    ],
    ids=["adamw-fused", "micro-batches", "exact", "adam-amsgrad"],
)
def test_buckets_stepped_during_backward_are_the_step_after_backward_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    """Every parameter of the MLP steps during its last backward from the second step on (the first makes Adam's
    state, after backward); masters, device copies and moments equal the step after backward's, bit for bit."""
    early, stepped = trained(True, monkeypatch, **options)
    after, none = trained(False, monkeypatch, **options)
    total = sum(p.numel() for p in make_model().parameters())
    assert stepped == [0, total, total, total] and none == [0, 0, 0, 0]
    assert equal(early, after)


@pytest.mark.parametrize(
    "options",
    [
        {"max_grad_norm": 1.0},
        {"optimizer": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)},
        {"step_journal": "never"},
    ],
    ids=["clipping", "sgd", "no-journal"],
)
def test_no_step_begins_during_backward_where_something_must_see_every_gradient_first(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    """Clipping needs the whole batch's norm; another optimizer is not known to step parameters one by one; an
    early step without a journal could not be undone."""
    _, stepped = trained(True, monkeypatch, **options)
    assert stepped == [0, 0, 0, 0]


def test_a_step_hook_on_the_optimizer_keeps_the_whole_step_after_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    guard = make_guard(model)
    calls: list[int] = []
    guard.optimizer.register_step_pre_hook(lambda *_: calls.append(1))
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for seed in range(3):
            guard(tuple_batch(seed=seed))
            assert guard.effects.stepped_early == 0
    assert calls == [1, 1, 1], "the hook saw one step a call"


def fail_in_backward(model: torch.nn.Module, error: BaseException) -> list[bool]:
    """The first layer's backward (the last to run) raises ``error`` while armed; returns the switch."""
    armed = [False]

    def hook(_: torch.Tensor) -> None:
        if armed[0]:
            armed[0] = False
            raise error

    model[0].weight.register_hook(hook)
    return armed


@pytest.mark.parametrize("error", [RuntimeError("a bug late in backward"), KeyboardInterrupt()])
def test_an_attempt_that_fails_after_buckets_stepped_puts_them_back_whole(
    monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """The buckets of the last layers stepped (and went up) before the first layer's backward raised: masters,
    moments and device copies are as before the call, and the next calls train as if it never failed."""
    reference = make_model()
    plain = make_guard(reference)
    model = make_model()
    guard = make_guard(model)
    armed = fail_in_backward(model, error)
    kernel, stepped = torch._fused_adamw_, []

    def spy(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        stepped.append(sum(p.numel() for p in params))
        return kernel(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model, reference)
        for seed in (1, 2, 3):
            plain(tuple_batch(seed=seed))
        guard(tuple_batch(seed=1))
        before, stepped[:] = state(model, guard), []
        armed[0] = True
        with pytest.raises(type(error)):
            guard(tuple_batch(seed=2))
        assert stepped, "buckets stepped during backward before it raised"
        assert equal(state(model, guard), before)
        guard(tuple_batch(seed=2))
        guard(tuple_batch(seed=3))
    assert equal(state(model, guard), state(reference, plain))


class Recompute(torch.autograd.Function):
    """A recomputation of one's own, reentrant as torch's checkpoint is but named otherwise: its backward runs its
    block again and a backward of its own, which accumulates into the block's weights a second time."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.run(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class Shared(torch.nn.Module):
    """A weight used inside a recomputed block and outside it, the outside use ``first`` (backward accumulates its
    gradient after the block's own backward) or not (backward accumulates the outer gradient first, and the
    recomputation reads the weight afterwards)."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(16, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 1)
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inner(x))
        if self.first:
            x = self.shared(x)
        x = Recompute.apply(lambda h: torch.tanh(self.shared(self.inner(h))), x)
        if not self.first:
            x = self.shared(x)
        return self.out(x)


@pytest.mark.parametrize("first", [True, False], ids=["outer-use-first", "outer-use-last"])
def test_a_gradient_accumulated_after_its_bucket_stepped_runs_the_step_again_after_backward(
    monkeypatch: pytest.MonkeyPatch, first: bool
) -> None:
    """The second gradient spoils the early steps of that backward (where the outer use comes last, the rest of
    backward read the stepped weight): the attempt is run again with the whole step after backward, and no step
    begins during backward after that. The bits of a step that never began early."""
    undone: list[int] = []
    undo = EarlyStep.undo

    def counted(self: EarlyStep) -> None:
        undone.append(len(self.stepped))
        undo(self)

    monkeypatch.setattr(EarlyStep, "undo", counted)
    (early, stepped), (after, _) = compared(monkeypatch, lambda: Shared(first))
    assert equal(early, after)
    assert len(undone) == 1 and all(undone), "the second step began early and was undone; none began after"
    assert stepped == [0, 0, 0, 0]


@pytest.mark.usefixtures("python_sigint")
def test_a_shutdown_signal_in_the_backward_where_the_step_began_waits_for_the_step_to_be_counted() -> None:
    """SIGINT arrives in the last backward after buckets stepped: the guard holds it from where the step began, as
    it does from a step's start; the call commits its one step, counts it, and then the interrupt is raised."""
    reference = make_model()
    plain = make_guard(reference)
    model = make_model()
    guard = make_guard(model)
    armed = [False]

    def interrupt(_: torch.Tensor) -> None:
        if armed[0]:
            armed[0] = False
            signal.raise_signal(signal.SIGINT)

    model[0].weight.register_hook(interrupt)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model, reference)
        for seed in (1, 2):
            plain(tuple_batch(seed=seed))
        guard(tuple_batch(seed=1))
        armed[0] = True
        with pytest.raises(KeyboardInterrupt):
            guard(tuple_batch(seed=2))
        assert guard.effects.stepped_early == sum(p.numel() for p in model.parameters())
    assert guard.summary().steps == 2, "the step was counted before the interrupt"
    assert equal(state(model, guard), state(reference, plain))


class SharedAfter(torch.nn.Module):
    """A weight used inside a reentrant checkpoint and then outside it: backward accumulates its outer gradient
    first, and the checkpoint's recompute reads it afterwards. ``applied`` > 1: one block applied that many times,
    each in a reentrant checkpoint of its own (ALBERT's shared layers)."""

    def __init__(self, applied: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(16, 16)
        self.inner = torch.nn.Linear(16, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 1)
        self.applied = applied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)  # (a checkpoint's input that requires grad, as a block's hidden states do)
        for _ in range(self.applied):
            x = checkpoint(lambda h: torch.tanh(self.shared(self.inner(h))), x, use_reentrant=True)
        x = torch.tanh(self.shared(x))
        return self.out(x)


def compared(monkeypatch: pytest.MonkeyPatch, make: Callable[[], torch.nn.Module], step: Any = None) -> list[Any]:
    """The state of ``make()``'s model trained four calls on the master level with its step begun during backward
    where the guard chooses to, then with the whole step after backward; and the elements stepped early."""
    monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", 16 * 16 + 16)
    found: list[Any] = []
    for early in (True, False):
        with monkeypatch.context() as patched:
            if not early:
                patched.setattr(StepRunner, "_steps_alone", lambda self, job: False)
            model = make()
            guard = make_guard(model, step=None if step is None else step(model))
            stepped = []
            with SimulatedGPU("1GiB") as gpu:
                gpu.adopt(model)
                for seed in range(4):
                    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
                    guard((x, torch.randn(4, generator=torch.Generator().manual_seed(seed))))
                    stepped.append(guard.effects.stepped_early)
                found.append((state(model, guard), stepped))
    return found


@pytest.mark.parametrize("applied", [1, 3], ids=["inside-then-outside", "one-block-three-times"])
def test_a_reentrant_checkpoint_keeps_the_whole_step_after_backward(
    monkeypatch: pytest.MonkeyPatch, applied: int
) -> None:
    """A reentrant checkpoint recomputes its forward inside backward, reading the weights as they are then: no
    bucket may step (and upload its weights) before that. The guard sees the checkpoint in the graph and steps
    after backward: the bits of a step that never began early."""
    (early, stepped), (after, _) = compared(monkeypatch, lambda: SharedAfter(applied))
    assert stepped == [0, 0, 0, 0]
    assert equal(early, after)


class Renormed(torch.nn.Module):
    """An embedding that renormalises the rows it looks up in place, in forward (``max_norm``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16, max_norm=1.0)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 10).long().clamp(max=31)[:, 0]  # (four rows a batch, from the data)
        return self.out(self.embed(ids))


def clipping_step(model: torch.nn.Module) -> Callable[[Any], torch.Tensor]:
    """A WGAN critic's step: its weights clipped in place, then its forward."""
    forward = mse_step(model)

    def step(batch: Any) -> torch.Tensor:
        with torch.no_grad():
            for param in model.parameters():
                param.clamp_(-0.05, 0.05)
        return forward(batch)

    return step


def clipping_data_step(model: torch.nn.Module) -> Callable[[Any], torch.Tensor]:
    """The same through ``p.data``, as the WGAN paper's code clips (no version counter moves)."""
    forward = mse_step(model)

    def step(batch: Any) -> torch.Tensor:
        for param in model.parameters():
            param.data.clamp_(-0.05, 0.05)
        return forward(batch)

    return step


@pytest.mark.parametrize(
    ("make", "step"),
    [(Renormed, None), (make_model, clipping_step), (make_model, clipping_data_step)],
    ids=["embedding-max-norm", "clipped-in-step", "clipped-through-data"],
)
def test_writes_to_the_weights_inside_the_step_function_reach_the_step(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[], torch.nn.Module], step: Any
) -> None:
    """What the step function writes on the device weights before its backward (an embedding renormalising rows in
    forward, weights clipped in the step) is what the step starts from: the bits of the step after backward."""
    (early, stepped), (after, _) = compared(monkeypatch, make, step)
    assert equal(early, after)
    assert stepped[1:] == [sum(p.numel() for p in make().parameters())] * 3, "the steps still began in backward"


def test_a_wrapper_of_the_optimizers_step_sees_every_step_with_every_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimizer.step`` replaced on the instance (gradients clipped by value, a logger) must see each step whole:
    no bucket steps during backward behind its back. A scheduler's own step counter is no such wrapper."""
    model = make_model()
    guard = make_guard(model)
    optimizer = guard.optimizer
    step = optimizer.step
    seen: list[int] = []

    def clipped(*args: Any, **kwargs: Any) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        seen.append(len(params))
        torch.nn.utils.clip_grad_value_(params, 0.01)
        return step(*args, **kwargs)

    optimizer.step = clipped  # type: ignore[method-assign]
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for seed in range(3):
            guard(tuple_batch(seed=seed))
            assert guard.effects.stepped_early == 0
    assert seen == [12, 12, 12], "the wrapper saw every gradient of every step"

    scheduled = make_model()
    adamw = torch.optim.AdamW(scheduled.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 1.0)
    counted = OOMGuard(
        mse_step(scheduled), model=scheduled, optimizer=adamw, scheduler=schedule, ladder=[], tune_after=None
    )
    counted.plan = MASTER
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(scheduled)
        for seed in range(2):
            counted(tuple_batch(seed=seed))
        assert counted.effects.stepped_early == sum(p.numel() for p in scheduled.parameters())
