"""The Hugging Face Trainer, guarded: OOMGuardTrainer is a drop-in subclass of Trainer.

A small Llama (random init) trains on the standard library's source as byte tokens. On a CPU it runs under a
simulated 4 MiB GPU, so the batch of 16 really does not fit; on a GPU it runs on CUDA as it is.
Run: python examples/hf_trainer.py [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from oomguard.integrations.transformers import OOMGuardTrainer
from oomguard.testing import SimulatedGPU, stdlib_text


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed windows of byte tokens; labels = inputs (the model shifts them for next-token prediction)."""

    def __init__(self, length: int = 64, count: int = 256) -> None:
        text = stdlib_text(max_bytes=length * count + 1)
        self.windows = text[: length * count].view(count, length)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


def main(steps: int = 6, output_dir: str = "hf_trainer_out") -> OOMGuardTrainer:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    config = LlamaConfig(  # same architecture as the big ones, small enough for a CPU
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=16,  # the effective batch: oomguard splits it only if memory requires it
        max_steps=steps,
        learning_rate=1e-3,
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = OOMGuardTrainer(
        model=model,
        args=args,
        train_dataset=Windows(),
        oomguard={"log_file": f"{output_dir}/oomguard.jsonl"},  # any oom_guard option except the Trainer's own
    )
    # No GPU here? Simulate a small one, so the out-of-memory errors (and the recovery) are real.
    budget = SimulatedGPU("4MiB") if not torch.cuda.is_available() else contextlib.nullcontext()
    with budget as gpu:
        if gpu is not None:
            gpu.adopt(model)  # the weights are already resident, as after model.to("cuda")
        trainer.train()  # global_step, the optimizer and the scheduler never notice a retry
    print(trainer.oomguard.summary())
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    main(parser.parse_args().steps)
