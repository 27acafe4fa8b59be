"""One rank of a two-rank gloo job, run by tests/test_distributed_planner.py (`python dist_planner_worker.py RANK
WORLD INIT OUT MODE`): the planner's features under DDP, with the guard's default options.

Each rank trains a Llama (hidden 64, 4 layers) under DDP on its half of every global batch, on its own
SimulatedGPU with a quarter of the memory a plain step of that half needs. Both ranks run out of memory on the
first step; each plans its own half on fake tensors (the jump) and the ranks agree on the deepest level of every
rung either chose. Once the bucket has run clean steps, rank 0 searches the fastest plans (tuning) and both ranks
time the same trials; the slowest rank's times decide (see :data:`JOBS` for each mode's job). Each rank writes
its report, events and weights.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.models import make_llama

from oomguard import OOMGuard, Plan
from oomguard.testing import SimulatedGPU

GLOBAL_BATCH = 16


@dataclass(frozen=True)
class Job:
    layers: int
    hidden: int
    seq: int
    steps: int
    tune_after: int | None = 4  # (the guard's default)
    start: Plan | None = None  # the plan every bucket starts on (None: the default plan)
    room: float = 0.25  # each rank's device memory, as a share of what a plain step of its half peaks at


#: "default": the issue's job with the default options (slow: tuning's search takes several calls); "quick": a
#: smaller one that does not tune, for the default suite; "state": the quick job restarted on its state file;
#: "layers": the quick job started on layer offload (both blocks streamed from the host), in the room it needs.
JOBS = {
    "default": Job(4, 64, 64, 24),
    "quick": Job(2, 32, 32, 4, None),
    "state": Job(2, 32, 32, 2, None),
    "layers": Job(2, 32, 32, 3, None, Plan(offload_layers=2), room=1.0),
}


def global_batch(step: int, seq: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s global batch: rows of random tokens, all counted (so halves weigh alike)."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 64, (GLOBAL_BATCH, seq), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def share(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of a global batch (rows rank, rank + world, ...)."""
    return {key: value[rank::world].contiguous() for key, value in batch.items()}


def plain_peak(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """What one unguarded AdamW step of ``batch`` peaks at on a simulated device (on a copy of ``model``)."""
    probe = copy.deepcopy(model)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(probe)
        optimizer = torch.optim.AdamW(probe.parameters())
        probe(**batch).loss.backward()
        optimizer.step()
        return gpu.max_memory_allocated()


def main(rank: int, world: int, init_method: str, out: Path, mode: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    job = JOBS[mode]
    model = make_llama(layers=job.layers, hidden=job.hidden)
    budget = int(plain_peak(model, share(global_batch(0, job.seq), rank, world)) * job.room)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    state = out.parent / "plans.json"
    guard = OOMGuard(
        lambda batch: ddp(**batch), model=ddp, optimizer=optimizer, log_file=out / "events.jsonl", state_file=state,
        tune_after=job.tune_after,
    )  # fmt: skip
    if job.start is not None:
        guard.plan = job.start
    report: dict[str, Any] = {"budget": budget, "steps": []}
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        for step in range(job.steps):
            started = time.perf_counter()
            result = guard(share(global_batch(step, job.seq), rank, world))
            seconds = time.perf_counter() - started
            report["steps"].append({"plan": result.plan.to_dict(), "ooms": result.ooms, "seconds": seconds})
    guard.close()
    report["adam_steps"] = sorted({int(optimizer.state[p]["step"]) for p in model.parameters()})
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights{rank}.pt")
    (out / f"report{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # leaving while a peer still talks can abort it


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
    sys.stdout.flush()  # (then leave as tests/dist_worker.py does, past torch 2.13's gloo teardown)
    sys.stderr.flush()
    os._exit(0)
