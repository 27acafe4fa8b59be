"""QLoRA (PEFT's adapters on a bitsandbytes NF4 base model) under the guard, on the CPU: an OOM recovered equals the
unguarded run; every rung that applies is exact on it and leaves the 4-bit weights and their quantization state as
they were (never moved with ``Params4bit.to``); what does not apply is said once; the planner plans it (preplan, the
jump) within 5 % of SimulatedGPU's peaks, and a PEFT LoRA's too; no test reaches the network."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.batches import lm_batch
from helpers.steps import model_step

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from helpers.qlora import four_bit, lora, qlora  # noqa: E402

from oomguard import OOMGuard, Plan  # noqa: E402
from oomguard._planner.fakes import preplan  # noqa: E402
from oomguard.testing import SimulatedGPU  # noqa: E402

#: The ladder without amp: every rung on it is exact (up to float summation order), so a recovered run can be held
#: to the unguarded one.
EXACT_LADDER = ["chunked_loss", "micro_batch", "checkpointing", "activation_offload", "optimizer_offload",
                "layer_offload"]  # fmt: skip
BATCH = (8, 32)  # samples, tokens
STEPS = 3


def adapters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def unguarded(model: torch.nn.Module, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The user's own loop: AdamW over the adapters, the whole batch each step. Its losses and adapters."""
    optimizer = torch.optim.AdamW(adapters(model), lr=1e-2)
    losses = []
    for seed in range(steps):
        torch.manual_seed(seed)
        loss = model(**lm_batch(*BATCH)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, trained(model)


def trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def guarded(
    model: torch.nn.Module,
    budget: int | str,
    steps: int = STEPS,
    plan: Plan | None = None,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    **options: Any,
) -> tuple[OOMGuard, list[Any], int]:
    """``model`` trained as :func:`unguarded` does (with ``optimizer``), under the guard on a SimulatedGPU of
    ``budget``, host steps exact: the guard, each step's result and the last step's peak."""
    guard = OOMGuard(model_step(model), model=model, optimizer=optimizer(adapters(model), lr=1e-2),
                     host_step="exact", tune_after=None, **options)  # fmt: skip
    if plan is not None:
        guard.plan = plan
    results = []
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        for seed in range(steps):
            torch.manual_seed(seed)
            gpu.reset_peak_memory_stats()
            results.append(guard(lm_batch(*BATCH)))
        peak = gpu.max_memory_allocated()
        guard.close()
    return guard, results, peak


def assert_untouched(before: dict[str, tuple[Any, list[torch.Tensor]]], model: torch.nn.Module) -> None:
    """Every 4-bit weight is the same object, its packed codes and quantization state the same bits, its layer's."""
    after = four_bit(model)
    assert before and after.keys() == before.keys()
    for name, (param, tensors) in before.items():
        now, values = after[name]
        assert now is param and type(now) is bnb.nn.Params4bit, name
        assert now.module is not None and now.module.weight is now, f"{name}: still its layer's"
        assert len(values) == len(tensors), name
        assert all(torch.equal(a, b) for a, b in zip(values, tensors, strict=True)), name


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[str]]:
    """Once called (after the models are loaded, which quantizes through it): ``Params4bit.to``, ``.cpu()`` and
    ``.cuda()``, which move the shared quantization state in place, recorded and refused."""
    calls: list[str] = []

    def refused(name: str) -> Callable[..., Any]:
        def move(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"Params4bit.{name}() called")

        return move

    def watch() -> list[str]:
        for name in ("to", "cpu", "cuda"):
            monkeypatch.setattr(bnb.nn.Params4bit, name, refused(name))
        return calls

    return watch


# -- the done-when: an OOM recovered equals the unguarded QLoRA ---------------------------------------------------


#: The rungs that change no float operation of the step: a run recovered down them is the unguarded run, bit for bit.
SAME_BITS = ["checkpointing", "activation_offload", "optimizer_offload", "layer_offload"]


@pytest.mark.parametrize("build", [qlora, lora], ids=["qlora", "peft-lora"])
def test_an_oom_recovered_in_one_jump_equals_the_unguarded_run(build: Callable[[], Any]) -> None:
    """Under 60 % of its plain peak the first step runs out of memory, the jump plans on fake tensors (the 4-bit
    weights' stand-ins included) and the plan it lands on fits: one OOM, then the unguarded run's losses and adapters,
    bit for bit. Before: the QLoRA's dry run failed (bitsandbytes cannot make a Params4bit of a fake tensor) and the
    guard walked the ladder an OOM at a time."""
    expected, weights = unguarded(build())
    _, _, plain = guarded(build(), "1GiB", steps=1, ladder=[])
    model = build()
    untouched = four_bit(model)
    _, results, _ = guarded(model, int(0.6 * plain), ladder=SAME_BITS)
    assert results[0].ooms == 1 and all(r.ooms == 0 for r in results[1:]), [r.ooms for r in results]
    assert results[0].plan != Plan()
    assert [r.loss for r in results] == expected
    assert all(torch.equal(value, weights[name]) for name, value in trained(model).items())
    if build is qlora:
        assert_untouched(untouched, model)


def test_an_oom_recovered_down_the_exact_ladder_equals_the_unguarded_run_up_to_summation_order() -> None:
    """Where the plan splits the batch or the loss, the sums run in another order (the 4-bit layers' bf16 products
    round them apart, and Adam's first steps divide a small gradient by its own size: the adapters differ by up to 3 %
    of their largest entry after 3 steps): the losses are the unguarded run's within 1e-5, and the adapters a run's on
    the recovered plan from the start, bit for bit."""
    expected, _ = unguarded(qlora())
    _, _, plain = guarded(qlora(), "1GiB", steps=1, ladder=[])
    model = qlora()
    _, results, _ = guarded(model, int(0.6 * plain), ladder=EXACT_LADDER)
    assert results[0].ooms == 1 and all(r.ooms == 0 for r in results[1:]), [r.ooms for r in results]
    assert [r.loss for r in results] == pytest.approx(expected, rel=1e-5)
    settled = qlora()
    guarded(settled, "1GiB", plan=results[0].plan, ladder=[])
    assert all(torch.equal(value, trained(settled)[name]) for name, value in trained(model).items())


# -- rung by rung -------------------------------------------------------------------------------------------------

EXACT_PLANS = {
    "micro-batches": Plan(micro_batch_size=3),
    "chunked loss": Plan().with_level("chunked_loss", 1),
    "checkpointing": Plan(checkpointing="full"),
    "activation offload": Plan(activation_offload=True),
    "optimizer offload": Plan(optimizer_offload=True),
    "layer offload": Plan(offload_layers=2),
    "every exact rung": Plan(micro_batch_size=3, checkpointing="full", activation_offload=True,
                             optimizer_offload=True, offload_layers=2).with_level("chunked_loss", 1),
}  # fmt: skip


@pytest.mark.parametrize("name", EXACT_PLANS)
def test_every_exact_rung_on_a_qlora_equals_its_plain_step_and_never_moves_a_4bit_weight(
    name: str, moves: Callable[[], list[str]]
) -> None:
    """Each model freshly loaded, its norms and embeddings mapped from the file (before: layer offload raised
    "Trying to resize storage that is not resizable" as it emptied their storages). A plan that splits the batch or
    the loss sums in another order: it is held to the plain step within rounding, under SGD (AdamW's first steps
    divide each gradient by its own size: the 4-bit layers' bf16 rounding then moved adapters by up to 3 % of their
    largest entry, where SGD's moved them by at most 3.4e-7)."""
    plain, model = qlora(), qlora()
    untouched = four_bit(model)
    moved = moves()
    split = EXACT_PLANS[name].micro_batch_size or EXACT_PLANS[name].level("chunked_loss")
    optimizer = torch.optim.SGD if split else torch.optim.AdamW
    _, plain_results, _ = guarded(plain, "1GiB", steps=2, ladder=[], optimizer=optimizer)
    _, results, _ = guarded(model, "1GiB", steps=2, plan=EXACT_PLANS[name], ladder=[], optimizer=optimizer)
    assert results[-1].plan == EXACT_PLANS[name]
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if split else {"rtol": 0.0, "atol": 0.0}  # (summation order)
    assert [r.loss for r in results] == pytest.approx([r.loss for r in plain_results], rel=tolerance["rtol"])
    reference = trained(plain)
    for key, value in trained(model).items():
        torch.testing.assert_close(value, reference[key], **tolerance, msg=key)
    assert_untouched(untouched, model)
    assert moved == []


def test_checkpointing_a_peft_model_is_undone_on_the_transformers_model_inside() -> None:
    """transformers keeps the hook that makes the embeddings' output require grad on the model whose method enabled
    checkpointing: through PEFT's wrapper, the Llama inside. Before, undo looked for it on the wrapper and left it:
    after close() the embeddings' output still required grad (one more activation kept, one more gradient made)."""
    model = lora()
    embeddings = model.get_input_embeddings()
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert not embeddings(ids).requires_grad
    _, results, _ = guarded(model, "1GiB", steps=1, plan=Plan(checkpointing="full"), ladder=[])  # (closed after)
    assert results[0].rungs == ("checkpointing",)
    assert not embeddings(ids).requires_grad


def test_amp_on_a_qlora_casts_no_4bit_weight_and_a_4bit_layer_computes_in_its_compute_dtype() -> None:
    """QLoRA's bf16 compute dtype: a 4-bit layer's product is the same bits with and without amp (its input the
    same: the first block's query projection), and no parameter changes its dtype, 4-bit codes stored in bf16
    included (as the bf16 frozen base of amp would cast a frozen bf16 linear weight)."""
    outputs: dict[str, torch.Tensor] = {}
    models = {}
    for precision in (None, "bf16"):
        model = models[precision] = qlora(quant_storage=torch.bfloat16)
        layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        assert type(layer) is bnb.nn.Linear4bit and layer.compute_dtype == torch.bfloat16
        layer.register_forward_hook(lambda m, a, out, p=precision: outputs.setdefault(str(p), out.detach().clone()))
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        untouched = four_bit(model)
        _, results, _ = guarded(model, "1GiB", steps=1, plan=Plan(precision=precision), ladder=[])
        assert results[0].rungs == (("amp",) if precision else ())
        assert {name: p.dtype for name, p in model.named_parameters()} == dtypes
        assert layer.compute_dtype == torch.bfloat16
        assert_untouched(untouched, model)
    assert torch.equal(outputs["None"], outputs["bf16"])


def test_quantized_weights_leaves_bitsandbytes_4bit_weights_as_they_are() -> None:
    """Codes stored in bf16 are floating point: before, the rung took them for frozen linear weights and quantized
    bitsandbytes' packed codes again. Now it quantizes the frozen head alone, and gives it back."""
    model = qlora(quant_storage=torch.bfloat16)
    untouched = four_bit(model)
    head = model.base_model.model.lm_head.weight
    original = head.detach().clone()
    guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(adapters(model), lr=1e-2),
                     ladder=[], tune_after=None)  # fmt: skip
    guard.plan = Plan(quantized_weights="4bit")
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        result = guard(lm_batch(*BATCH))
        assert type(model.base_model.model.lm_head.weight).__name__ == "QuantizedWeight", "the frozen head is"
        guard.close()
    assert result.rungs == ("quantized_weights",) and torch.isfinite(torch.tensor(result.loss))
    assert torch.equal(model.base_model.model.lm_head.weight, original)
    assert_untouched(untouched, model)


def test_what_the_rungs_do_with_4bit_weights_is_said_once_per_model(caplog: pytest.LogCaptureFixture) -> None:
    model, tied = qlora(), qlora(tied=True)
    with caplog.at_level(logging.INFO, logger="oomguard"):
        for _ in range(2):  # (a second guard on the same model, the first closed)
            guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(adapters(model)),
                             ladder=["micro_batch", "amp", "layer_offload", "quantized_weights"])  # fmt: skip
            guard.close()
        OOMGuard(model_step(tied), model=tied, optimizer=torch.optim.AdamW(adapters(tied)),
                 ladder=["quantized_weights"]).close()  # fmt: skip
        plain = lora()
        OOMGuard(model_step(plain), model=plain, optimizer=torch.optim.AdamW(adapters(plain))).close()
    told = [r.getMessage() for r in caplog.records if "bitsandbytes 4-bit" in r.getMessage()]
    assert len(told) == 2, told  # once for each 4-bit model, never for the fp32 one
    assert "14 bitsandbytes 4-bit weight(s)" in told[0]
    assert "amp runs the forward under autocast and casts none of them" in told[0]
    assert "quantized_weights leaves them as they are and quantizes the other frozen linear weights" in told[0]
    assert "layer_offload streams their packed codes; their quantization state stays on the device" in told[0]
    assert "quantized_weights does not apply: they are 4-bit already and no other linear weight is frozen" in told[1]
    assert "amp" not in told[1] and "layer_offload" not in told[1]


# -- what is counted, and what the planner predicts ---------------------------------------------------------------


def test_simulated_gpu_counts_the_quantization_state_of_4bit_weights_as_resident() -> None:
    """It is on the device beside the codes, held by no parameter or buffer (before: left out of the peaks)."""
    from oomguard._bitsandbytes import quant_state_tensors

    model = qlora()
    tensors = [*model.parameters(), *model.buffers()]
    states = [t for p in model.parameters() for t in quant_state_tensors(p)]
    assert len(states) == 14 * 5, "absmax, code and offset, and the nested absmax and code, of each 4-bit weight"
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors + states}
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        assert gpu.memory_allocated() == sum(-(-n // 512) * 512 for n in storages.values())


PLANNED = [
    Plan(),
    Plan(micro_batch_size=4),
    Plan(precision="bf16"),
    Plan(checkpointing="full"),
    Plan(activation_offload=True),
    Plan(optimizer_offload=True),
    Plan(offload_layers=2),
]


@pytest.mark.parametrize("build", [qlora, lora], ids=["qlora", "peft-lora"])
def test_the_planners_peaks_are_within_5_percent_of_simulated_gpus(build: Callable[[], Any]) -> None:
    """The guard's own dry run (the model's parameters swapped for fakes, the 4-bit weights for stand-ins of the same
    bytes) against a real step's peak on each plan, with Adam's state resident (the second step)."""
    measured = [guarded(build(), "1GiB", steps=2, plan=plan, ladder=[])[2] for plan in PLANNED]
    model = build()
    untouched = four_bit(model)
    guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(adapters(model), lr=1e-2),
                     ladder=[], tune_after=None)  # fmt: skip
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(lm_batch(*BATCH))  # (Adam's state made, as the steps measured have it)
        report = preplan(model_step(model), lm_batch(*BATCH), guard.options, gpu, bf16=True, plans=PLANNED)
    assert report is not None, "planned"
    for plan, real, candidate in zip(PLANNED, measured, report.candidates, strict=True):
        fake = candidate.peak_bytes
        assert abs(fake - real) <= 0.05 * real, f"{plan.describe(BATCH[0])}: predicted {fake}, measured {real}"
    if build is qlora:
        assert_untouched(untouched, model)


@pytest.mark.parametrize("build", [qlora, lora], ids=["qlora", "peft-lora"])
def test_preplan_starts_a_qlora_and_a_lora_on_a_plan_that_fits(build: Callable[[], Any]) -> None:
    """The planner plans the model before its first step (its 4-bit weights faked by stand-ins): no OOM at 60 % of
    the plain peak; the losses the unguarded run's within 1e-5, the adapters a run's on that plan from the start, bit
    for bit (summation order: see the exact ladder's test above)."""
    expected, _ = unguarded(build())
    _, _, plain = guarded(build(), "1GiB", steps=1, ladder=[])
    model = build()
    _, results, peak = guarded(model, int(0.6 * plain), ladder=EXACT_LADDER, preplan=True)
    assert all(r.ooms == 0 for r in results) and results[0].plan != Plan(), [r.plan for r in results]
    assert len({r.plan for r in results}) == 1, [r.plan for r in results]
    assert peak <= 0.6 * plain
    assert [r.loss for r in results] == pytest.approx(expected, rel=1e-5)
    settled = build()
    guarded(settled, "1GiB", plan=results[-1].plan, ladder=[])
    assert all(torch.equal(value, trained(settled)[name]) for name, value in trained(model).items())


# -- the network ----------------------------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_the_kernel_bitsandbytes_fetches_as_it_is_imported_is_never_asked_of_the_network() -> None:
    """On a CPU with AVX-512 bf16, importing bitsandbytes asks ``kernels`` for a kernel on the Hugging Face hub (not
    on this machine's CPU: the call itself is made here). With the hub offline (tests/conftest.py) no connection is
    tried; without it, two to huggingface.co (and 11 s of retries)."""
    pytest.importorskip("kernels")  # (what bitsandbytes fetches with: without it, nothing is fetched)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    code = """
        import socket
        tried = []
        def refuse(*args, **kwargs):
            tried.append(args[:2])
            raise OSError("the test allows no network")
        socket.getaddrinfo = refuse
        socket.socket.connect = refuse
        from kernels import get_kernel
        try:
            get_kernel("kernels-community/quantization-bitsandbytes", version=1)
        except Exception as error:
            print("not loaded:", type(error).__name__)
        print("connections tried:", len(tried))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "connections tried: 0" in done.stdout, done.stdout
