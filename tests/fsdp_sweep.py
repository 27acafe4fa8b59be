"""One rank of the two-rank FSDP2 fault sweep, run by tests/test_fsdp.py (`python fsdp_sweep.py RANK WORLD INIT OUT
MODE`, MODE "sample" or "every").

A tiny Llama (2 layers, hidden 32) sharded with ``fully_shard`` per layer and root trains one guarded AdamW step on
each rank's half of a batch. A fault-free step first counts rank 1's device allocations in a step (N) and gives the
reference weights. Then, for every fault position k (all of 1..N for "every", about twenty spread over the step for
"sample"), a fresh model and guard run the same step with rank 1's k-th allocation failing: in forward or backward
compute, in an all-gather's or a reduce-scatter's buffer, in the optimizer step. Each case must end on both ranks
with one optimizer step, the same plan and OOM count on both, FSDP's state clean, and the reference weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_worker import EPS, LR, clean
from helpers.models import VOCAB, make_llama

from oomguard import OOMGuard
from oomguard.testing import SimulatedGPU

ROWS, TOKENS = 8, 16


def batch(rank: int, world: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, TOKENS), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids[rank::world].contiguous(), "labels": ids[rank::world].contiguous()}


def case(mesh: DeviceMesh, data: dict[str, torch.Tensor], fault: int | None) -> tuple[dict[str, Any], Any, int]:
    """One guarded step from the same initial weights; rank 1's ``fault``-th allocation fails (None: none).
    Returns what the case saw, the gathered weights and the allocations the step made."""
    model = make_llama(layers=2, hidden=32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    guard = OOMGuard(lambda b: model(**b).loss, model=model, optimizer=optimizer, step_journal="always")
    gpu = SimulatedGPU("1GiB")
    start = [-1]

    def arm(*_: Any) -> None:  # counted from the first attempt's forward (the guard's setup allocates before it)
        if start[0] < 0:
            start[0] = gpu.allocations
            if fault is not None and dist.get_rank() == 1:
                gpu.fail_allocation(fault)

    model.register_forward_pre_hook(arm, prepend=True)
    with gpu:
        gpu.adopt(model)
        result = guard(data)
        seen = {
            "ooms": result.ooms,
            "plan": result.plan.to_dict(),
            "fired": fault is not None and dist.get_rank() == 1 and not gpu.fault_pending,
            "clean": clean(model),
            "adam": sorted({int(optimizer.state[p]["step"]) for p in model.parameters()}),
        }
        allocations = gpu.allocations - start[0]
    guard.close()
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    return seen, full, allocations


def main(rank: int, world: int, init_method: str, out: Path, mode: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    data = batch(rank, world)
    _, reference, allocations = case(mesh, data, None)
    counts: list[int] = [0] * world
    dist.all_gather_object(counts, allocations)
    total = counts[1]  # (rank 1's allocations in a fault-free step)
    faults = range(1, total + 1) if mode == "every" else sorted({*range(1, total + 1, max(1, total // 20)), total})
    problems: list[str] = []
    unfired: list[int] = []
    for fault in faults:
        seen, weights, _ = case(mesh, data, fault)
        both: list[Any] = [None] * world
        dist.all_gather_object(both, seen)  # (a collective at a point every rank reaches: after the call)
        if rank == 1 and not seen["fired"]:
            unfired.append(fault)
        if both[0]["plan"] != both[1]["plan"] or both[0]["ooms"] != both[1]["ooms"]:
            problems.append(f"fault {fault}: the ranks disagree: {both}")
        if not seen["clean"] or seen["adam"] != [1]:
            problems.append(f"fault {fault}: clean={seen['clean']}, adam steps {seen['adam']}")
        worst = max((weights[name] - reference[name]).abs().max().item() for name in reference)
        if worst > 1e-5:
            problems.append(f"fault {fault}: weights differ from the fault-free step by {worst:.3g}")
    report = {"allocations": total, "faults": len(faults), "unfired": unfired, "problems": problems}
    (out / f"report{rank}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (no gloo teardown at interpreter exit: see tests/dist_worker.py)
