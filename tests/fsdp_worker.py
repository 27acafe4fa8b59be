"""One rank of a two-rank gloo FSDP2 job, run by tests/test_fsdp.py (`python fsdp_worker.py RANK WORLD INIT OUT MODE`).

Each rank shards the same tiny Llama (hidden 64, 4 layers) with ``fully_shard`` per decoder layer and on the root
over ``init_device_mesh("cpu", (2,))``, trains it with AdamW on its half of every global batch, and runs on its own
SimulatedGPU whose budget is a quarter of the plain FSDP step's peak (measured first, on a model of its own).
Rank 1 runs out of memory on purpose once per step (see FAULTS): inside an all-gather (its buffer's allocation), in
forward compute, in backward compute, inside a reduce-scatter (its buffer's allocation) and in the optimizer step.
Both ranks write what they saw and the full (gathered) weights.
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
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.models import VOCAB, make_llama

from oomguard import OOMGuard, Plan
from oomguard._distributed.fsdp import FSDPAgreement
from oomguard.testing import SimulatedGPU

STEPS = 5
ROWS, TOKENS = 32, 64  # the global batch: each rank trains on half of its rows
LR = 1e-2
CLIP = 0.2  # (below every step's gradient norm here: the clip scales the gradients)
EPS = 1e-3  # Adam's update of a gradient near zero amplifies float rounding; a larger eps keeps it tame
#: The exact rungs only (no amp): the weights must equal a single process's fp32 run.
LADDER = ["micro_batch", "checkpointing", "activation_offload"]
#: Rank 1's fault in each step: where its one out-of-memory error is raised.
FAULTS = {0: "all_gather", 1: "forward", 2: "backward", 3: "reduce_scatter", 4: "optimizer"}
#: Each mode's faults (rank -> step -> where) and the plan it starts on: "run" the default plan; "offload" full
#: checkpointing and activation offload of the sharded blocks (three steps); "single" a process group of one
#: (FSDP's micro-batching and its reset after a failure, with no peer); "both" both ranks failing in the same
#: attempt, each in a different place (one inside an all-gather, the other in compute after it); "amp" bf16
#: autocast on top of FSDP's (default, fp32) mixed-precision policy; "clip" max_grad_norm=CLIP, rank 1 failing
#: inside the clip of sharded gradients (before its gate) in step 0.
MODES: dict[str, tuple[dict[int, dict[int, str]], Plan]] = {
    "run": ({1: FAULTS}, Plan()),
    "offload": ({1: {1: "forward", 2: "backward"}}, Plan(checkpointing="full", activation_offload=True)),
    "single": ({0: {0: "forward", 1: "backward", 2: "optimizer"}}, Plan()),
    "amp": ({1: {1: "forward", 2: "backward"}}, Plan(precision="bf16")),
    "clip": ({1: {0: "clip", 1: "forward", 2: "optimizer"}}, Plan()),
    "both": (
        {0: {0: "forward0", 1: "all_gather", 2: "optimizer"}, 1: {0: "all_gather", 1: "backward", 2: "optimizer"}},
        Plan(),
    ),
}


def global_batches(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """Every step's whole batch: rows of equal length (no padding), so each rank's half holds as many counted
    tokens as the other's, and the average of the two ranks' mean losses is the whole batch's mean."""
    out = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (ROWS, TOKENS), generator=torch.Generator().manual_seed(50 + step))
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def sharded_llama(mesh: DeviceMesh) -> torch.nn.Module:
    model = make_llama(layers=4, hidden=64)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def plain_peak(mesh: DeviceMesh, batch: dict[str, torch.Tensor]) -> int:
    """The peak of one plain FSDP step (forward, backward, AdamW's first step) on this rank's batch."""
    model = sharded_llama(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # (gloo's average is wrong under FSDP2)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        gpu.reset_peak_memory_stats()
        model(**batch).loss.backward()
        optimizer.step()
        return gpu.max_memory_allocated()


def clean(model: torch.nn.Module) -> bool:
    """Every FSDP group resharded, idle, and holding no unsharded gradient."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:  # type: ignore[attr-defined]
            if not group.is_sharded or group._all_gather_result is not None or group._training_state.name != "IDLE":
                return False
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                if param.unsharded_accumulated_grad is not None or (
                    unsharded is not None and unsharded.grad is not None
                ):
                    return False
    return True


def main(rank: int, world: int, init_method: str, out: Path, mode: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    every, start = MODES[mode]
    faults = every.get(rank, {})  # (this rank's)
    whole = global_batches(max(step for steps in every.values() for step in steps) + 1)
    batches = [{k: v[rank::world].contiguous() for k, v in batch.items()} for batch in whole]
    peak = plain_peak(mesh, batches[0])
    model = sharded_llama(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    gpu = SimulatedGPU(peak // 4)
    step_index = [0]
    armed = dict.fromkeys(faults.values(), False)

    def arm(kind: str, count: int = 1) -> None:
        if faults.get(step_index[0]) == kind and not armed[kind]:
            armed[kind] = True
            gpu.fail_allocation(count)

    # Before FSDP's own pre-forward hook: the next allocation is the all-gather buffer of layer 1's parameters.
    model.model.layers[1].register_forward_pre_hook(lambda *_: arm("all_gather"), prepend=True)
    # After it (its parameters gathered): the next allocation is layer 2's forward compute.
    model.model.layers[2].register_forward_pre_hook(lambda *_: arm("forward"))
    # Layer 0's compute: before layer 1's all-gather, so this rank's agreement meets the other's gate there.
    model.model.layers[0].register_forward_pre_hook(lambda *_: arm("forward0"))
    optimizer.register_step_pre_hook(lambda *_: arm("optimizer"))
    clip = FSDPAgreement.clip

    def armed_clip(self: FSDPAgreement, params: list[torch.Tensor], max_norm: float) -> float:
        arm("clip")  # (the next allocation: the first local norm, before the clip's gate)
        norms.append(clip(self, params, max_norm))
        return norms[-1]

    norms: list[float] = []
    FSDPAgreement.clip = armed_clip  # type: ignore[method-assign]
    allocate = FSDPAgreement._allocate
    injected = [0]  # gated allocations that failed with this rank's injected fault (others: the budget's own OOMs)

    def counted_allocate(self: FSDPAgreement, *args: Any) -> torch.Tensor:
        pending = gpu.fault_pending
        try:
            return allocate(self, *args)
        except Exception:
            injected[0] += pending and not gpu.fault_pending  # (the fault fired here)
            raise

    FSDPAgreement._allocate = counted_allocate  # type: ignore[method-assign]

    def train_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(**batch).loss
        if faults.get(step_index[0]) == "backward" and not armed["backward"]:
            loss.register_hook(lambda grad: arm("backward", 2))  # inside this rank's backward compute
        return loss

    guard = OOMGuard(
        train_step,
        model=model,
        optimizer=optimizer,
        log_file=out / "events.jsonl",
        step_journal="always",  # (a fault armed inside the step, after the ranks agreed whether to journal it)
        ladder=LADDER,
        max_grad_norm=CLIP if mode == "clip" else None,
    )
    guard.plan = start
    report: dict[str, Any] = {"peak": peak, "budget": peak // 4, "steps": []}
    with gpu:
        gpu.adopt(model)
        for step, batch in enumerate(batches):
            step_index[0] = step
            if faults.get(step) == "reduce_scatter":  # (the guard made the gated comms at its first call)
                fail_first_reduce_scatter(model, lambda: arm("reduce_scatter"))
            result = guard(batch)
            report["steps"].append(
                {"plan": result.plan.to_dict(), "ooms": result.ooms, "loss": result.loss, "clean": clean(model)}
            )
        agreement = guard._runner.agreement
        report["agreement"] = type(agreement).__name__
        report["gate_failures"] = getattr(agreement, "gate_failures", None)
        report["injected_gate_failures"] = injected[0]
    report["faults_fired"] = armed
    report["norms"] = norms
    report["adam_steps"] = sorted({int(optimizer.state[p]["step"]) for p in model.parameters()})
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}  # (every rank gathers)
    guard.close()
    report["comms_after_close"] = sorted(
        {
            type(group._all_gather_comm).__name__ + "/" + type(group._reduce_scatter_comm).__name__
            for module in model.modules()
            if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups  # type: ignore[attr-defined]
        }
    )
    torch.save(full, out / f"weights{rank}.pt")
    (out / f"report{rank}.json").write_text(json.dumps(report))
    dist.barrier()


def fail_first_reduce_scatter(model: torch.nn.Module, arm: Any) -> None:
    """Arm the fault just before each reduce-scatter buffer's allocation (``arm`` fires once): the gated comm's
    ``allocate`` then runs out of memory on its own ``torch.empty``."""
    comm = model._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm  # type: ignore[operator]
    allocate = comm.allocate

    def armed_allocate(*args: Any, **kwargs: Any) -> torch.Tensor:
        arm()
        return allocate(*args, **kwargs)

    comm.allocate = armed_allocate


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (no gloo teardown at interpreter exit: see tests/dist_worker.py)
