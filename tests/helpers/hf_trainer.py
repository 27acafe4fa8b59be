"""The Hugging Face Trainer's setup for the tests: a ragged dataset, the training arguments, a plain reference run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from helpers.models import make_llama


class RaggedText(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """32 sequences of 24 tokens, the last few of each labelled -100 (ragged padding)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 64, (32, 24), generator=generator)
        self.lengths = torch.randint(6, 25, (32,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        labels = self.ids[index].clone()
        labels[int(self.lengths[index]) :] = -100
        return {"input_ids": self.ids[index], "labels": labels}


def training_args(folder: Path, **overrides: Any) -> Any:
    import transformers

    settings: dict[str, Any] = {
        "output_dir": str(folder),
        "per_device_train_batch_size": 16,
        "max_steps": 4,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": 0,
        "learning_rate": 1e-3,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        # Plain (not fused) AdamW: its step allocates temporaries, so an OOM can strike inside it. The fused
        # kernel the Trainer picks by default allocates nothing once Adam's state exists.
        "optim": "adamw_torch",
        **overrides,
    }
    return transformers.TrainingArguments(**settings)


def train_plain(folder: Path, **overrides: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    model = make_llama(layers=2, hidden=64)
    trainer = transformers.Trainer(model=model, args=training_args(folder, **overrides), train_dataset=RaggedText())
    trainer.train()
    return model, trainer
