"""PEFT LoRA, the commonest 6 GB job: the example runs, and the guard reads a wrapped model's checkpointing
through the public API (no deprecation warning from PEFT's or torch.compile's wrapper)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from helpers.models import make_llama

peft = pytest.importorskip("peft")

from oomguard._effects.checkpointing import user_checkpointing  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "peft_lora.py"


@pytest.mark.integration
def test_the_lora_example_recovers_and_leaves_the_base_weights_alone(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("peft_lora", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    frozen = {name: p.detach().clone() for name, p in example.lora_model(torch.device("cpu")).named_parameters()}
    step = example.main(steps=3, log_file=str(tmp_path / "peft_lora.jsonl"))
    summary = step.guard.summary()
    assert summary.steps == 3 and summary.ooms >= 1 and "micro_batch" in summary.fallbacks
    trained = dict(step.guard.model.named_parameters())
    changed = [name for name, p in trained.items() if not torch.equal(p, frozen[name])]
    assert changed and all("lora_" in name for name in changed), "only the adapters trained"
    assert (tmp_path / "peft_lora.jsonl").exists()


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("wrap", ["peft", "compile"])
def test_checkpointing_of_a_wrapped_model_is_read_without_a_deprecation_warning(wrap: str) -> None:
    model = make_llama()
    wrapped = _lora(model) if wrap == "peft" else torch.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning (is_gradient_checkpointing) fails the test
        assert not user_checkpointing(wrapped)
        model.activation_checkpointing_enable()
        assert user_checkpointing(wrapped)


def test_layer_offload_streams_a_lora_models_frozen_base_layers_through_backward() -> None:
    """A block whose weights are frozen gets no gradient for them, so counting its gradients cannot tell when
    backward is done with it: released early, the base layers' backward read freed storage (a RuntimeError)."""
    from helpers.batches import lm_batch
    from helpers.steps import model_step

    from oomguard import OOMGuard, Plan
    from oomguard.testing import SimulatedGPU

    def trained(plan: Plan) -> dict[str, torch.Tensor]:
        model = _lora(make_llama(layers=2, hidden=128))
        for name, param in model.named_parameters():
            if "lora_B" in name:  # (nonzero, so that the adapters' gradients flow through both factors)
                torch.nn.init.constant_(param, 0.01)
        trainable = [p for p in model.parameters() if p.requires_grad]
        guard = OOMGuard(model_step(model), model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-3), ladder=[],
                         tune_after=None)  # fmt: skip
        guard.plan = plan
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            for seed in range(3):
                torch.manual_seed(seed)
                guard(lm_batch(2, 16))
            guard.close()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    plain, offloaded = trained(Plan()), trained(Plan(offload_layers=2))
    for name, value in plain.items():
        torch.testing.assert_close(offloaded[name], value, rtol=1e-5, atol=1e-6, msg=name)
