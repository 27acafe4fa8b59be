"""PyTorch Lightning, guarded: manual optimization, guarded_step in training_step, OOMGuardCallback on the Trainer.

A small Llama (random init, nothing downloaded) trains on the standard library's source as byte tokens. On a CPU it
runs under a simulated 4 MiB GPU, so the first batch of 16 does not fit whole: the guard catches the out-of-memory
error, plans a split into micro-batches, and the step goes on in the same training_step. With a GPU it runs on CUDA
as it is. Run: python examples/lightning_finetune.py [--steps 4]

Under torchrun (`torchrun --standalone --nproc_per_node 2 examples/lightning_finetune.py --fault backward`) Lightning
runs DDP (gloo on CPUs), each rank trains on its own 8 samples of the 16, and ``--fault`` makes the last rank run out
of memory once in the first step's backward or optimizer step: every rank retries that step on the same plan, and
the replicas stay identical (checked at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch._subclasses.fake_tensor import is_fake
from transformers import LlamaConfig, LlamaForCausalLM

from oomguard.integrations.lightning import OOMGuardCallback, guarded_step
from oomguard.testing import SimulatedGPU, stdlib_text

BATCH = 16  # the effective batch, over every rank: the guard splits it only when memory requires it


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed windows of byte tokens; labels = inputs (the model shifts them for next-token prediction)."""

    def __init__(self, length: int = 64, count: int = 256) -> None:
        self.windows = stdlib_text(max_bytes=length * count + 1)[: length * count].view(count, length)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


class LitLM(L.LightningModule):
    def __init__(self, config: LlamaConfig, lr: float = 1e-3, warmup: int = 3) -> None:
        super().__init__()
        self.automatic_optimization = False  # the guard runs backward and the optimizer step (see training_step)
        self.model = LlamaForCausalLM(config)
        self.lr, self.warmup = lr, warmup

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward only: the guard calls it on the batch, or on each micro-batch of it."""
        loss: torch.Tensor = self.model(**batch).loss  # mean over counted tokens; the guard re-weights micro-batches
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Backward, clipping, the optimizer step and the scheduler's: exactly one step, however the batch was split.
        result = guarded_step(self, batch, self.loss)
        self.log("train_loss", result.loss, prog_bar=True)  # from the result: self.loss may run more than once
        self.print(f"step {batch_idx} loss {result.loss:.3f} micro-batches {result.micro_batches} {result.rungs}")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / self.warmup))
        return [optimizer], [{"scheduler": warmup, "interval": "step"}]  # stepped by the guard, once per step


def inject_fault(module: LitLM, phase: str) -> None:
    """Make this rank run out of memory once, in ``phase`` of the first step: the error a real device raises."""
    fired = [False]

    def oom(*args: Any) -> None:
        tensors = [t for a in args for t in (a if isinstance(a, tuple) else (a,)) if isinstance(t, torch.Tensor)]
        if fired[0] or any(is_fake(t) for t in tensors):  # (the guard's planner runs the step on fake tensors)
            return
        fired[0] = True
        print(f"--fault: this rank runs out of memory in the {phase}", flush=True)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected by --fault)")

    if phase == "backward":
        module.model.get_submodule("model.norm").register_full_backward_pre_hook(oom)  # (the first one backward meets)
    else:  # (the optimizer exists from fit's start: hook it then)

        def hook_optimizer() -> None:
            module.trainer.optimizers[0].register_step_pre_hook(oom)

        module.on_fit_start = hook_optimizer  # type: ignore[method-assign]


def main(steps: int = 4, output_dir: str = "lightning_out", fault: str | None = None, save: str | None = None) -> Any:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the guard logs one line per event
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: one process per rank, Lightning's DDP
    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(  # same architecture as the big ones, small enough for a CPU
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    module = LitLM(config)
    guard = OOMGuardCallback(log_file=f"{output_dir}/oomguard.jsonl", max_grad_norm=1.0)  # any oom_guard option
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        callbacks=[guard],  # its plans go into Lightning's checkpoints; its fallbacks to the loggers (oomguard/...)
        logger=CSVLogger(output_dir),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if fault is not None and int(os.environ.get("RANK", "0")) == world - 1:  # the last rank alone, once
        inject_fault(module, fault)
    loader = torch.utils.data.DataLoader(Windows(), batch_size=BATCH // world)  # (a rank's share; DDP's sampler)
    # No GPU here? Simulate a small one, so the out-of-memory errors (and the recovery) are real.
    budget = SimulatedGPU("4MiB") if not torch.cuda.is_available() else contextlib.nullcontext()
    with budget as gpu:
        if gpu is not None:
            gpu.adopt(module)  # the weights are already resident, as after module.to("cuda")
        trainer.fit(module, loader)
    summary = guard.guard.summary() if guard.guard is not None else "no training step ran"
    print(f"[rank {trainer.global_rank}] global_step {trainer.global_step}; {summary}", flush=True)
    if save is not None and trainer.global_rank == 0:
        torch.save(module.model.state_dict(), save)
    if world > 1:  # every rank's replica of the weights, compared
        checksum = torch.stack([p.detach().double().sum() for p in module.parameters()])
        sums = trainer.strategy.all_gather(checksum)
        if trainer.global_rank == 0:
            print(f"replicas identical: {bool((sums == sums[0]).all())}", flush=True)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fault", choices=["backward", "optimizer"], help="the last rank runs out of memory once")
    parser.add_argument("--save", help="where rank 0 saves the trained weights")
    parser.add_argument("--output-dir", default="lightning_out", help="the guard's log and the CSV logger's files")
    arguments = parser.parse_args()
    main(arguments.steps, arguments.output_dir, fault=arguments.fault, save=arguments.save)
