"""The Hugging Face Trainer, guarded: OOMGuardTrainer is a drop-in subclass of Trainer.

A small Llama (random init) trains on the standard library's source as byte tokens. On a CPU it runs under a
simulated 4 MiB GPU, so the batch of 16 really does not fit; on a GPU it runs on CUDA as it is.
Run: python examples/hf_trainer.py [--steps 6]

Under torchrun (`torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --fault backward`) the Trainer
wraps the model in DDP through Accelerate (NCCL on GPUs, gloo on CPUs), each rank trains on its own 16 samples, and
the guard agrees with the other ranks in every part of a step: its forward and backward, the Trainer's clipping
and its optimizer step. ``--fault`` makes the last rank run out of memory once, in the forward, backward or
optimizer step of the first step: every rank retries that step on the same plan, ``global_step`` stays the same on
every rank, and the replicas stay identical (checked at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
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


def inject_fault(model: torch.nn.Module, optimizer: torch.optim.Optimizer, phase: str) -> None:
    """Make this rank run out of memory once, in ``phase`` of the first step: the error a real device raises."""
    fired = [False]

    def oom(*args: Any) -> None:
        tensors = [
            t for arg in args for t in (arg if isinstance(arg, tuple) else (arg,)) if isinstance(t, torch.Tensor)
        ]
        if any(is_fake(t) for t in tensors):  # (the guard's dry-run planner runs the step on fake tensors: no device)
            return
        if not fired[0]:
            fired[0] = True
            print(f"--fault: this rank runs out of memory in the {phase}", flush=True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected by --fault)")

    if phase == "forward":
        model.register_forward_pre_hook(oom)
    elif phase == "backward":
        norm: torch.nn.Module = model.get_submodule("model.norm")  # (the first module backward reaches)
        norm.register_full_backward_pre_hook(oom)
    else:
        optimizer.register_step_pre_hook(oom)  # (Adam's first step is journaled: the guard undoes it)


def main(steps: int = 6, output_dir: str = "hf_trainer_out", fault: str | None = None) -> OOMGuardTrainer:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(  # same architecture as the big ones, small enough for a CPU
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=16,  # the effective batch: oomguard splits it only if memory requires it
        max_steps=steps,
        use_cpu=not torch.cuda.is_available(),  # (under torchrun on CPUs: DDP over gloo)
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = OOMGuardTrainer(
        model=model,
        args=args,
        train_dataset=Windows(),
        optimizers=(optimizer, None),  # (the Trainer makes the learning-rate schedule)
        oomguard={"log_file": f"{output_dir}/oomguard.jsonl"},  # any oom_guard option except the Trainer's own
    )
    if fault is not None and args.process_index == args.world_size - 1:  # the last rank alone, once
        inject_fault(model, optimizer, fault)
    # No GPU here? Simulate a small one, so the out-of-memory errors (and the recovery) are real.
    budget = SimulatedGPU("4MiB") if not torch.cuda.is_available() else contextlib.nullcontext()
    with budget as gpu:
        if gpu is not None:
            gpu.adopt(model)  # the weights are already resident, as after model.to("cuda")
        trainer.train()  # global_step, the optimizer and the scheduler never notice a retry
    rank = args.process_index
    print(f"[rank {rank}] global_step {trainer.state.global_step}; {trainer.oomguard.summary()}", flush=True)
    if args.world_size > 1:  # every rank's replica of the weights, compared
        checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).reshape(1, -1)
        sums = trainer.accelerator.gather(checksum.to(args.device))
        if rank == 0:
            print(f"replicas identical: {bool((sums == sums[0]).all())}", flush=True)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fault", choices=["forward", "backward", "optimizer"], help="the last rank runs out once")
    arguments = parser.parse_args()
    main(arguments.steps, fault=arguments.fault)
