"""LoRA plans: how the base is loaded (``base_dtype``: fp32, bf16, fp16, or NF4 as bitsandbytes stores it), and
LoRA plans composed from shallow copies as full fine-tunes are (issue 46, items 2 and 3)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import lm_batch
from helpers.models import make_llama
from helpers.steps import train_on
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import Plan, plan
from oomguard._cli.main import main
from oomguard._planner.api import _base_dtype, _trainable
from oomguard._planner.engine import dry_run
from oomguard._planner.lora import add_lora
from oomguard._planner.nf4 import NF4Linear, nf4_bytes
from oomguard._planner.presets import load_config

LAYERS = 6  # (composed from MIN_BLOCKS = LAYERS here, as in test_compose.py)
TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
PLANS = [
    Plan(),
    Plan(micro_batch_size=2, precision="bf16"),
    Plan(checkpointing="partial"),
    Plan(checkpointing="full", activation_offload=True),
    Plan(offload_layers=3),
]


@pytest.mark.parametrize("shape", [(200, 384), (3, 7), (1000, 4096)])  # (odd, one short block, > 256 blocks)
def test_an_nf4_linear_holds_the_bytes_bitsandbytes_stores_for_the_weight(shape: tuple[int, int]) -> None:
    """The 4-bit codes, the nested statistics (8-bit absmax codes, an fp32 absmax per 256 of them, their code
    table and offset) and the NF4 code table: byte for byte a real ``Params4bit`` and its ``QuantState``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # (bitsandbytes may ask the hub for a CPU kernel as it imports)
    bnb = pytest.importorskip("bitsandbytes")
    linear = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16)
    real = bnb.nn.Linear4bit(shape[1], shape[0], bias=False, compress_statistics=True, quant_type="nf4")
    real.load_state_dict(linear.state_dict())
    weight = real.to("cpu").weight  # (quantized as it moves)
    state = weight.quant_state
    stored = [weight.data, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
    theirs = sum(t.untyped_storage().nbytes() for t in stored)
    ours = NF4Linear(linear, torch.bfloat16)
    assert sum(t.untyped_storage().nbytes() for t in [*ours.parameters(), *ours.buffers()]) == theirs
    assert nf4_bytes(shape[0] * shape[1]) == theirs


def test_the_base_dtype_is_the_one_given_else_the_configs_else_fp32_and_said_in_the_answer() -> None:
    assert _base_dtype(TINY, None, 4) == _base_dtype("llama-3.2-1b", None, 4) == "fp32"
    assert _base_dtype({**TINY, "torch_dtype": "bfloat16"}, None, 4) == "bf16"
    assert _base_dtype({**TINY, "torch_dtype": "bfloat16"}, "nf4", 4) == "nf4"
    assert _base_dtype({**TINY, "dtype": "float16"}, None, 4) == "fp16"
    assert _base_dtype({**TINY, "torch_dtype": "bfloat16"}, None, None) == "fp32"  # (a full fine-tune)
    report = plan({**TINY, "torch_dtype": "bfloat16"}, gpu_memory="1GiB", batch_size=1, seq_len=8,
                  target="simulated", lora_rank=4)  # fmt: skip
    assert report.to_dict()["model"] == report.model == "llama with LoRA (rank 4 on 42 layers, base in bf16)"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"base_dtype": "int8", "lora_rank": 4}, "base_dtype must be one of fp32, bf16, fp16, nf4, got 'int8'"),
        ({"base_dtype": "bf16"}, "give lora_rank= too"),
        ({"model": {**TINY, "torch_dtype": "float64"}, "lora_rank": 4}, "torch_dtype 'float64' is not a dtype"),
    ],
)
def test_a_base_dtype_the_planner_cannot_load_is_a_clear_error(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan(given.pop("model", TINY), gpu_memory="1GiB", batch_size=1, seq_len=8, **given)


def test_the_cli_takes_base_dtype_with_lora_rank_only_and_plans_nf4_without_bitsandbytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # (an import of it raises ImportError: not installed)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY, "torch_dtype": "bfloat16"}))
    with pytest.raises(SystemExit, match="--base-dtype says how a LoRA fine-tune's frozen base is loaded"):
        main(["plan", "--model", str(config), "--base-dtype", "nf4"])
    capsys.readouterr()
    args = ["plan", "--model", str(config), "--gpu-memory", "1GiB", "--host-memory", "1GiB", "--batch-size", "1",
            "--seq-len", "8", "--target", "simulated", "--lora-rank", "4", "--json"]  # fmt: skip
    assert main([*args, "--base-dtype", "nf4"]) == 0
    assert json.loads(capsys.readouterr().out)["model"].endswith("base in nf4)")


def test_an_nf4_base_holds_its_linear_layers_in_nf4_and_the_rest_in_bf16() -> None:
    """Against the bf16 base: each linear layer but the head is held in NF4's bytes instead of bf16's."""
    with FakeTensorMode():
        net, *_ = _trainable(load_config(TINY), "tiny", "adamw", "simulated", 4, "all-linear", "nf4")
        bf16, *_ = _trainable(load_config(TINY), "tiny", "adamw", "simulated", 4, "all-linear", "bf16")
    layers = [m for m in net.modules() if isinstance(m, NF4Linear)]
    assert len(layers) == 7 * LAYERS  # (q, k, v, o, gate, up, down: not lm_head)
    floats = [p for n, p in net.named_parameters() if not p.requires_grad and p.dtype != torch.uint8]
    assert floats and all(p.dtype == torch.bfloat16 for p in floats)  # embeddings, norms, the head
    assert all(p.dtype == torch.float32 for p in net.parameters() if p.requires_grad)  # (PEFT's adapters: fp32)
    weights = sum(m.in_features * m.out_features for m in layers)
    saved = 2 * weights - sum(nf4_bytes(m.in_features * m.out_features) for m in layers)
    assert held(bf16) - held(net) == saved


def held(net: torch.nn.Module) -> int:
    storages = {id(t.untyped_storage()): t.untyped_storage() for t in [*net.parameters(), *net.buffers()]}
    return sum(s.nbytes() for s in storages.values())


def test_a_lora_plan_over_a_bf16_base_peaks_as_a_peft_lora_on_a_bf16_model_does() -> None:
    """PEFT makes the adapters fp32 over a bf16 base (``autocast_adapter_dtype``) and casts the input to them: the
    planner's LoRA does the same, within 5 % of a PEFT LoRA job under SimulatedGPU on every plan."""
    peft = pytest.importorskip("peft")
    batches = [lm_batch(2, 64) for _ in range(2)]
    plans = [Plan(), Plan(micro_batch_size=1, precision="bf16")]
    with FakeTensorMode():
        model = bf16_llama()
        add_lora(model, 8, dropout=0.0)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        report = dry_run(lambda b: model(**b), lm_batch(2, 64), model=model, optimizer=optimizer, capacity=2**40,
                         target="simulated", label="lora", plans=plans)  # fmt: skip
    for candidate in report.candidates:
        real = peft.get_peft_model(
            bf16_llama(),
            peft.LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM", lora_dropout=0.0),
        )
        optimizer = torch.optim.AdamW([p for p in real.parameters() if p.requires_grad])
        *_, measured = train_on(real, optimizer, batches, candidate.plan)
        assert candidate.peak_bytes == pytest.approx(measured, rel=0.05), candidate.plan.describe(2)


def bf16_llama() -> torch.nn.Module:
    """A Llama built in bf16, as ``from_pretrained(..., dtype=torch.bfloat16)`` loads one."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return make_llama(layers=2, hidden=64)
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize(
    "base_dtype", [pytest.param("fp32", marks=pytest.mark.slow), pytest.param("bf16", marks=pytest.mark.slow), "nf4"]
)
def test_lora_plans_composed_from_shallow_copies_are_those_of_a_full_fake_step(
    base_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Byte for byte, over every base: a LoRA model's blocks are alike as a full fine-tune's are."""
    monkeypatch.setattr("oomguard._planner.engine.MIN_BLOCKS", LAYERS)
    config = load_config(TINY)

    def measure(composed: bool) -> list[Any]:
        with FakeTensorMode():

            def build(layers: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
                fewer = load_config({**TINY, "num_hidden_layers": layers})
                model, optimizer, _ = _trainable(fewer, "tiny", "adamw", "cuda", 8, "all-linear", base_dtype)
                return (lambda b: model(**b)), model, optimizer

            step, model, optimizer = build(config.num_hidden_layers)
            report = dry_run(step, lm_batch(4, 32), model=model, optimizer=optimizer, capacity=2**40, target="cuda",
                             label="lora", plans=PLANS, shallow=build if composed else None)  # fmt: skip
        assert report.composed == composed
        return sorted(report.candidates, key=lambda c: PLANS.index(c.plan))

    for full, built in zip(measure(False), measure(True), strict=True):
        for figure in ("peak_bytes", "host_bytes", "transfer_bytes", "fits", "phase"):
            assert getattr(built, figure) == getattr(full, figure), (base_dtype, full.plan, figure)
        assert built.predicted_seconds == pytest.approx(full.predicted_seconds, rel=1e-9), (base_dtype, full.plan)


@pytest.mark.slow  # (two plans of a six-block model: 20 s of CPU)
def test_a_composed_lora_recommendation_near_the_edge_is_measured_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within CLEAR of the device (here: always), the recommendation's composed figures give way to a full step's."""
    monkeypatch.setattr("oomguard._planner.engine.MIN_BLOCKS", LAYERS)
    monkeypatch.setattr("oomguard._planner.compose.CLEAR", 1.0)
    asked: dict[str, Any] = {"gpu_memory": "1GiB", "batch_size": 2, "seq_len": 16, "target": "simulated",
                             "lora_rank": 4, "base_dtype": "nf4"}  # fmt: skip
    fast, exact = plan(TINY, **asked), plan(TINY, **asked, exact=True)
    assert fast.composed and fast.confirmed and not exact.composed
    assert fast.recommended == exact.recommended is not None
    assert fast.chosen.peak_bytes == exact.chosen.peak_bytes and fast.chosen.host_bytes == exact.chosen.host_bytes


@pytest.mark.slow
def test_llama_3_2_1b_lora_on_a_bf16_base_is_composed_and_fits_6_gib_without_streaming() -> None:
    """Issue 46's first done-when (its wall time is in RESULTS.md)."""
    report = plan("llama-3.2-1b", gpu_memory="6GiB", host_memory="16GiB", batch_size=8, seq_len=2048,
                  lora_rank=16, base_dtype="bf16")  # fmt: skip
    answer = report.to_dict()
    assert report.fits and answer["composed"] and "base in bf16" in answer["model"]
    assert answer["plan"]["offload_layers"] == 0 and not answer["plan"]["optimizer_offload"]


@pytest.mark.slow
def test_a_llama_3_2_3b_config_lora_on_an_nf4_base_fits_6_gib_without_streaming(tmp_path: Path) -> None:
    """Issue 46's second done-when: a Llama-3.2-3B config.json, no bitsandbytes needed."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16",
    }))  # fmt: skip
    report = plan(config, gpu_memory="6GiB", host_memory="16GiB", batch_size=8, seq_len=2048, lora_rank=16,
                  base_dtype="nf4")  # fmt: skip
    assert report.fits and report.to_dict()["plan"]["offload_layers"] == 0
    assert "base in nf4" in report.model
