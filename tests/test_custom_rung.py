"""A rung is one object: a custom one is added by one policy class and one effect, and the guard, the report,
the summary, stepping back up, the state file and the agreement of distributed ranks all follow it."""

from __future__ import annotations

import importlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.models import make_mlp
from helpers.steps import mse_step
from hypothesis import given
from hypothesis import strategies as st

from oomguard import Effect, EffectTarget, MicroBatch, OOMGuard, Plan, Rung, RungContext
from oomguard._backends.memory import MemoryBackend
from oomguard._cli.main import main
from oomguard._ladder.ladder import resolve_ladder
from oomguard._planner.search import configurations
from oomguard.testing import SimulatedGPU

APPLIED: list[tuple[str, int]] = []  # what the toy effect saw, in order


class RecordingEffect(Effect):
    """The toy rung's effect: it changes nothing in torch, it only records each level it was brought to."""

    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self.level = 0

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        level = plan.level("toy")
        if level == self.level:
            return False
        self.level = level
        APPLIED.append(("apply", level))
        return True

    def close(self) -> None:
        if self.level:
            self.level = 0
            APPLIED.append(("close", 0))


class Toy(Rung):
    """One policy class: a name, the phases it relieves (all, by default), and its effect."""

    name = "toy"

    def effect(self) -> type[Effect]:
        return RecordingEffect


@pytest.fixture(autouse=True)
def _fresh_record() -> None:
    APPLIED.clear()


def test_a_custom_rung_is_escalated_to_named_everywhere_and_given_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_mlp()
    log, state = tmp_path / "events.jsonl", tmp_path / "plans.json"
    # (predictive=False: the ladder's own step back up; the planner's, a dry run on fake tensors, would apply the
    # toy's effect too, which APPLIED records: tests/test_unattended.py has the planned one)
    guard = OOMGuard(
        mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), ladder=[Toy()],
        log_file=log, state_file=state, relax_after=1, log_every=1, predictive=False,
    )  # fmt: skip
    batches = [tuple_batch(seed=seed) for seed in range(3)]
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        gpu.fail_allocation(1)  # the first attempt runs out of memory: the guard's only rung is the toy
        first = guard(batches[0])
        second = guard(batches[1])
        relaxed = guard(batches[2])  # after relax_after clean steps: the toy is given back
    assert (first.ooms, first.rungs, second.rungs) == (1, ("toy",), ("toy",))
    assert first.plan == Plan().with_level("toy", 1)
    assert (relaxed.ooms, relaxed.rungs, relaxed.plan) == (0, (), Plan())
    assert APPLIED == [("apply", 1), ("apply", 0)], "applied once on the way down, undone once on the way up"

    fallback = next(e for e in guard.events if e.kind == "fallback")
    relax = next(e for e in guard.events if e.kind == "relax")
    assert (fallback.rung, relax.rung, relax.outcome) == ("toy", "toy", "held")
    assert "toy" in fallback.description
    summary = guard.summary()
    assert summary.fallbacks == {"toy": 1}
    assert summary.steps_by_rung == {"toy": 2, "none": 1}
    assert "Fallbacks needed: toy x1." in str(summary)

    assert main(["report", str(log)]) == 0
    table = capsys.readouterr().out
    assert "| toy | 1 | 2 |" in table, table
    assert "| none | 0 | 1 |" in table
    saved = json.loads(state.read_text())["plans"]
    assert [entry["plan"].get("extras") for entry in saved.values()] == [None], "saved, then given back"


def test_the_planned_step_back_up_gives_back_a_rung_the_time_model_sees_no_cost_in() -> None:
    """The planner's step up (issue 45, finding 12) tries a plan predicted faster; the toy costs no predicted time,
    so the plain plan ties with it: one rung less deep, it is ahead all the same."""
    model = make_mlp()
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     ladder=[Toy()], relax_after=1)  # fmt: skip
    batches = [tuple_batch(seed=seed) for seed in range(3)]
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        gpu.fail_allocation(1)  # the first attempt runs out of memory: the toy engages
        results = [guard(batch) for batch in batches]
    assert [r.rungs for r in results] == [("toy",), ("toy",), ()]
    (relax,) = [e for e in guard.events if e.kind == "relax"]
    assert (relax.rung, relax.outcome) == ("toy", "held")  # type: ignore[attr-defined]


def test_a_remembered_custom_rung_is_restored_from_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "plans.json"

    def job() -> OOMGuard:
        model = make_mlp()
        return OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        ladder=[Toy()], state_file=state, relax_after=None)  # fmt: skip

    batch = tuple_batch()
    with SimulatedGPU("64MiB") as gpu:
        first = job()
        gpu.adopt(first.model)
        gpu.fail_allocation(1)
        assert first(batch).rungs == ("toy",)
        again = job()
        gpu.adopt(again.model)
        restarted = again(batch)
    assert (restarted.ooms, restarted.rungs) == (0, ("toy",)), "the restart starts on the toy, without an OOM"
    assert APPLIED == [("apply", 1), ("apply", 1)], "each job's own effect applied it"


def test_a_remembered_custom_rung_this_guard_does_not_have_is_ignored_not_reported_engaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in issue 23: a job without the toy rung loaded a plan engaging it, ran no effect for it, and reported
    it engaged in its results, events and summary."""
    state, log = tmp_path / "plans.json", tmp_path / "events.jsonl"
    model = make_mlp()
    saver = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     ladder=[Toy()], state_file=state)  # fmt: skip
    saver.plan = Plan().with_level("toy", 1)
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        saver(tuple_batch())
        saver.close()
        assert '"toy": 1' in state.read_text()
        caplog.set_level(logging.WARNING, logger="oomguard")
        caplog.clear()  # (the first job's warning: it found no state file yet)
        other = make_mlp()
        guard = OOMGuard(mse_step(other), model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                         state_file=state, log_file=log, log_every=1)  # fmt: skip
        gpu.adopt(other)
        results = [guard(tuple_batch(seed=seed)) for seed in range(2)]
    assert [(r.plan, r.rungs) for r in results] == [(Plan(), ())] * 2
    assert "toy" not in json.dumps(guard.summary().steps_by_rung) and "toy" not in log.read_text()
    (warning,) = [r.getMessage() for r in caplog.records if str(state) in r.getMessage()]
    assert "toy" in warning and "not on this guard's ladder" in warning, warning


def test_closing_the_guard_undoes_the_custom_effect() -> None:
    model = make_mlp()
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     ladder=[Toy()])  # fmt: skip
    guard.plan = Plan().with_level("toy", 1)
    guard(tuple_batch())
    guard.close()
    assert APPLIED == [("apply", 1), ("close", 0)]


def test_an_effect_that_is_not_an_effect_is_refused_with_the_fix() -> None:
    class Broken(Rung):
        name = "broken"

        def effect(self) -> Any:
            return lambda target: object()

    model = make_mlp()
    with pytest.raises(ValueError, match=r"must return a subclass of oomguard\.Effect"):
        OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 ladder=[Broken()])  # fmt: skip


# -- stepping back up keeps what the ladder allows -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ladder", "micro_batch_size"),
    [([MicroBatch(min_size=2), "amp"], 8), (["amp"], 8)],
    ids=["micro-batches of at least 2", "no micro-batch rung"],
)
def test_giving_a_rung_back_keeps_the_micro_batches_the_ladder_allows(ladder: list[Any], micro_batch_size: int) -> None:
    """Found in review: relaxing a deeper rung went back to micro-batches of 1 whatever the ladder allowed
    (MicroBatch(min_size=k) was ignored, and a ladder without micro_batch started splitting the batch). Since
    issue 45 (finding 12) a rung is given back at the plan's own micro-batches (here the whole batch), never at
    smaller ones: a step back up never runs slower."""
    model = make_mlp()
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     ladder=ladder, relax_after=1, predictive=False)  # fmt: skip
    guard.plan = Plan(precision="bf16")
    guard(tuple_batch(n=8, seed=0))  # one clean step on the degraded plan
    relaxed = guard(tuple_batch(n=8, seed=1))
    event = next(e for e in guard.events if e.kind == "relax")
    assert (event.rung, event.outcome) == ("amp", "held")
    assert relaxed.plan.precision is None
    assert relaxed.micro_batch_size == micro_batch_size


def test_predictive_sizing_splits_no_batch_on_a_ladder_without_micro_batch() -> None:
    """Found with issue 23 (a plan the job saved must be one its ladder reaches): a new, larger bucket started on
    micro-batches the peak model sized (53 of 64, x2) though micro_batch was not on the ladder."""
    model = make_mlp(width=256)
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     ladder=["amp"], tune_after=None)  # fmt: skip
    with SimulatedGPU("200KiB") as gpu:
        gpu.adopt(model)
        results = [guard(tuple_batch(n=n)) for n in (8, 16, 64)]  # the peak model learns from the first two
    assert [r.micro_batches for r in results] == [1, 1, 1]
    assert results[-1].rungs == ("amp",), "the larger batch ran out of memory whole: amp answered it"


# -- the ladder's levels: what distributed ranks agree on ------------------------------------------------------------

PLANS = st.builds(
    Plan,
    micro_batch_size=st.none() | st.integers(1, 12),
    precision=st.sampled_from([None, "bf16", "fp16"]),
    checkpointing=st.sampled_from([None, "partial", "full"]),
    activation_offload=st.booleans(),
    offload_layers=st.integers(0, 6),
    extras=st.sampled_from([(), (("toy", 1),)]),
)


@given(PLANS, PLANS, st.integers(1, 12), st.integers(1, 12))
def test_the_agreed_plan_is_the_deepest_level_of_every_rung(a: Plan, b: Plan, size_a: int, size_b: int) -> None:
    """Each rank may hold a batch of another size (length buckets, token budgets): the micro-batch is agreed as a
    size, the smallest any rank chose, and a rank whose batch is no larger runs it whole."""
    ladder = resolve_ladder(["micro_batch", "amp", Toy()])
    for plan, size in ((a, size_a), (b, size_b)):
        again = ladder.at_levels(plan, ladder.levels(plan, size), size)
        assert again.replace(micro_batch_size=None) == plan.replace(micro_batch_size=None)
        assert again.effective_micro_batch_size(size) == plan.effective_micro_batch_size(size)
    levels = [max(x, y) for x, y in zip(ladder.levels(a, size_a), ladder.levels(b, size_b), strict=True)]
    smallest = min(a.effective_micro_batch_size(size_a), b.effective_micro_batch_size(size_b))
    for size in (size_a, size_b):
        agreed = ladder.at_levels(a, levels, size)  # what each rank makes of the agreed figures
        assert agreed.effective_micro_batch_size(size) == min(smallest, size)
        assert agreed.offload_layers == max(a.offload_layers, b.offload_layers)
        assert agreed.activation_offload == (a.activation_offload or b.activation_offload)
        assert agreed.level("toy") == max(a.level("toy"), b.level("toy"))
        order = [None, "partial", "full"]
        assert order.index(agreed.checkpointing) == max(order.index(a.checkpointing), order.index(b.checkpointing))


def test_a_custom_rung_cannot_take_the_name_of_a_built_in_one() -> None:
    class Impostor(Rung):
        name = "amp"

    with pytest.raises(ValueError, match="that name is the built-in rung's"):
        resolve_ladder(["micro_batch", Impostor()])
    assert resolve_ladder([MicroBatch(min_size=2)]).names == ("micro_batch",), "the built-in class itself is fine"


def test_a_plan_field_of_the_wrong_type_is_refused() -> None:
    """Found in review: a state file with ``"activation_offload": "no"`` loaded as a truthy plan."""
    with pytest.raises(ValueError, match="activation_offload must be True or False"):
        Plan.from_dict({"activation_offload": "no"})


# -- a built-in rung is one module and one registration line ---------------------------------------------------------

#: The whole of a new built-in rung, as it would sit in ``oomguard/_rungs/pinned_hook.py``: its policy, position,
#: precondition, phrase, tuning and effect (a forward hook pinned on the model, and unpinned).
PINNED_HOOK = '''
"""The pinned_hook rung (a test's): a forward hook pinned on the model while engaged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from oomguard import Effect, EffectTarget, Plan, Rung, RungContext
from oomguard._backends.memory import MemoryBackend
from oomguard._ladder.rungs import Trade

SEEN: list[int] = []  # the batch size of every forward the hook saw


class PinnedHookEffect(Effect):
    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self.handle: Any = None

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        wanted = plan.level("pinned_hook") > 0
        if wanted == self.holds:
            return False
        self.close() if not wanted else self._pin()
        return True

    def _pin(self) -> None:
        self.handle = self.target.model.register_forward_hook(lambda module, args, out: SEEN.append(len(args[0])))

    @property
    def holds(self) -> bool:
        return self.handle is not None

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        return self._aside() if self.holds else None

    @contextlib.contextmanager
    def _aside(self) -> Iterator[None]:
        self.close()
        try:
            yield
        finally:
            self._pin()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class PinnedHook(Rung):
    name = "pinned_hook"
    after: ClassVar[str] = "micro_batch"
    trade: ClassVar[Trade] = "levels"

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        return super().deeper(plan, context) if context.fact("hook_free") else None

    def describe(self, plan: Plan, batch_size: int | None) -> str | None:
        return "forward hook pinned" if plan.level(self.name) else None

    def facts(self, target: EffectTarget) -> Mapping[str, Any]:
        return {"hook_free": not target.model._forward_hooks}

    def effect(self) -> type[Effect]:
        return PinnedHookEffect
'''


@pytest.fixture
def pinned_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The rung's one file, imported, and its one registration call (taken back after the test)."""
    from oomguard._ladder.rungs import register, unregister

    (tmp_path / "pinned_hook.py").write_text(PINNED_HOOK)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("pinned_hook")
    register(module.PinnedHook)
    try:
        yield module
    finally:
        unregister("pinned_hook")
        sys.modules.pop("pinned_hook", None)


def test_a_new_built_in_rung_is_one_module_and_one_registration_line(
    pinned_hook: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24: with no edit elsewhere, the default ladder places it where it says, the guard escalates to it and
    its effect pins the hook, events, summary, report and state file name it, stepping back up unpins it, and the
    planner's search trades it."""
    assert resolve_ladder(None).names[1:4] == ("micro_batch", "pinned_hook", "amp"), "placed after micro_batch"
    model = make_mlp()
    log, state = tmp_path / "events.jsonl", tmp_path / "plans.json"
    # (predictive=False: the ladder's own step back up; the planner's dry run would run the hook on fakes, into SEEN)
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     log_file=log, state_file=state, relax_after=1, log_every=1, tune_after=None,
                     predictive=False)  # fmt: skip
    batches = [tuple_batch(n=1, seed=seed) for seed in range(3)]  # one sample: micro-batching has nothing to give
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        gpu.fail_allocation(1)  # the first attempt runs out of memory: the next rung answers
        first = guard(batches[0])
        assert (len(model._forward_hooks), pinned_hook.SEEN) == (1, [1]), "the hook is pinned and saw the retry"
        second = guard(batches[1])
        relaxed = guard(batches[2])  # after relax_after clean steps: given back
    assert (first.ooms, first.rungs) == (1, ("pinned_hook",))
    assert first.plan.describe(1) == "whole batch, forward hook pinned", "its own phrase"
    given_back = (relaxed.rungs, relaxed.plan.describe(1), len(model._forward_hooks))
    assert given_back == ((), "whole batch", 0), "given back: unpinned"
    fallback = next(e for e in guard.events if e.kind == "fallback")
    assert (fallback.rung, "forward hook pinned" in fallback.description) == ("pinned_hook", True)
    assert guard.summary().fallbacks == {"pinned_hook": 1}
    assert main(["report", str(log)]) == 0
    assert second.rungs == ("pinned_hook",) and pinned_hook.SEEN == [1, 1]
    assert "| pinned_hook | 1 | 2 |" in capsys.readouterr().out
    saved = [entry["plan"] for entry in json.loads(state.read_text())["plans"].values()]
    assert Plan.from_dict({**Plan().to_dict(), "pinned_hook": 1}) == first.plan, "its own key in the state file"
    assert all("extras" not in plan for plan in saved)

    context = RungContext(batch_size=8, facts={"hook_free": True})
    assert pinned_hook.PinnedHook().escalate(Plan(), RungContext(batch_size=8)) is None, "precondition unmet"
    planned = [plan for _, plan in configurations(Plan(), resolve_ladder(None), context)]
    assert Plan().with_level("pinned_hook", 1) in planned, "tuning's search trades it"


def test_the_registry_places_each_rung_after_its_neighbour_and_applies_what_it_ends_in_one_place() -> None:
    """Issue 24: a rung's default position is a declared neighbour, opt-in keeps it off the default ladder, and what
    it ends of other rungs is data applied by the ladder's escalation, both ways."""
    from oomguard import Amp
    from oomguard._ladder.plan import BUILTIN_RUNGS
    from oomguard._ladder.rungs import register, unregister

    class Early(Rung):
        name = "early"
        after = "micro_batch"
        ends = MappingProxyType({"amp": 0})  # (engaged, it takes mixed precision away and keeps it away)

    class Late(Rung):
        name = "late"
        after = "quantized_weights"
        opt_in = True

    class Orphan(Rung):
        name = "orphan"
        after = "nowhere"

    register(Late)
    register(Early)
    try:
        # (right behind micro_batch, ahead of amp, the built-in rung that follows it too)
        assert (BUILTIN_RUNGS[1:3], BUILTIN_RUNGS[-1]) == (("micro_batch", "early"), "late")
        assert (
            resolve_ladder(None).names[1:4] == ("micro_batch", "early", "amp")
            and "late" not in resolve_ladder(None).names
        )
        context, early = RungContext(batch_size=8), Plan().with_level("early", 1)
        assert Amp().escalate(early, context) is None, "amp is ended while early is engaged"
        assert Early().escalate(Plan(precision="bf16"), context) == early, "engaging early ends amp"
        assert (early.describe(8), early.to_dict()["early"], Plan.from_dict(early.to_dict())) == (
            "whole batch, early",
            1,
            early,
        )
        with pytest.raises(ValueError, match="registered already"):
            register(Early)
        with pytest.raises(ValueError, match="'nowhere', which is not registered"):
            register(Orphan)
    finally:
        unregister("early")
        unregister("late")
    assert "early" not in BUILTIN_RUNGS and resolve_ladder(None).names[2] == "amp"
