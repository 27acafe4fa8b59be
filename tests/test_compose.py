"""Plans of a deep model composed from shallow copies of it (oomguard._planner.compose): the figures a full fake step
measures, within a fraction of a percent, for every rung; and ``oomguard plan`` recommends what its exact path does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.batches import lm_batch
from helpers.models import make_llama, make_qwen2
from helpers.scenarios import NanoGPT
from helpers.steps import model_step
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import OOMGuard, Plan, plan
from oomguard._planner import fakes
from oomguard._planner.bench import StepBench
from oomguard._planner.compose import MIN_BLOCKS, points
from oomguard._planner.engine import dry_run
from oomguard._planner.report import Candidate
from oomguard.testing import SimulatedGPU

LAYERS = 6  # (composed from MIN_BLOCKS = LAYERS: deep enough for every plan below, quick to measure in full)
CHUNKED = (("chunked_loss", 1),)
PLANS = [
    Plan(),
    Plan(micro_batch_size=2),
    Plan(precision="bf16"),
    Plan(checkpointing="partial"),
    Plan(checkpointing="full", activation_offload=True),
    Plan(optimizer_offload=True),
    Plan(precision="bf16", checkpointing="full", optimizer_offload="master"),
    Plan(offload_layers=3),
    Plan(offload_layers=4, checkpointing="partial"),
    Plan(micro_batch_size=2, precision="bf16", checkpointing="full", activation_offload=True, offload_layers=LAYERS),
    Plan(quantized_optimizer=True, extras=CHUNKED),
]


@pytest.fixture(autouse=True)
def _compose_from_six_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MIN_BLOCKS > LAYERS  # (what a model needs by default: these are composed only here)
    monkeypatch.setattr("oomguard._planner.engine.MIN_BLOCKS", LAYERS)


@pytest.fixture
def always_confirmed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The composed recommendation measured in full however far it clears the device (CLEAR: within 100 %)."""
    monkeypatch.setattr("oomguard._planner.compose.CLEAR", 1.0)


def measure(make: Any, plans: list[Plan], composed: bool, target: str = "cuda", batch: Any = None) -> list[Candidate]:
    """Every plan's candidate, measured on fake tensors with full steps or composed from shallow ones (a batch of
    4 x 32 tokens, or of ``batch``: each key's shape)."""
    with FakeTensorMode():
        batch = (
            lm_batch(4, 32) if batch is None else {key: torch.zeros(shape, dtype=torch.long) for key, shape in batch}
        )

        def build(layers: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
            model = make(layers)
            return (lambda b: model(**b)), model, torch.optim.AdamW(model.parameters(), foreach=True)

        step, model, optimizer = build(LAYERS)
        report = dry_run(
            step, batch, model=model, optimizer=optimizer, capacity=2**40, target=target,  # type: ignore[arg-type]
            label="llama", plans=plans, shallow=build if composed else None,
        )  # fmt: skip
    assert report.fake_steps > 0
    return sorted(report.candidates, key=lambda c: plans.index(c.plan))


#: A tied head and its loss in chunks: what the composition must keep once, however deep the model.
TIED = [
    Plan(extras=CHUNKED),
    Plan(precision="bf16", checkpointing="full", optimizer_offload="master", extras=CHUNKED),
    Plan(offload_layers=3, extras=CHUNKED),
]


#: Layer offload where a block's weights outweigh its activations: prefetching the next block keeps one more block
#: resident whatever the count streamed (TinyLlama's walk composed 16 streamed layers 2.5 GB over a full step's).
STREAMED = [
    Plan(offload_layers=3),
    Plan(offload_layers=5, micro_batch_size=2),
    Plan(offload_layers=LAYERS),
    Plan(offload_layers=LAYERS, micro_batch_size=2, precision="bf16", checkpointing="full"),
    Plan(offload_layers=4, checkpointing="partial"),
]


@pytest.mark.parametrize(
    ("name", "make", "plans"),
    [
        ("llama", lambda layers: make_llama(layers=layers, hidden=32), PLANS),
        ("tied qwen2", lambda layers: make_qwen2(layers=layers), TIED),
        ("wide llama", lambda layers: make_llama(layers=layers, hidden=256), STREAMED),
    ],
)
def test_composed_figures_are_those_of_a_full_fake_step_for_every_rung(name: str, make: Any, plans: list[Plan]) -> None:
    """Byte for byte: within a phase every figure is affine in the count of identical blocks (the issue asked for
    1 %)."""
    exact, composed = measure(make, plans, composed=False), measure(make, plans, composed=True)
    for full, built in zip(exact, composed, strict=True):
        assert built.plan == full.plan
        for figure in ("peak_bytes", "device_overhead_bytes", "host_bytes", "transfer_bytes", "fits", "phase"):
            assert getattr(built, figure) == getattr(full, figure), (name, full.plan, figure)
        assert built.predicted_seconds == pytest.approx(full.predicted_seconds, rel=1e-9), (name, full.plan)


def test_the_plan_recommended_is_confirmed_by_a_full_step(always_confirmed: None) -> None:
    """The composed candidates are predictions; the one recommended is replaced by its full step's figures (a
    composition with a wrong figure would show here: the confirmed candidate is the exact one)."""
    plans = [Plan(), Plan(precision="bf16", checkpointing="full")]
    exact = measure(lambda n: make_llama(layers=n, hidden=32), plans, composed=False, target="simulated")
    with FakeTensorMode():
        model = make_llama(layers=LAYERS, hidden=32)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        budget = (exact[0].peak_bytes + exact[1].peak_bytes) // 2  # the first does not fit, the second does
        calls: list[int] = []

        def build(layers: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
            calls.append(layers)
            shallow = make_llama(layers=layers, hidden=32)
            return (lambda b: shallow(**b)), shallow, torch.optim.AdamW(shallow.parameters(), foreach=True)

        report = dry_run(
            lambda b: model(**b), lm_batch(4, 32), model=model, optimizer=optimizer, capacity=budget,
            target="simulated", label="llama", plans=plans, shallow=build,
        )  # fmt: skip
    assert sorted(calls) == [1, 2]  # one shallow model of each depth, made once
    assert report.recommended == plans[1]
    assert report.chosen == exact[1]  # every figure: a full step's, not the composition's


def _with_unused(layers: int) -> torch.nn.Module:
    """A Llama with a parameter its step never uses (no gradient: no optimizer state in any step)."""
    model = make_llama(layers=layers, hidden=32)
    model.register_parameter("unused", torch.nn.Parameter(torch.zeros(4096)))
    return model


@pytest.mark.parametrize(("make", "warm_ups"), [(lambda n: make_llama(layers=n, hidden=32), 0), (_with_unused, 1)])
def test_the_deep_models_warm_up_is_an_optimizer_step_alone_where_the_copies_stepped_every_parameter(
    make: Any, warm_ups: int, always_confirmed: None
) -> None:
    """The deep model's warm-up only makes its optimizer state: where the shallow copies' steps made state for every
    parameter, an optimizer step on zero gradients makes the same, without a forward of the deep model; where a
    parameter gets no gradient (and no state, which zero gradients would make), the warm-up is a whole step. Either
    way the confirmed figures are the exact path's."""
    plans = [Plan(), Plan(precision="bf16")]
    exact = measure(make, plans, composed=False)
    forwards: list[int] = []
    with FakeTensorMode():

        def build(layers: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
            model = make(layers)
            if layers == LAYERS:
                model.register_forward_pre_hook(lambda *_: forwards.append(1))
            return (lambda b: model(**b)), model, torch.optim.AdamW(model.parameters(), foreach=True)

        step, model, optimizer = build(LAYERS)
        report = dry_run(
            step, lm_batch(4, 32), model=model, optimizer=optimizer, capacity=2**40, target="cuda",
            label="llama", plans=plans, shallow=build,
        )  # fmt: skip
    assert report.composed and len(forwards) == 1 + warm_ups, "the confirming step's forward, and the warm-up's"
    assert report.chosen == next(c for c in exact if c.plan == report.recommended)


def test_a_guards_dry_run_after_real_steps_warms_up_with_the_optimizer_step_alone() -> None:
    """The guard's tuning and later jumps plan a model whose real steps made optimizer state for every parameter:
    the dry run's warm-up is then the optimizer step alone (one forward fewer), with the same figures; before the
    first real step, or with a parameter that gets no gradient, a whole step."""
    model = _with_unused(2)
    optimizer = torch.optim.AdamW(model.parameters())
    assert not fakes.stepped_every_parameter(optimizer)  # (no state before the first step)
    model(**lm_batch(2, 8)).loss.backward()
    optimizer.step()
    assert not fakes.stepped_every_parameter(optimizer), "the unused parameter has no state"
    del model.unused
    optimizer = torch.optim.AdamW(model.parameters())
    model(**lm_batch(2, 8)).loss.backward()
    optimizer.step()
    assert fakes.stepped_every_parameter(optimizer)

    def planned(warm_up_alone: bool) -> tuple[list[Candidate], int]:
        forwards: list[int] = []
        with FakeTensorMode():
            model = make_llama(layers=2, hidden=32)
            model.register_forward_pre_hook(lambda *_: forwards.append(1))
            report = dry_run(
                lambda b: model(**b), lm_batch(4, 32), model=model, optimizer=torch.optim.AdamW(model.parameters()),
                capacity=2**40, target="simulated", label="llama", plans=[Plan(), Plan(micro_batch_size=2)],
                every_parameter_steps=warm_up_alone,
            )  # fmt: skip
        return list(report.candidates), len(forwards)

    (alone, fewer), (whole, more) = planned(True), planned(False)
    assert alone == whole and (fewer, more) == (3, 4), "1 + 2 micro-batches measured, and the warm-up's forward"


def test_points_weigh_resident_and_streamed_blocks_and_pairs_for_partial_checkpointing() -> None:
    for blocks in (6, 7, 22):
        for given in (Plan(), Plan(offload_layers=blocks), Plan(offload_layers=2), Plan(checkpointing="partial")):
            steps = points(given, blocks)
            assert sum(weight for _, _, weight in steps) == pytest.approx(1.0)
            # the composition of the block counts is the deep model's: resident and streamed blocks alike
            resident = sum(w * (n - p.offload_layers) for p, n, w in steps)
            streamed = sum(w * p.offload_layers for p, _, w in steps)
            assert (resident, streamed) == pytest.approx((blocks - given.offload_layers, given.offload_layers))


def test_plan_composes_deep_models_and_exact_measures_every_candidate_in_full(always_confirmed: None) -> None:
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    fast = plan(config, gpu_memory="24MiB", batch_size=4, seq_len=64, target="simulated")
    exact = plan(config, gpu_memory="24MiB", batch_size=4, seq_len=64, target="simulated", exact=True)
    assert fast.recommended == exact.recommended is not None
    assert [c.plan for c in fast.candidates] == [c.plan for c in exact.candidates]
    for built, full in zip(fast.candidates, exact.candidates, strict=True):
        assert built.peak_bytes == pytest.approx(full.peak_bytes, rel=0.01)
    assert exact.fake_steps == len(exact.candidates) + 1  # one full step each, and the warm-up
    # two shallow warm-ups and steps, the deep warm-up and the confirmation
    assert fast.fake_steps == 2 + 2 * len(fast.candidates) + 2


def _preplanned(monkeypatch: pytest.MonkeyPatch, composing: bool) -> tuple[list[tuple[Any, ...]], bool]:
    """preplan's candidates for a guarded 6-layer Llama on a 3 MiB simulated device (composed or not), and
    whether the model has its blocks and parameters back after."""
    with monkeypatch.context() as patched:
        if not composing:
            patched.setattr(fakes, "_shallow", lambda *args: None)
        model = make_llama(layers=LAYERS, hidden=32)
        names = [name for name, _ in model.named_parameters()]
        guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()))
        with SimulatedGPU("3MiB") as gpu:
            gpu.adopt(model)
            report = fakes.preplan(guard._step_fn, lm_batch(8, 32), guard.options, gpu, bf16=True)
    assert report is not None and report.recommended is not None
    assert report.composed is composing
    whole = [name for name, _ in model.named_parameters()] == names and len(model.model.layers) == LAYERS
    return [(c.plan, c.peak_bytes, c.host_bytes, c.transfer_bytes, c.fits) for c in report.candidates], whole


def test_the_guards_own_model_is_cut_to_fewer_blocks_while_planned_and_whole_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The jump and preplan plan the user's model object (the step function calls it): its block list is cut
    short for each shallow step and put back, and the answer is a full walk's, figure for figure."""
    composed, whole = _preplanned(monkeypatch, composing=True)
    full, _ = _preplanned(monkeypatch, composing=False)
    assert whole
    assert len(composed) > 2 and composed == full


#: Plans whose effects move state to the host: a shallow copy of the guard's own model undoes them after each step.
MOVED = [
    Plan(),
    Plan(optimizer_offload=True),
    Plan(precision="bf16", checkpointing="full", optimizer_offload="master"),
    Plan(offload_layers=3),
    Plan(micro_batch_size=2, checkpointing="full", activation_offload=True, optimizer_offload=True, offload_layers=1),
]


def test_the_guards_own_model_cut_short_composes_the_figures_of_a_full_step_where_state_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shallow copy of the guard's own model undoes the plan's effects after each of its steps, on the probe that
    measured the step: the optimizer state it brought back to the device was read as the step's peak after the
    optimizer step, and as its transfers. Plans that offload it composed above their peak (1.45x here; a 14-block
    MLP stack's all at one figure, 1.2-1.45x theirs, whatever else they did: its jump answered "no plan on the
    ladder fits", then the guard walked 23-37 OOMs)."""

    def measured(composing: bool) -> list[Candidate]:
        with monkeypatch.context() as patched:
            if not composing:
                patched.setattr(fakes, "_shallow", lambda *args: None)
            model = make_llama(layers=LAYERS, hidden=256)  # (weights that outweigh a step's activations)
            guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(model.parameters()))
            with SimulatedGPU("1GiB") as gpu:
                gpu.adopt(model)
                report = fakes.preplan(guard._step_fn, lm_batch(4, 32), guard.options, gpu, bf16=True, plans=MOVED)
            guard.close()
        assert report is not None and report.composed is composing
        return sorted(report.candidates, key=lambda c: MOVED.index(c.plan))

    composed, full = measured(composing=True), measured(composing=False)
    assert [c.plan for c in composed] == [c.plan for c in full] == MOVED
    for built, exact in zip(composed, full, strict=True):
        for figure in ("peak_bytes", "transfer_bytes", "host_bytes", "fits", "phase"):
            assert getattr(built, figure) == getattr(exact, figure), (exact.plan, figure)


def _helped(plans: list[Plan], helper: bool, failing: int | None = None) -> tuple[Any, list[int]]:
    """A composed dry run of a 6-layer Llama (with a helper process or not), and the depths of the shallow models
    built in this process; a shallow model of ``failing`` blocks raises."""
    built: list[int] = []
    with FakeTensorMode():

        def build(layers: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
            if layers != LAYERS:
                built.append(layers)  # (in the process that builds it: a helper's list is its own)
            if layers == failing:
                raise IndexError("a model indexed by its block count")
            model = make_llama(layers=layers, hidden=32)
            return (lambda b: model(**b)), model, torch.optim.AdamW(model.parameters(), foreach=True)

        step, model, optimizer = build(LAYERS)
        report = dry_run(
            step, lm_batch(4, 32), model=model, optimizer=optimizer, capacity=2**40, target="cuda",
            label="llama", plans=plans, shallow=build, helper=helper,
        )  # fmt: skip
    return report, built


def test_a_helper_process_runs_some_shallow_steps_with_the_same_figures() -> None:
    """With a helper (``oomguard plan``'s, on two cores), every other depth's shallow steps run in a forked process,
    which builds those models; the candidates are the same."""
    plans = [Plan(), Plan(precision="bf16", checkpointing="partial"), Plan(offload_layers=4)]
    alone, built_alone = _helped(plans, helper=False)
    helped, built_helped = _helped(plans, helper=True)
    assert helped.candidates == alone.candidates
    # The helper's depths: 2 and 4 blocks, and for pairs 2 pairs (4 blocks); here 1 and 3 blocks, and 1 pair (2
    # blocks): the 2-block model is built (and warmed up: one fake step more) in both processes.
    assert sorted(built_alone) == [1, 2, 3, 4] and sorted(built_helped) == [1, 2, 3]
    assert helped.fake_steps == alone.fake_steps + 1


def test_a_shallow_step_failing_in_the_helper_measures_every_plan_in_full() -> None:
    """The helper's error comes back: the dry run measures every plan on the deep model, as without a helper."""
    plans = [Plan(), Plan(precision="bf16")]
    exact = measure(lambda n: make_llama(layers=n, hidden=32), plans, composed=False)
    report, built = _helped(plans, helper=True, failing=2)
    assert not report.composed and built == [1]  # (the 1-block model's step ran: composing failed after it)
    assert sorted(report.candidates, key=lambda c: plans.index(c.plan)) == exact


def test_a_model_of_its_own_blocks_is_composed_from_two_and_three_and_exactly() -> None:
    """A model that is not a transformers one (nanoGPT's shape) has its blocks found as a list of at least two
    alike: its copies have two and three blocks (one would have none to checkpoint), and the figures are exact."""
    plans = [Plan(), Plan(checkpointing="full"), Plan(micro_batch_size=2, checkpointing="full", offload_layers=2)]

    def run(composed: bool) -> tuple[list[Candidate], list[int]]:
        built: list[int] = []
        with FakeTensorMode():

            def build(layers: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
                built.append(layers)
                model = NanoGPT(layers=layers)
                step = lambda b: model(b["input_ids"][:, :-1], b["input_ids"][:, 1:])  # noqa: E731
                return step, model, torch.optim.AdamW(model.parameters(), foreach=True)

            step, model, optimizer = build(LAYERS)
            report = dry_run(
                step, lm_batch(4, 33), model=model, optimizer=optimizer, capacity=2**40, target="cuda",
                label="nanogpt", plans=plans, shallow=build if composed else None,
            )  # fmt: skip
        assert report.composed is composed
        return sorted(report.candidates, key=lambda c: plans.index(c.plan)), sorted(set(built) - {LAYERS})

    (full, _), (built, depths) = run(composed=False), run(composed=True)
    assert depths == [2, 3] and built == full


def counting_deep_forwards(forwards: list[int]) -> Any:
    """A maker of Llamas of ``n`` layers (step function, model, optimizer: ``dry_run``'s ``shallow``) whose deep
    model's forwards are counted in ``forwards``: the full steps it runs (call it in a ``FakeTensorMode``)."""

    def build(layers: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
        model = make_llama(layers=layers, hidden=32)
        if layers == LAYERS:
            model.register_forward_pre_hook(lambda *_: forwards.append(1))
        return (lambda b: model(**b)), model, torch.optim.AdamW(model.parameters(), foreach=True)

    return build


def short_of_the_whole_batch(forwards: list[int]) -> tuple[Callable[..., Any], int]:
    """(In a ``FakeTensorMode``.) A dry run of the deep Llama of :func:`counting_deep_forwards` with its shallow copies
    (called with ``dry_run``'s other arguments), and a capacity of 3/4 of its plain step's peak: there the whole batch
    does not fit, so a walk goes down the ladder and a search goes on."""
    build = counting_deep_forwards(forwards)
    step, model, optimizer = build(LAYERS)

    def run(**planning: Any) -> Any:
        return dry_run(step, lm_batch(4, 32), model=model, optimizer=optimizer, target="simulated", label="llama",
                       shallow=build, **planning)  # fmt: skip

    plain = run(capacity=2**40, plans=[Plan()])
    return run, plain.candidates[0].peak_bytes * 3 // 4


def test_a_search_cut_short_by_its_time_confirms_nothing(always_confirmed: None) -> None:
    """Tuning's search runs over several calls; a call whose search stops for time gives nothing to the guard, so
    its dry run runs no full step of the deep model (the call that completes the search confirms its answer)."""
    forwards: list[int] = []
    with FakeTensorMode():
        run, capacity = short_of_the_whole_batch(forwards)
        cut = run(capacity=capacity, search_around=Plan(), search_seconds=0.0)
        confirmed = len(forwards)
        whole = run(capacity=capacity, search_around=Plan())
    assert not cut.complete and confirmed == 1, "the plain plan's confirmation only"
    assert whole.complete and len(forwards) > confirmed


def test_a_backward_that_peaks_past_the_blocks_on_copies_and_inside_them_deep_is_composed_per_region() -> None:
    """llama-3.2-1b's tied 128k-word embedding in micro-batches of 4 x 2048, every layer streamed: on two and three
    blocks the backward peaks past the blocks (at the embedding's 1 GB gradient), on six inside them (where the inputs
    the blocks below saved are still held). One line through the copies' backward peaks was 3.6 % below the full
    step's (9 % at 16 layers); each region's line is exact."""
    from oomguard._planner.api import _quiet_transformers, _trainable, _training_config, _with_blocks

    config = _with_blocks(_training_config("llama-3.2-1b", 2048, "cuda"), LAYERS)
    plans = [
        Plan(micro_batch_size=4, precision="bf16", checkpointing="full", optimizer_offload=True,
             offload_layers=LAYERS, extras=CHUNKED),
    ]  # fmt: skip

    def make(layers: int) -> torch.nn.Module:
        with _quiet_transformers():
            return _trainable(_with_blocks(config, layers), "llama-3.2-1b", "adamw", "cuda", None, "all-linear")[0]

    batch = [("input_ids", (8, 2048)), ("labels", (8, 2048))]
    full, built = (measure(make, plans, composed, batch=batch)[0] for composed in (False, True))
    assert built.peak_bytes == full.peak_bytes


def test_activation_offload_is_composed_from_two_blocks_and_three(monkeypatch: pytest.MonkeyPatch) -> None:
    """TinyLlama with its activations offloaded: its first block keeps less on the device than any later one, so a
    one-block copy made each block after it weigh more: its composed forward peak was 116 MiB a block where the full
    steps' grows 84 (on 22 layers, 4.8 % above the full step's peak). Every phase's figure, in every region, is the
    full step's."""
    from oomguard._planner import compose as composing
    from oomguard._planner.api import _quiet_transformers, _trainable, _training_config, _with_blocks

    config = _training_config("tinyllama-1.1b", 1024, "cuda")
    plans = [
        Plan(precision="bf16", checkpointing="full", activation_offload=True, optimizer_offload="master",
             extras=CHUNKED),
    ]  # fmt: skip
    traces: list[composing.Trace] = []  # (each step's, and each composition's, in the order made)
    compose, trace = composing.compose, StepBench.trace
    monkeypatch.setattr(composing, "compose", lambda *args: traces.append(compose(*args)) or traces[-1])
    monkeypatch.setattr(StepBench, "trace", lambda self, plan: traces.append(trace(self, plan)) or traces[-1])

    def make(layers: int) -> torch.nn.Module:
        with _quiet_transformers():
            return _trainable(_with_blocks(config, layers), "tinyllama-1.1b", "adamw", "cuda", None, "all-linear")[0]

    batch = [("input_ids", (8, 1024)), ("labels", (8, 1024))]
    measure(make, plans, False, batch=batch)
    full = traces[-1]
    measure(make, plans, True, batch=batch)
    composed = dict(traces[-1].phases)
    assert composed.keys() == dict(full.phases).keys()
    for key, peak in full.phases:  # (the optimizer step's within 1 KiB: its allocations' rounding)
        assert composed[key] == pytest.approx(peak, abs=1024), key


def test_a_composed_recommendation_is_measured_in_full_only_within_its_margin_of_the_device() -> None:
    """Composed figures are the full step's (the tests above): a recommendation that leaves CLEAR of the device free
    stands as composed, with no step of the deep model; one closer to the edge is measured in full."""
    plans = [Plan(), Plan(precision="bf16", checkpointing="full")]
    exact = measure(lambda n: make_llama(layers=n, hidden=32), plans, composed=False, target="simulated")
    assert exact[0].peak_bytes > exact[1].peak_bytes * 1.02

    def planned(capacity: int) -> tuple[Any, int]:
        forwards: list[int] = []
        build = counting_deep_forwards(forwards)
        with FakeTensorMode():
            step, model, optimizer = build(LAYERS)
            report = dry_run(
                step, lm_batch(4, 32), model=model, optimizer=optimizer, capacity=capacity, target="simulated",
                label="llama", plans=plans, shallow=build,
            )  # fmt: skip
        return report, len(forwards)

    clear, deep_forwards = planned(2**40)
    assert clear.composed and not clear.confirmed and deep_forwards == 0
    assert clear.chosen == next(c for c in exact if c.plan == clear.recommended)
    close, deep_forwards = planned(int(exact[1].peak_bytes * 1.01))  # (within 3 %; the whole batch does not fit)
    assert close.composed and close.confirmed and deep_forwards >= 1
    assert close.recommended == plans[1] and close.chosen == exact[1]


def test_a_search_with_no_time_runs_one_shallow_step_a_call_and_ends_where_one_call_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tuning's search with no time at all, over as many dry runs as it takes: each dry run measures at most one
    shallow step of its own (a composed measurement stops between its steps, the gate), keeping the steps and plans
    it measured for the next; the last one recommends what a search in one dry run does, from the same figures, and
    no shallow step ran twice."""
    traced: list[tuple[Plan, int]] = []
    trace = StepBench.trace

    def counted(bench: StepBench, plan: Plan) -> Any:
        measured = trace(bench, plan)  # (a step the gate stops is not run: not counted)
        traced.append((plan, sum(1 for _ in bench.runner.model.modules())))  # (a depth's copy: its own count)
        return measured

    monkeypatch.setattr(StepBench, "trace", counted)
    with FakeTensorMode():
        run, capacity = short_of_the_whole_batch([])
        traced.clear()
        whole = run(capacity=capacity, search_around=Plan())
        once, traced[:] = list(traced), []
        known: dict[Plan, Candidate] = {}
        traces: dict[Any, Any] = {}
        runs = []
        while not runs or not runs[-1][0].complete:
            before = len(traced)
            report = run(capacity=capacity, search_around=Plan(), search_seconds=0.0, known=known, traces=traces)
            runs.append((report, len(traced) - before))
    assert whole.complete and len(runs) > 2
    assert all(new == 1 for _, new in runs[:-1]), "one shallow step a call: a measurement stops between its steps"
    last = runs[-1][0]
    assert last.recommended == whole.recommended
    figures = {(c.plan, c.peak_bytes, c.host_bytes, c.fits) for c in last.candidates}
    assert figures == {(c.plan, c.peak_bytes, c.host_bytes, c.fits) for c in whole.candidates}
    assert len(traced) == len(set(traced)) == len(once) and set(traced) == set(once)


@pytest.mark.parametrize("searched", [False, True], ids=["walk", "search"])
def test_a_refuted_composition_is_walked_again_in_full_but_not_searched_again(
    searched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the full step refutes every composed plan that fitted, a walk is run again on the deep model; tuning's
    search is not (full steps of the deep model inside a training call, where its trials on real steps drop a plan
    that does not fit): its dry run is complete, with no full step."""
    from oomguard._planner import compose, engine

    monkeypatch.setattr(engine, "confirm", lambda *args: compose.Confirmed(stands=False, measured=True))
    forwards: list[int] = []
    with FakeTensorMode():
        run, capacity = short_of_the_whole_batch(forwards)
        before = len(forwards)
        report = run(capacity=capacity, **({"search_around": Plan()} if searched else {}))
    assert report.complete and not report.composed
    assert (len(forwards) > before) is not searched, "the deep model's steps: the walk's again in full, no search's"
