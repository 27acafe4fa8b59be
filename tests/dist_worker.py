"""One rank of a two-rank gloo job, run by tests/test_distributed.py (`python dist_worker.py RANK WORLD INIT OUT MODE`).

Each rank trains the same MLP under DDP on its half of every global batch, on its own SimulatedGPU. Rank 1 has
a smaller budget (the whole batch does not fit there, so both ranks must agree on micro-batches from step 0) and
runs out of memory on purpose in the forward of step 1, in the backward of step 2, in the optimizer step of step
3 and in the optimizer step of step 0 (Adam's lazy first step). Rank 0 writes what it saw; both write weights.

Mode "host" runs on activation offload and only rank 1 fails, once: its host memory runs out in the forward of step
1 (a failed pinned allocation). Every rank stops there; rank 0 says it was another rank's host memory.

Mode "chunked" trains a tiny Qwen2 (tied embeddings) instead, on a plan with the chunked_loss rung, and rank 1 runs
out of memory inside the chunked loss of step 1 (see :func:`chunked_main`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.batches import ragged_lm_batch, tuple_batch
from helpers.models import make_llama, make_mlp, make_qwen2
from helpers.steps import LADDER_WITHOUT_OPTIMIZER_OFFLOAD

from oomguard import OOMGuard, Plan
from oomguard.testing import SimulatedGPU

STEPS = 5
GLOBAL_BATCH = 32
EPS = 1e-3  # Adam's update of a gradient near zero amplifies float rounding; a larger eps keeps it tame
FAULTS = {0: "optimizer", 1: "forward", 2: "backward", 3: "optimizer"}  # on rank 1: step -> phase


def batches(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of each global batch (rows rank, rank + world, ...)."""
    out = []
    for step in range(STEPS):
        x, y = tuple_batch(n=GLOBAL_BATCH, seed=100 + step)
        out.append((x[rank::world].contiguous(), y[rank::world].contiguous()))
    return out


#: The chunked mode's global batches: right-padded rows whose halves (rows rank, rank + 2) hold the same number
#: of counted tokens (11 + 6 and 8 + 9 after the shift), so DDP's average of the two ranks' mean losses is the
#: whole batch's mean and a single process on the global batch trains alike.
CHUNKED_LENGTHS = [12, 9, 7, 10]
CHUNKED_STEPS = 3


def chunked_batches(rank: int | None = None, world: int = 2) -> list[dict[str, torch.Tensor]]:
    """The chunked mode's global batches (``rank``: that rank's share)."""
    whole = [ragged_lm_batch(CHUNKED_LENGTHS, seq_len=12, seed=step) for step in range(CHUNKED_STEPS)]
    if rank is None:
        return whole
    return [{key: value[rank::world].contiguous() for key, value in batch.items()} for batch in whole]


def chunked_main(rank: int, world: int, out: Path) -> None:
    """The Qwen2 under DDP on a plan with chunked_loss (its head and loss found inside the DDP wrapper). In step 1,
    rank 1's first allocation after the final norm fails: inside the chunked loss (the lazy head allocates
    nothing); both ranks then retry on micro-batches, still chunked. Both write their weights and plans."""
    model = make_qwen2()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2, eps=EPS)
    gpu = SimulatedGPU("64MiB")
    armed = [False]
    step_index = [0]

    def loss_fault(module: torch.nn.Module, args: Any, output: Any) -> None:
        if rank == 1 and step_index[0] == 1 and not armed[0]:
            armed[0] = True
            gpu.fail_allocation(1)

    model.model.norm.register_forward_hook(loss_fault)
    guard = OOMGuard(lambda batch: ddp(**batch), model=ddp, optimizer=optimizer, log_file=out / "events.jsonl")
    guard.plan = Plan().with_level("chunked_loss", 1)
    report = chunked_steps(guard, gpu, model, rank, world, step_index)
    report["patched"] = "forward" in vars(model.lm_head)  # the rung held the inner model's head to the end
    guard.close()
    report["fault_fired"] = armed[0] and not gpu.fault_pending
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights{rank}.pt")
    (out / f"report{rank}.json").write_text(json.dumps(report))


def chunked_steps(
    guard: OOMGuard, gpu: SimulatedGPU, model: torch.nn.Module, rank: int, world: int, step_index: list[int]
) -> dict[str, Any]:
    """Runs ``guard`` on this rank's share of each of :func:`chunked_batches`, the model adopted by ``gpu``; the
    plan, OOMs and rungs of each step (``step_index[0]``: the step running, for the fault hooks)."""
    report: dict[str, Any] = {"steps": []}
    with gpu:
        gpu.adopt(model)
        for step, batch in enumerate(chunked_batches(rank, world)):
            step_index[0] = step
            result = guard(batch)
            report["steps"].append({"plan": result.plan.describe(), "ooms": result.ooms, "rungs": result.rungs})
    return report


def tiled_main(rank: int, world: int, out: Path) -> None:
    """A Llama under DDP, its ladder tiled_mlp alone: in step 1, rank 1's first allocation inside block 0's MLP
    fails; both ranks then run every MLP in the same number of chunks. Both write their weights and plans."""
    model = make_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gpu = SimulatedGPU("64MiB")
    armed, step_index = [False], [0]

    def mlp_fault(module: torch.nn.Module, args: Any) -> None:
        if rank == 1 and step_index[0] == 1 and not armed[0]:
            armed[0] = True
            gpu.fail_allocation(1)

    model.model.layers[0].mlp.register_forward_pre_hook(mlp_fault)
    guard = OOMGuard(lambda batch: ddp(**batch), model=ddp, optimizer=optimizer, ladder=["tiled_mlp"])
    report = chunked_steps(guard, gpu, model, rank, world, step_index)
    guard.close()
    report["fault_fired"] = armed[0] and not gpu.fault_pending
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights{rank}.pt")
    (out / f"report{rank}.json").write_text(json.dumps(report))


def main(rank: int, world: int, init_method: str, out: Path, mode: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    if mode == "chunked":
        chunked_main(rank, world, out)
        dist.barrier()
        return
    if mode == "tiled":
        tiled_main(rank, world, out)
        dist.barrier()
        return
    if mode == "hang":  # the harness's own check: rank 1 never joins the collective, rank 0 waits forever
        if rank == 0:
            dist.barrier()
        else:
            time.sleep(3600)
        return
    model = make_mlp(width=512)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2, eps=EPS)
    gpu = SimulatedGPU("4MiB" if rank == 0 else "400KiB")
    step_index = [0]
    # "offload" and "quantized": one fault, in rank 1's first optimizer step, answered by optimizer_offload (or
    # quantized_optimizer) on every rank.
    faults = {0: "optimizer"} if mode in ("offload", "quantized") else {1: "host"} if mode == "host" else FAULTS

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = ddp(x).squeeze(-1)
        loss = torch.nn.functional.mse_loss(out, y)
        if rank == 1 and faults.get(step_index[0]) == "backward" and not armed["backward"]:
            armed["backward"] = True
            loss.register_hook(lambda grad: gpu.fail_allocation(2))  # inside this rank's backward
        return loss

    def forward_fault(module: torch.nn.Module, args: Any) -> None:
        if rank == 1 and faults.get(step_index[0]) == "forward" and not armed["forward"]:
            armed["forward"] = True
            gpu.fail_allocation(1)
        if rank == 1 and faults.get(step_index[0]) == "host" and not armed["host"]:
            armed["host"] = True
            gpu.fail_host_allocation(1)  # the first saved activation's host copy

    def optimizer_fault(*_: Any) -> None:
        if rank == 1 and faults.get(step_index[0]) == "optimizer" and not armed[f"optimizer{step_index[0]}"]:
            armed[f"optimizer{step_index[0]}"] = True
            gpu.fail_allocation(1)

    armed = dict.fromkeys(["forward", "backward", "optimizer0", "optimizer3", *(["host"] * (mode == "host"))], False)
    model.register_forward_pre_hook(forward_fault)
    optimizer.register_step_pre_hook(optimizer_fault)
    # A fault armed inside the optimizer step is one nobody could foresee when the ranks agreed whether to
    # journal the step. "run" journals every step, so it is undone on every rank; "fast" lets steady-state
    # steps skip the journal, and then every rank must stop with the same StepRollbackError, none hanging.
    # "offload" journals every step too, and answers its one fault with optimizer_offload alone; the others name
    # the ladder without it (their faults are armed in the device step, which optimizer offload takes away).
    journal = "auto" if mode == "fast" else "always"
    ladder = {"offload": ["optimizer_offload"], "quantized": ["quantized_optimizer"]}.get(
        mode, LADDER_WITHOUT_OPTIMIZER_OFFLOAD
    )
    guard = OOMGuard(
        train_step, model=ddp, optimizer=optimizer, log_file=out / "events.jsonl", step_journal=journal, ladder=ladder
    )
    if mode == "host":
        guard.plan = Plan(activation_offload=True)
    report: dict[str, Any] = {"steps": []}
    with gpu:
        gpu.adopt(model)
        for step, batch in enumerate(batches(rank, world)):
            step_index[0] = step
            try:
                result = guard(batch)
            except Exception as error:  # "fast" mode: reported, and the job stops on every rank alike
                report["error"] = {"step": step, "type": type(error).__name__}
                report["message"] = str(error)
                break
            report["steps"].append({"plan": result.plan.to_dict(), "ooms": result.ooms, "loss": result.loss})
        agreement = guard._runner.agreement
        assert agreement is not None
        before = gpu.allocations
        agreement.after_step("ok")
        agreement.after_backward("ok", "backward", journal=False)
        report["agreement_allocations"] = gpu.allocations - before
    report["faults_fired"] = armed
    report["adam_steps"] = [int(optimizer.state[p]["step"]) for p in model.parameters()]
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights{rank}.pt")
    (out / f"report{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # leaving while a peer still talks can abort it
    # No destroy_process_group: the caller leaves with os._exit, and torch 2.13's gloo teardown is where a
    # finished job can hang or abort (see tests/test_examples.py)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
    # Done and written: leave without the interpreter's shutdown, where torch 2.13's gloo can abort a finished
    # rank (its run-loop thread frees a collective's tensors and needs the GIL as the interpreter goes away:
    # "terminate called without an active exception"; see tests/test_examples.py). An error above still exits 1.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
