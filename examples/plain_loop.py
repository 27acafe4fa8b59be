"""A plain PyTorch training loop guarded by oomguard.

Trains a small Llama (random init, nothing downloaded) on the Python standard library's source as byte
tokens. On a CPU it runs under a simulated 64 MiB GPU so the batch really does not fit; with a GPU it runs on
CUDA as it is. Run: python examples/plain_loop.py [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oomguard import oom_guard
from oomguard.testing import SimulatedGPU, stdlib_text, text_batches


def main(steps: int = 20) -> float:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the guard logs one line per event
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig(  # a tiny Llama: same architecture as the big ones, small enough for a CPU
        vocab_size=256, hidden_size=128, intermediate_size=336, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = text_batches(stdlib_text(), batch_size=16, seq_len=256)  # the loader yields the full batch

    # The guard owns backward, accumulation, clipping, the step and zero_grad: the function is forward only.
    @oom_guard(model=model, optimizer=optimizer, max_grad_norm=1.0, log_file="plain_loop.jsonl")
    def train_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss: torch.Tensor = model(**batch).loss  # mean over counted tokens; the guard re-weights micro-batches
        return loss

    # No GPU here? Simulate a small one, so the out-of-memory errors (and the recovery) are real.
    budget = SimulatedGPU("64MiB") if device.type == "cpu" else contextlib.nullcontext()
    with budget as gpu:
        if gpu is not None:
            gpu.adopt(model)  # the weights are already resident, as after model.to("cuda")
        for _ in range(steps):
            result = train_step(next(batches))  # one optimizer step per call, however the batch was split
            print(f"step {result.step:3d} loss {result.loss:.3f} micro-batch {result.micro_batch_size} {result.rungs}")
    print(train_step.guard.summary())
    return result.loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
