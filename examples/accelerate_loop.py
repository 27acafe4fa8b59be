"""A Hugging Face Accelerate loop, guarded: pass accelerator= and the prepared model and optimizer.

Run: python examples/accelerate_loop.py, or on several processes (GPUs, or CPUs over gloo):
`torchrun --standalone --nproc_per_node 2 examples/accelerate_loop.py --fault forward` (or `accelerate launch`).
On a CPU each process runs under a simulated GPU small enough that the batch does not fit whole. Under several
processes Accelerate wraps the model in DDP and the guard agrees with the other ranks at every step: an OOM on one
rank (``--fault`` makes the last rank run out of memory once in the forward, backward or optimizer step of the
first step) moves every rank to the same plan before they retry the same batch, and the replicas stay identical
(checked at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import torch
from accelerate import Accelerator

from oomguard import oom_guard
from oomguard.testing import SimulatedGPU

GLOBAL_BATCH = 128  # split over the processes: each trains on its share, DDP averages their gradients


def injected_oom(*_: Any) -> None:
    """What --fault raises: the error a real device raises when it runs out of memory."""
    print("--fault: this rank runs out of memory", flush=True)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected by --fault)")


def main(steps: int = 5, fault: str | None = None, save: str | None = None) -> float:
    # Under torchrun: one process per rank, DDP over NCCL on GPUs, or over gloo on CPUs (cpu=True says so to Accelerate)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    faulty = fault is not None and rank == world - 1  # the last rank alone runs out of memory, once
    fired = [False]

    # Backward and clipping go through the accelerator (its loss scaling and mixed precision included).
    @oom_guard(model=model, optimizer=optimizer, accelerator=accelerator, max_grad_norm=1.0)
    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        if faulty and fault == "backward" and not fired[0]:
            fired[0] = True
            loss.register_hook(injected_oom)  # type: ignore[no-untyped-call]  # (raised inside this rank's backward)
        return loss

    def arm(phase: str) -> Any:
        def hook(*_: Any) -> None:
            if faulty and fault == phase and not fired[0]:
                fired[0] = True
                injected_oom()

        return hook

    accelerator.unwrap_model(model).register_forward_pre_hook(arm("forward"))
    optimizer.optimizer.register_step_pre_hook(arm("optimizer"))  # (Adam's first step is journaled: undone)

    generator = torch.Generator().manual_seed(1)  # the same global batches on every rank
    on_cpu = accelerator.device.type == "cpu"
    with SimulatedGPU("256KiB") if on_cpu else contextlib.nullcontext() as gpu:
        if gpu is not None:
            gpu.adopt(model)
        for _ in range(steps):
            x, y = torch.randn(GLOBAL_BATCH, 16, generator=generator), torch.randn(GLOBAL_BATCH, generator=generator)
            mine = (x[rank::world].to(accelerator.device), y[rank::world].to(accelerator.device))  # this rank's share
            result = train_step(mine)
            print(f"[rank {rank}] step {result.step}: loss {result.loss:.4f}, {result.plan.describe(len(mine[0]))}, "
                  f"{result.ooms} OOM(s) caught", flush=True)  # fmt: skip
    weights = accelerator.unwrap_model(model).state_dict()
    checksum = torch.stack([w.detach().double().sum() for w in weights.values()]).reshape(1, -1)
    sums = accelerator.gather(checksum.to(accelerator.device))  # every rank's checksum
    accelerator.print(f"replicas identical: {bool((sums == sums[0]).all())}; {train_step.guard.summary()}")
    if save is not None:
        accelerator.save(weights, save)  # (the main process writes it)
    accelerator.wait_for_everyone()
    train_step.guard.close()
    return result.loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fault", choices=["forward", "backward", "optimizer"], help="the last rank runs out once")
    parser.add_argument("--save", help="write the trained weights here")
    arguments = parser.parse_args()
    main(arguments.steps, arguments.fault, arguments.save)
