"""TRL's GRPOTrainer, guarded: ``class GuardedGRPO(OOMGuardTrainer, GRPOTrainer)``, OOMGuardTrainer first.

A small Llama (random init) completes lines of the Python standard library's source and is rewarded for the
share of vowels in its completions (nothing is downloaded; the SFT example's byte tokenizer). GRPOTrainer
generates and scores the completions in ``_prepare_inputs``, before the guarded forward and backward; the guard
keeps what that recorded (rewards) when an attempt fails, never generates again for a retry, and weighs
micro-batches as the loss type needs. On a CPU it runs under a simulated 20 MiB GPU, where the 8 completions of
a step do not fit at once; on a GPU it runs on CUDA as it is. Needs the extras: ``pip install oomguard[trl]``.
Run: python examples/trl_grpo.py [--steps 3]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl_sft import byte_tokenizer, stdlib_lines, tiny_llama, train

from oomguard.integrations.transformers import OOMGuardTrainer


class GuardedGRPO(OOMGuardTrainer, GRPOTrainer):  # type: ignore[misc]
    """GRPOTrainer whose training steps survive out-of-memory errors."""


def vowels(completions: list[str], **_: Any) -> list[float]:
    """The reward: the share of vowels in each completion."""
    return [sum(c in "aeiou" for c in text) / max(1, len(text)) for text in completions]


def build(
    steps: int, output_dir: str, oomguard: dict[str, Any] | None = None, trainer_class: type[GRPOTrainer] = GuardedGRPO,
    **config: Any,
) -> GRPOTrainer:  # fmt: skip
    """The trainer (``trainer_class=GRPOTrainer`` for the unguarded reference); ``config``: more GRPOConfig fields."""
    settings: dict[str, Any] = {
        "per_device_train_batch_size": 8,  # completions: the effective batch, split only if memory requires it
        "num_generations": 4,
        "max_completion_length": 16,
        "learning_rate": 1e-2,
        "optim": "sgd",  # (plain SGD: a gradient scaled wrongly shows in the weights)
        "beta": 0.0,
        "bf16": False,
        "use_cpu": not torch.cuda.is_available(),
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
    }
    args = GRPOConfig(output_dir=output_dir, max_steps=steps, **{**settings, **config})
    guarded = {} if trainer_class is GRPOTrainer else {"oomguard": {"log_file": f"{output_dir}/oomguard.jsonl",
                                                                    **(oomguard or {})}}  # fmt: skip
    return trainer_class(
        model=tiny_llama(),
        reward_funcs=vowels,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": stdlib_lines(64)["text"]}),
        processing_class=byte_tokenizer(),
        **guarded,
    )


def main(steps: int = 3, output_dir: str = "trl_grpo_out", budget: str = "20MiB") -> GRPOTrainer:
    trainer = build(steps, output_dir)
    train(trainer, budget)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    main(parser.parse_args().steps)
