"""LoRA fine-tuning of a causal LM with PEFT, guarded: the commonest job on a 6 GB GPU.

A small Llama (random init, nothing downloaded) gets LoRA adapters on its attention and MLP projections; only
the adapters train, the base weights stay frozen. It trains on the Python standard library's source as byte
tokens. On a CPU it runs under a simulated 20 MiB GPU, so the batch does not fit; with a GPU it runs on CUDA as
it is. The guard needs nothing PEFT-specific: the PeftModel is the model, the optimizer holds the adapters.
Needs the extra: ``pip install oomguard[peft]``. Run: python examples/peft_lora.py [--steps 8]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from oomguard import oom_guard
from oomguard.testing import SimulatedGPU, stdlib_text, text_batches


def lora_model(device: torch.device) -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(  # a tiny Llama: same architecture as the big ones, small enough for a CPU
        vocab_size=256, hidden_size=128, intermediate_size=336, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    base = LlamaForCausalLM(config).to(device)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=projections)
    return get_peft_model(base, adapters)


def main(steps: int = 8, log_file: str = "peft_lora.jsonl", budget: str = "20MiB") -> Any:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = lora_model(device)
    model.print_trainable_parameters()
    trainable = [p for p in model.parameters() if p.requires_grad]  # the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    batches = text_batches(stdlib_text(), batch_size=16, seq_len=128)

    @oom_guard(model=model, optimizer=optimizer, max_grad_norm=1.0, log_file=log_file)
    def train_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss: torch.Tensor = model(**batch).loss
        return loss

    # No GPU here? Simulate a small one, so the out-of-memory errors (and the recovery) are real.
    simulated = SimulatedGPU(budget) if device.type == "cpu" else contextlib.nullcontext()
    with simulated as gpu:
        if gpu is not None:
            gpu.adopt(model)  # the weights are already resident, as after model.to("cuda")
        for _ in range(steps):
            result = train_step(next(batches))
            print(f"step {result.step:3d} loss {result.loss:.3f} micro-batch {result.micro_batch_size} {result.rungs}")
    print(train_step.guard.summary())
    return train_step


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    main(parser.parse_args().steps)
