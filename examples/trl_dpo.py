"""TRL's DPOTrainer, guarded: ``class GuardedDPO(OOMGuardTrainer, DPOTrainer)``, OOMGuardTrainer first.

A small Llama (random init) learns to prefer one line of the Python standard library's source over another,
after a third as the prompt (nothing is downloaded; the SFT example's byte tokenizer). DPO's collator puts every
chosen sequence of a batch first and every rejected one after them, and its loss pairs row ``i`` with row
``n + i``: the guard sees that layout and splits a batch pair by pair, so a micro-batch never pairs the wrong
rows. On a CPU it runs under a simulated 60 MiB GPU, where the batch of 8 pairs does not fit and the guard
splits it; on a GPU it runs on CUDA as it is. Needs the extras: ``pip install oomguard[trl]``.
Run: python examples/trl_dpo.py [--steps 4]
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer
from trl_sft import byte_tokenizer, stdlib_lines, tiny_llama, train

from oomguard.integrations.transformers import OOMGuardTrainer


class GuardedDPO(OOMGuardTrainer, DPOTrainer):  # type: ignore[misc]
    """DPOTrainer whose training steps survive out-of-memory errors."""


def preference_pairs(count: int = 64) -> Dataset:
    """``count`` (prompt, chosen, rejected) triples of consecutive source lines."""
    lines = stdlib_lines(3 * count)["text"]
    return Dataset.from_dict({"prompt": lines[0::3][:count], "chosen": lines[1::3][:count],
                              "rejected": lines[2::3][:count]})  # fmt: skip


def build(
    steps: int, output_dir: str, oomguard: dict[str, Any] | None = None, trainer_class: type[DPOTrainer] = GuardedDPO,
    **config: Any,
) -> DPOTrainer:  # fmt: skip
    """The trainer (``trainer_class=DPOTrainer`` for the unguarded reference); ``config``: more DPOConfig fields."""
    args = DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=8,  # pairs: the effective batch, split by oomguard only if memory requires it
        max_steps=steps,
        max_length=96,
        learning_rate=1e-3,
        optim="adamw_torch",
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **config,
    )
    model = tiny_llama()
    guarded = {} if trainer_class is DPOTrainer else {"oomguard": {"log_file": f"{output_dir}/oomguard.jsonl",
                                                                   **(oomguard or {})}}  # fmt: skip
    return trainer_class(
        model=model,
        ref_model=copy.deepcopy(model),  # the frozen reference DPO measures the policy against
        args=args,
        train_dataset=preference_pairs(),
        processing_class=byte_tokenizer(),
        **guarded,
    )


def main(steps: int = 4, output_dir: str = "trl_dpo_out", budget: str = "60MiB") -> DPOTrainer:
    trainer = build(steps, output_dir)
    train(trainer, budget, trainer.ref_model)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    main(parser.parse_args().steps)
