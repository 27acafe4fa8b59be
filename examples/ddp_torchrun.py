"""Distributed data parallel, guarded: run with `torchrun --standalone --nproc_per_node 2 examples/ddp_torchrun.py`.

On CPUs the ranks talk over gloo and each runs under its own simulated GPU; rank 1's is smaller, so only rank 1
runs out of memory. Every rank learns of it and all move to the same plan before retrying the same batch: no
rank hangs, and the replicas stay identical (the script checks it at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os

import torch
import torch.distributed as dist

from oomguard import oom_guard
from oomguard.testing import SimulatedGPU


def main(steps: int = 4) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun sets RANK, WORLD_SIZE...
    train(steps)
    # The guard and the DDP module (whose reducer holds the process group) are gone with train()'s frame; only then
    # is the group torn down, once every rank has finished talking. (With the DDP module still alive, its
    # destructor ran after destroy_process_group and could hang in gloo: seen under load, a rank stuck at exit.)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(steps: int) -> None:
    cuda = torch.cuda.is_available()
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.GELU(), torch.nn.Linear(512, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    @oom_guard(model=ddp, optimizer=optimizer)  # the guard agrees with the other ranks at every step
    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(ddp(x).squeeze(-1), y)

    generator = torch.Generator().manual_seed(1)
    budget = SimulatedGPU("2MiB" if rank == 0 else "600KiB") if not cuda else contextlib.nullcontext()
    with budget as gpu:
        if gpu is not None:
            gpu.adopt(model)
        for _ in range(steps):
            x, y = torch.randn(64 * world, 32, generator=generator), torch.randn(64 * world, generator=generator)
            mine = (x[rank::world].to(device), y[rank::world].to(device))  # this rank's share of the batch
            result = train_step(mine)
            print(f"[rank {rank}] step {result.step}: loss {result.loss:.4f}, {result.plan.describe(64)}, "
                  f"{result.ooms} OOM(s) caught", flush=True)  # fmt: skip
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    sums = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(sums, checksum)
    if rank == 0:
        same = all(torch.equal(s, sums[0]) for s in sums)
        print(f"replicas identical: {same}; {train_step.guard.summary().ooms} OOM(s) seen on rank 0", flush=True)
    train_step.guard.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    main(parser.parse_args().steps)
