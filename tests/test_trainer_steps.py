"""Every allocation of a Trainer step is protected: the loss checks, the clipping, the optimizer step; a replay of
the step counts once; the trainer's own records keep no trace of a failed attempt."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hf_trainer import RaggedText, train_plain, training_args
from helpers.models import make_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard._guard.loop import Loop
from oomguard.testing import SimulatedGPU

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.integration  # the HF Trainer end to end

from oomguard.integrations.transformers import OOMGuardTrainer  # noqa: E402

ROOMY = "64MiB"  # the whole batch fits: the only OOMs are the ones a test injects


def train_guarded(
    folder: Path, trainer_class: type, oomguard: dict[str, Any] | None = None, **overrides: Any
) -> tuple[torch.nn.Module, Any]:
    model = make_llama(layers=2, hidden=64)
    args = training_args(folder, **overrides)
    trainer = trainer_class(model=model, args=args, train_dataset=RaggedText(), oomguard=oomguard)
    with SimulatedGPU(ROOMY) as gpu:
        gpu.adopt(model)
        trainer.gpu = gpu
        trainer.train()
    return model, trainer


def assert_same_training(model: torch.nn.Module, trainer: Any, reference: torch.nn.Module, plain: Any) -> None:
    assert trainer.state.global_step == plain.state.global_step == 4, "no step lost, none repeated"
    steps = {int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s}
    assert steps == {4}, "Adam stepped exactly once per global step"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses == pytest.approx([e["loss"] for e in plain.state.log_history if "loss" in e], rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=5e-5)


def oom_events(trainer: Any) -> list[Any]:
    return [e for e in trainer.oomguard.events if e.kind == "oom"]


class FaultInClipping(OOMGuardTrainer):
    """The issue's reproduction: the clipping's first allocation of the third step fails, once."""

    armed = False

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self.state.global_step == 2 and not self.armed:
            type(self).armed = True
            self.gpu.fail_allocation(1)
        return super()._clip_grad_norm(model)


def test_an_oom_in_the_trainers_clipping_is_recovered_as_one_step(tmp_path: Path) -> None:
    reference, plain = train_plain(tmp_path / "plain")
    FaultInClipping.armed = False
    model, trainer = train_guarded(tmp_path / "guarded", FaultInClipping)
    assert FaultInClipping.armed
    (oom,) = oom_events(trainer)
    assert oom.error.phase == "clip" and oom.step == 2, "named as the Trainer numbers the step"
    assert_same_training(model, trainer, reference, plain)
    summary = trainer.oomguard.summary()
    assert (summary.steps, summary.ooms, summary.recovered_steps) == (4, 1, 1)


class FaultAfterTheLoss(OOMGuardTrainer):
    """Arms a fault as the training step returns: the Trainer's NaN/Inf check and running loss come next."""

    armed = False

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(*args, **kwargs)
        if self.state.global_step == 1 and not self.armed:
            type(self).armed = True
            self.gpu.fail_allocation(1)
        assert not self.gpu.is_device(loss) and not self.gpu.is_device(self._tr_loss)
        return loss


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clipping", "norm-only"])
def test_the_loss_checks_allocate_no_device_memory_and_the_next_allocation_is_protected(
    tmp_path: Path, max_grad_norm: float
) -> None:
    """The NaN/Inf check and the running loss work on a host tensor, so the fault armed before them strikes the
    next device allocation: the clipping (or, without clipping, the gradient norm the Trainer logs), recovered."""
    reference, plain = train_plain(tmp_path / "plain")
    FaultAfterTheLoss.armed = False
    if max_grad_norm == 0.0:
        reference, plain = _plain_without_clipping(tmp_path / "plain0")
    model, trainer = train_guarded(tmp_path / "guarded", FaultAfterTheLoss, max_grad_norm=max_grad_norm)
    (oom,) = oom_events(trainer)
    assert oom.error.phase == "clip" and oom.step == 1
    assert_same_training(model, trainer, reference, plain)
    assert trainer.oomguard.summary().recovered_steps == 1


def _plain_without_clipping(folder: Path) -> tuple[torch.nn.Module, Any]:
    model = make_llama(layers=2, hidden=64)
    trainer = transformers.Trainer(
        model=model, args=training_args(folder, max_grad_norm=0.0), train_dataset=RaggedText()
    )
    trainer.train()
    return model, trainer


class FaultInTheOptimizer(OOMGuardTrainer):
    armed = False

    def create_optimizer(self) -> Any:
        optimizer = super().create_optimizer()

        def arm(*_: Any) -> None:
            if self.state.global_step == 2 and not self.armed:
                type(self).armed = True
                self.gpu.fail_allocation(1)

        optimizer.register_step_pre_hook(arm)
        return optimizer


def test_a_replayed_optimizer_step_counts_as_one_recovered_step(tmp_path: Path) -> None:
    """4 steps, one OOM in the optimizer step: 4 steps, 1 OOM, 1 recovered (not 5 steps and 0 recovered), and
    every event of the replay names the Trainer's step."""
    reference, plain = train_plain(tmp_path / "plain")
    FaultInTheOptimizer.armed = False
    # (A fault injected into a step the guard judged safe to run without its journal could not be undone: the
    # journal is forced, as a real OOM in the step is only possible where it was judged unsafe.)
    model, trainer = train_guarded(tmp_path / "guarded", FaultInTheOptimizer, oomguard={"step_journal": "always"})
    assert FaultInTheOptimizer.armed
    summary = trainer.oomguard.summary()
    assert (summary.steps, summary.ooms, summary.recovered_steps) == (4, 1, 1), summary.describe()
    assert {e.step for e in trainer.oomguard.events if e.kind in ("oom", "fallback", "recovered")} == {2}
    assert_same_training(model, trainer, reference, plain)


class FaultInTheOptimizerAndItsReplay(FaultInTheOptimizer):
    """Then the replay's first allocation (its forward, on the plan one rung down) fails too, once."""

    replays = 0

    def _replay(self, clip: bool) -> None:
        type(self).replays += 1
        if type(self).replays == 1:
            self.gpu.fail_allocation(1)
        super()._replay(clip)


def test_an_oom_in_a_replay_is_an_attempt_of_the_same_step_in_one_recovery_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24: the replay ran a second recovery loop nested inside the first, coupled by a flag; its OOMs were
    numbered from 1 again. Now a replay is an attempt of the step's one loop: its failure comes back to it as a
    value, and the step's attempts count on (1 in the optimizer step, 2 in the replay's forward)."""
    depth, deepest = [0], [0]
    run = Loop.run

    def counted(self: Loop, *args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        deepest[0] = max(deepest[0], depth[0])
        try:
            return run(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(Loop, "run", counted)
    reference, plain = train_plain(tmp_path / "plain")
    FaultInTheOptimizerAndItsReplay.armed, FaultInTheOptimizerAndItsReplay.replays = False, 0
    model, trainer = train_guarded(
        tmp_path / "guarded", FaultInTheOptimizerAndItsReplay, oomguard={"step_journal": "always"}
    )
    assert FaultInTheOptimizerAndItsReplay.replays == 2, "the failed replay, then the one that held"
    assert deepest[0] == 1, "one recovery loop, never one inside another"
    ooms = oom_events(trainer)
    assert [(e.step, e.attempt, e.error.phase) for e in ooms] == [(2, 1, "optimizer"), (2, 2, "forward")]
    summary = trainer.oomguard.summary()
    assert (summary.steps, summary.ooms, summary.recovered_steps) == (4, 2, 1), summary.describe()
    assert_same_training(model, trainer, reference, plain)


class FaultInTheOptimizerAndItsReplaysClipping(FaultInTheOptimizer):
    """Then the clipping of the replay's recomputed gradients fails, once."""

    clipped_in_replay = 0

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self._oomguard_step.replaying:
            type(self).clipped_in_replay += 1
            if type(self).clipped_in_replay == 1:
                self.gpu.fail_allocation(1)
        return super()._clip_grad_norm(model)


def test_an_oom_in_a_replays_clipping_is_an_attempt_of_the_same_step(tmp_path: Path) -> None:
    """Before: the replay clipped outside the guard, so its OOM left the recovery loop and ended train()."""
    reference, plain = train_plain(tmp_path / "plain")
    trainer_class = FaultInTheOptimizerAndItsReplaysClipping
    trainer_class.armed, trainer_class.clipped_in_replay = False, 0
    model, trainer = train_guarded(tmp_path / "guarded", trainer_class, oomguard={"step_journal": "always"})
    assert trainer_class.clipped_in_replay == 2, "the failed replay, then the one that held"
    ooms = oom_events(trainer)
    assert [(e.step, e.attempt, e.error.phase) for e in ooms] == [(2, 1, "optimizer"), (2, 2, "clip")]
    summary = trainer.oomguard.summary()
    assert (summary.steps, summary.ooms, summary.recovered_steps) == (4, 2, 1), summary.describe()
    assert_same_training(model, trainer, reference, plain)


def test_a_subclass_listed_before_the_guard_is_refused_with_the_fix() -> None:
    class Other(transformers.Trainer):  # type: ignore[misc]
        pass

    with pytest.raises(TypeError, match=r"class Wrong\(OOMGuardTrainer, Other\)"):

        class Wrong(Other, OOMGuardTrainer):
            pass

    class Right(OOMGuardTrainer, Other):  # the order a user writes: accepted
        pass


# -- the trainer's records, taken back after a failed attempt ---------------------------------------------------


class Opaque:
    """Not plain data (a stand-in for a tensor, a model, a handle): an attribute holding one is left alone."""


class Records:
    """A trainer's records of every kind a rollback puts back, and two it leaves alone."""

    def __init__(self) -> None:
        self.tokens = 100
        self.history = [0.5, 0.25, 0.125]
        self.records = [{"step": 0, "loss": 0.5}, {"step": 1, "loss": 0.25}]
        self._metrics = {"train": collections.defaultdict(list, {"entropy": [0.9]}), "eval": {}}
        self.window = collections.deque([1, 2, 3], maxlen=3)
        self.seen = {"a", "b"}
        self.pair = ("losses", [1.0])
        self.order = {"a": 1, "b": 2}
        self.handles = [Opaque()]  # (not plain: left alone)
        self.deep = [[[[[1]]]]]  # (deeper than 4: left alone, as before)


def _as_it_is(value: Any) -> Any:
    """``value`` spelt out with every container's type, identity and order (a set's sorted): equal only if the
    same objects hold the same entries in the same order."""
    if isinstance(value, (int, float, str, bytes, type(None))):
        return value
    if isinstance(value, dict):
        return type(value), id(value), [(k, _as_it_is(v)) for k, v in value.items()]
    if isinstance(value, (set, frozenset)):
        return type(value), id(value), sorted(map(repr, value))
    if isinstance(value, (list, tuple, collections.deque)):
        return type(value), id(value), getattr(value, "maxlen", None), [_as_it_is(v) for v in value]
    return id(value)


def _what_an_attempt_does(records: Records) -> None:
    """Everything a shallow record could miss: entries replaced in place and inserted before the others, nested
    dicts and lists mutated, a nested list and an attribute rebound, a deque rotated and overflowed, a dict
    reordered, an attribute deleted, a container inside a tuple changed."""
    records.tokens += 7
    records.history[1] = 99.0
    records.history.insert(0, -1.0)
    records.history.append(0.0625)
    records.records[0]["loss"] = 0.0
    records.records[1]["extra"] = 1
    records.records.append({"step": 2})
    records._metrics["train"]["entropy"].append(0.8)
    records._metrics["train"]["accuracy"].append(0.1)  # (a key the defaultdict makes)
    records._metrics["eval"] = {"loss": [1.0]}
    records.window.rotate(1)
    records.window.append(4)  # (maxlen 3: the oldest entry drops out)
    records.seen.discard("a")
    records.seen.add("c")
    records.pair[1].append(2.0)
    records.order["a"] = records.order.pop("a")  # (the same items, in another order)
    records.history, moved = [], records.history  # (rebound; the old list still changed)
    moved.append(1.0)
    del records.seen
    records.handles.append(Opaque())
    records.deep[0][0][0][0].append(2)
    records.lazily_made = [1]


def test_a_rollback_puts_back_every_record_exactly_and_in_place() -> None:
    """What a failed attempt changed in the trainer's plain records is put back, to the same objects (whatever
    holds a nested record sees it too), in their order, twice over (a second failed attempt). The record is shallow
    (containers by identity, their entries as references) so that it costs no more than a look at a growing
    history: this shows it misses nothing a deep copy caught. (Before, a restore filled the containers with deep
    copies: a reference held to a nested record, TRL's ``_metrics["train"]`` say, no longer saw the trainer's.)"""
    from oomguard.integrations._rollback import PlainState

    records = Records()
    before = {name: _as_it_is(value) for name, value in vars(records).items()}
    state = PlainState(records)
    for attempt in range(2):
        _what_an_attempt_does(records)
        handles, deep = _as_it_is(records.handles), _as_it_is(records.deep)
        state.restore()
        now = {name: _as_it_is(value) for name, value in vars(records).items()}
        assert now.pop("lazily_made") is not None, "what the trainer made since is kept"
        assert now.pop("handles") == handles and now.pop("deep") == deep, "what is not plain data is left alone"
        assert now == {k: v for k, v in before.items() if k not in ("handles", "deep")}, attempt


def _plain_before(value: Any, depth: int = 0) -> bool:
    """The rule for what is plain data, as the rollback has always had it (the deep-copying version's)."""
    if isinstance(value, (int, float, complex, str, bytes, type(None))):
        return True
    if depth >= 4:
        return False
    if isinstance(value, dict):
        return all(_plain_before(k, depth + 1) and _plain_before(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return all(_plain_before(v, depth + 1) for v in value)
    return False


_SCALAR = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3), st.none(), st.booleans())
_KEY = st.one_of(st.integers(), st.text(max_size=3), st.tuples(st.integers(), st.text(max_size=2)))
_VALUES = st.recursive(
    st.one_of(_SCALAR, st.builds(Opaque)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.lists(inner, max_size=4).map(collections.deque),
        st.dictionaries(_KEY, inner, max_size=3),
        st.dictionaries(_KEY, inner, max_size=3).map(lambda d: collections.defaultdict(list, d)),
        st.sets(_KEY, max_size=3),
        st.frozensets(_KEY, max_size=3),
    ),
    max_leaves=12,
)


def _scramble(value: Any, depth: int = 0) -> None:
    """Every mutable container in ``value`` (to 6 deep) changed in place: entries replaced, added, reordered."""
    if depth > 6 or isinstance(value, (str, bytes)):
        return
    if isinstance(value, dict):
        for inner in list(value.values()):
            _scramble(inner, depth + 1)
        items = list(value.items())[::-1]
        value.clear()
        value.update(items[1:])
        value["scrambled"] = depth
    elif isinstance(value, (list, tuple, frozenset, collections.deque)):
        for inner in list(value):
            _scramble(inner, depth + 1)
        if isinstance(value, list):
            value.reverse()
            value[:1] = [depth, depth]
        elif isinstance(value, collections.deque):
            value.rotate(1)
            value.append(depth)
    elif isinstance(value, set):
        value.add(("scrambled", depth))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), _VALUES, max_size=5))
def test_a_rollback_takes_back_what_it_always_did_and_exactly(attributes: dict[str, Any]) -> None:
    """Whatever an attempt does to the trainer's containers in place, the rollback puts back exactly the
    attributes that are plain data by the rule it has always had (numbers, strings and containers of them, 4
    deep), the same objects in the same order, and leaves the others as the attempt left them."""
    from oomguard.integrations._rollback import PlainState

    owner = Records.__new__(Records)  # (an object with only these attributes)
    vars(owner).update(attributes)
    plain = {name for name, value in attributes.items() if _plain_before(value)}
    before = {name: _as_it_is(value) for name, value in attributes.items()}
    state = PlainState(owner)
    for value in attributes.values():
        _scramble(value)
    after_attempt = {name: _as_it_is(value) for name, value in vars(owner).items()}
    state.restore()
    now = {name: _as_it_is(value) for name, value in vars(owner).items()}
    assert {name: now[name] for name in plain} == {name: before[name] for name in plain}
    assert {name: now[name] for name in set(now) - plain} == {name: after_attempt[name] for name in set(now) - plain}
