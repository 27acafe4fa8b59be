"""One rank of a two-rank gloo job, run by tests/test_distributed_mixed.py
(`python dist_mixed_worker.py RANK WORLD INIT OUT MODE`), for what the ranks do when their failures differ, and for
parameter groups added during training.

Modes ``"<wrapper>-<phase>"`` (wrapper ``ddp`` or ``fsdp``, phase ``forward`` or ``optimizer``): in step 1 rank 0
fails with its own ``ValueError`` in that phase while rank 1 runs out of memory in the same attempt. The ranks agree
that the attempt failed with an error they do not retry: rank 0 raises its ``ValueError``, rank 1 ``PeerFailure``;
neither retries alone (which hung FSDP2 and garbled DDP's next agreement). Mode ``"groups"``: DDP; after step 1 each
rank unfreezes the first layer and adds it to the optimizer as a group of its own (progressive unfreezing); its
gradients must be averaged over the ranks and clipped with the others.

Each rank writes what it saw (``report<RANK>.json``) and its weights (``weights<RANK>.pt``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.batches import tuple_batch
from helpers.models import make_llama

from oomguard import OOMGuard
from oomguard.testing import SimulatedGPU

STEPS = 4


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))  # fmt: skip


def mixed(rank: int, world: int, out: Path, wrapper: str, phase: str) -> None:
    """Step 1: rank 0 fails with a ValueError in ``phase``, rank 1 runs out of memory there in the same attempt."""
    gpu = SimulatedGPU("1GiB")
    step_index = [0]
    if wrapper == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = make_llama(layers=2, hidden=32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: torch.nn.Module = model
        generator = torch.Generator().manual_seed(rank)
        batches = [{"input_ids": (ids := torch.randint(1, 64, (4, 16), generator=generator)), "labels": ids}
                   for _ in range(STEPS)]  # fmt: skip

        def forward(batch: Any) -> torch.Tensor:
            return model(**batch).loss

        first = model.model.layers[0]
    else:
        model = mlp()
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        batches = [tuple(t[rank::world].contiguous() for t in tuple_batch(n=8, seed=step)) for step in range(STEPS)]

        def forward(batch: Any) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(wrapped(x).squeeze(-1), y)

        first = model[0]
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    fired = [False]

    def fail(*_: Any) -> None:
        if step_index[0] == 1 and not fired[0]:
            fired[0] = True
            if rank == 0:
                raise ValueError("rank 0's own error")
            gpu.fail_allocation(1)

    if phase == "forward":
        first.register_forward_pre_hook(fail)
    else:
        optimizer.register_step_pre_hook(fail)
    guard = OOMGuard(forward, model=wrapped, optimizer=optimizer, step_journal="always", ladder=["micro_batch"])
    report: dict[str, Any] = {"steps": 0}
    with gpu:
        gpu.adopt(model)
        for step, batch in enumerate(batches):
            step_index[0] = step
            try:
                guard(batch)
            except Exception as error:
                report["error"] = {"step": step, "type": type(error).__name__, "message": str(error)}
                break
            report["steps"] += 1
    report["fired"] = fired[0]
    (out / f"report{rank}.json").write_text(json.dumps(report))


def groups(rank: int, world: int, out: Path) -> None:
    """DDP; the first layer frozen, then unfrozen after step 1 and added as a parameter group of its own."""
    model = mlp()
    model[0].requires_grad_(False)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def forward(batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(wrapped(x).squeeze(-1), y)

    guard = OOMGuard(forward, model=wrapped, optimizer=optimizer, max_grad_norm=0.5, ladder=[])
    norms = []
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        for step in range(STEPS):
            if step == 2:
                model[0].requires_grad_(True)
                optimizer.add_param_group({"params": list(model[0].parameters()), "lr": 1e-2})
            x, y = tuple_batch(n=8, seed=10 * step + rank)  # (each rank its own data)
            norms.append(guard((x, y)).grad_norm)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights{rank}.pt")
    (out / f"report{rank}.json").write_text(json.dumps({"norms": norms}))


def main(rank: int, world: int, init_method: str, out: Path, mode: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    if mode == "groups":
        groups(rank, world, out)
    else:
        wrapper, phase = mode.split("-")
        mixed(rank, world, out, wrapper, phase)
    dist.barrier()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (torch 2.13's gloo can abort a finished rank at interpreter exit: see tests/dist_worker.py)
