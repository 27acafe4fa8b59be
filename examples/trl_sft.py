"""TRL's SFTTrainer, guarded: ``class GuardedSFT(OOMGuardTrainer, SFTTrainer)``, OOMGuardTrainer first.

A small Llama (random init) is fine-tuned on lines of the Python standard library's source, held in an in-memory
``datasets.Dataset`` and tokenized as bytes (nothing is downloaded). On a CPU it runs under a simulated 16 MiB
GPU, so the batch of 16 does not fit and the guard splits it; on a GPU it runs on CUDA as it is. SFTTrainer's
own work still runs (its tokenization, its loss, its metrics); the metrics count each batch once, however many
attempts it took. Needs the extras: ``pip install oomguard[trl]``.
Run: python examples/trl_sft.py [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from oomguard.integrations.transformers import OOMGuardTrainer
from oomguard.testing import SimulatedGPU, stdlib_text


class GuardedSFT(OOMGuardTrainer, SFTTrainer):  # type: ignore[misc]
    """SFTTrainer whose training steps survive out-of-memory errors."""


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (Latin-1), plus padding and end of sequence: a tokenizer built here, offline."""
    vocab = {"<pad>": 0, "<eos>": 1, **{chr(b): b + 2 for b in range(256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def stdlib_lines(count: int = 96, length: int = 48) -> Dataset:
    """``count`` non-empty lines of the standard library's source, at most ``length`` characters each."""
    text = bytes(stdlib_text(max_bytes=count * 200).tolist()).decode("latin-1")
    lines = [line.strip()[:length] for line in text.splitlines() if len(line.strip()) > 8]
    return Dataset.from_dict({"text": lines[:count]})


def tiny_llama(positions: int = 128) -> LlamaForCausalLM:
    """A small Llama over the byte tokenizer's 258 tokens, random weights from seed 0 (the same every call)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=positions, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def build(
    steps: int, output_dir: str, oomguard: dict[str, Any] | None = None, trainer_class: type[GuardedSFT] = GuardedSFT
) -> GuardedSFT:
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=16,  # the effective batch: oomguard splits it only if memory requires it
        max_steps=steps,
        max_length=64,
        learning_rate=1e-3,
        optim="adamw_torch",
        bf16=False,  # (TRL turns bf16 on where the device has it: fp32 keeps this CPU example quick and exact)
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    return trainer_class(
        model=tiny_llama(positions=64),
        args=args,
        train_dataset=stdlib_lines(),
        processing_class=byte_tokenizer(),
        oomguard={"log_file": f"{output_dir}/oomguard.jsonl", **(oomguard or {})},
    )


def train(trainer: Any, budget: str, *resident: torch.nn.Module) -> None:
    """``trainer.train()``: on CUDA as it is; with no GPU, under a simulated one of ``budget``, so that the
    out-of-memory errors (and the recovery) are real. ``resident``: more models on the device (a reference model)."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    simulated = SimulatedGPU(budget) if not torch.cuda.is_available() else contextlib.nullcontext()
    with simulated as gpu:
        if gpu is not None:
            for model in (trainer.model, *resident):  # already on the device, as after model.to("cuda")
                gpu.adopt(model)
        trainer.train()
    print(trainer.oomguard.summary())


def main(steps: int = 6, output_dir: str = "trl_sft_out", budget: str = "16MiB") -> GuardedSFT:
    trainer = build(steps, output_dir)
    train(trainer, budget)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    main(parser.parse_args().steps)
