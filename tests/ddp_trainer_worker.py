"""One rank of a two-rank OOMGuardTrainer job under torchrun, run by tests/test_trainer_ddp.py.

`torchrun --standalone --nproc_per_node 2 tests/ddp_trainer_worker.py OUT [PHASE@STEP ...]`: the Trainer wraps a
tiny Llama in DDP through Accelerate (gloo on CPU), each rank under its own roomy SimulatedGPU; rank 1 runs out of
memory once in each PHASE (forward, backward, clip, optimizer, or replay-clip: the clipping of a replay that an
OOM in the optimizer step started) of the Trainer's step STEP. Each rank writes its
report (global_step, the faults that fired, the guard's OOM events) and its weights to OUT.

`... ddp_trainer_worker.py OUT sweep EVERY`: the fault sweep. A run of two steps without faults counts the device
allocations of the second step (from the guard's forward to the step's end) on rank 1; then, for every EVERY-th of
them, a fresh run of two steps in which that allocation of rank 1 fails, once. Each rank writes, per allocation,
whether its run ended (global_step 2), its OOMs, and how far its weights are from the run without faults.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.hf_trainer import RaggedText, training_args
from helpers.models import make_llama

from oomguard.integrations.transformers import OOMGuardTrainer
from oomguard.testing import SimulatedGPU

STEPS = 4
PER_RANK = 8  # the Trainer's per_device_train_batch_size: a global batch of 16 over two ranks
WORLD_SIZE = 2
FAULTED_RANK = 1  # (0 where a single process runs the sweep, to debug it)


class FaultyTrainer(OOMGuardTrainer):
    """Rank 1's first allocation of a phase fails, once, in the steps the command line names."""

    faults: ClassVar[dict[str, int]] = {}
    fired: ClassVar[dict[str, bool]] = {}
    gpu: SimulatedGPU

    def _arm(self, phase: str) -> None:
        if self.args.process_index == 1 and self.faults.get(phase) == self.state.global_step and not self.fired[phase]:
            self.fired[phase] = True
            self.gpu.fail_allocation(1)

    def training_step(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not getattr(self, "_hooked", False):
            self._hooked = True
            core = model.module if hasattr(model, "module") else model
            core.register_forward_pre_hook(lambda *_: self._arm("forward"))
            core.model.norm.register_full_backward_hook(lambda *_: self._arm("backward"))
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            inner.register_step_pre_hook(lambda *_: self._arm("optimizer"))
        return super().training_step(model, *args, **kwargs)

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        self._arm("replay-clip" if self._oomguard_step.replaying else "clip")  # (a replay clips what it recomputed)
        return super()._clip_grad_norm(model)


class FaultAtAllocation(transformers.TrainerCallback):  # type: ignore[misc]
    """Counts the device allocations of step 1 from the guard's forward and backward to the step's end (not the
    Trainer's input preparation before it, which is the Trainer's own: see the test), or, on rank 1, makes the
    ``fault``-th of them fail, once."""

    def __init__(self, gpu: SimulatedGPU, rank: int, fault: int | None) -> None:
        self.gpu, self.rank, self.fault = gpu, rank, fault
        self.counted: int | None = None
        self.started: int | None = None

    def guarded(self, step: int) -> None:
        if step == 1 and self.started is None:
            self.started = self.gpu.allocations
            if self.rank == FAULTED_RANK and self.fault is not None:
                self.gpu.fail_allocation(self.fault)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2 and self.started is not None:  # (after the step: global_step has moved on)
            self.counted = self.gpu.allocations - self.started


class SweptTrainer(OOMGuardTrainer):
    counter: FaultAtAllocation

    def _guarded_loss(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.counter.guarded(self.state.global_step)
        return super()._guarded_loss(*args, **kwargs)


def sweep_run(out: Path, fault: int | None) -> tuple[Any, FaultAtAllocation, dict[str, torch.Tensor]]:
    """Two Trainer steps of a fresh model on a fresh simulated GPU, rank 1's ``fault``-th allocation of step 1
    failing (None: no fault)."""
    model = make_llama(layers=2, hidden=64)
    args = training_args(out / "trainer", per_device_train_batch_size=PER_RANK, max_steps=2, logging_steps=10)
    with SimulatedGPU("64MiB") as gpu:
        counter = FaultAtAllocation(gpu, args.process_index, fault)
        trainer = SweptTrainer(model=model, args=args, train_dataset=RaggedText(), callbacks=[counter])
        trainer.counter = counter
        gpu.adopt(model)
        trainer.train()
    return trainer, counter, {k: v.detach().clone() for k, v in model.state_dict().items()}


def sweep_main(out: Path, every: int) -> None:
    """The fault sweep (see the module's docstring)."""
    _, counter, reference = sweep_run(out, None)
    count = torch.tensor([counter.counted or 0])
    dist.broadcast(count, src=1)  # rank 1's count: the faulted rank's allocations are the ones swept
    rank = dist.get_rank()
    results = []
    print(f"[rank {rank}] sweeping {int(count)} allocations", flush=True)
    for fault in range(1, int(count) + 1, every):
        print(f"[rank {rank}] fault at allocation {fault}", flush=True)
        try:
            trainer, _, weights = sweep_run(out, fault)
        except Exception as error:  # reported: the test fails on it, naming the allocation
            where = traceback.format_exc()
            results.append({"fault": fault, "error": f"{type(error).__name__}: {str(error)[:200]}", "where": where})
            break  # (the other rank may be anywhere now: this rank's run is over)
        checksum = torch.stack([w.double().sum() for w in weights.values()]).sum().reshape(1)
        sums = [torch.zeros_like(checksum) for _ in range(WORLD_SIZE)]
        dist.all_gather(sums, checksum)
        ooms = [e.error.phase for e in trainer.oomguard.events if e.kind == "oom"]
        gap = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
        results.append(
            {
                "fault": fault,
                "global_step": trainer.state.global_step,
                "ooms": ooms,
                "gap": gap,
                "replicas_equal": bool(torch.equal(sums[0], sums[1])),
            }
        )
    (out / f"sweep{rank}.json").write_text(json.dumps({"allocations": int(count), "results": results}))
    dist.barrier()
    print(f"[rank {rank}] done: global_step swept {len(results)} faults", flush=True)


def main(out: Path, faults: list[str]) -> None:
    FaultyTrainer.faults = {phase: int(step) for phase, step in (fault.split("@") for fault in faults)}
    FaultyTrainer.fired = dict.fromkeys(FaultyTrainer.faults, False)
    model = make_llama(layers=2, hidden=64)
    args = training_args(out / "trainer", per_device_train_batch_size=PER_RANK, max_steps=STEPS)
    trainer = FaultyTrainer(
        model=model, args=args, train_dataset=RaggedText(), oomguard={"log_file": str(out / "events.jsonl")}
    )
    rank = args.process_index
    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)
        trainer.gpu = gpu
        trainer.train()
    ooms = [e for e in trainer.oomguard.events if e.kind == "oom"]
    report = {
        "global_step": trainer.state.global_step,
        "fired": FaultyTrainer.fired,
        "ooms": [{"step": e.step, "phase": e.error.phase, "type": e.error.error_type} for e in ooms],
        "plan": trainer.oomguard.plan.to_dict(),
        "adam_steps": sorted({int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s}),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
    }
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights{rank}.pt")
    (out / f"report{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    print(f"[rank {rank}] done: global_step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    if sys.argv[2:3] == ["sweep"]:
        sweep_main(Path(sys.argv[1]), int(sys.argv[3]))
    else:
        main(Path(sys.argv[1]), sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (torch 2.13's gloo teardown can abort a finished rank: see tests/test_examples.py)
