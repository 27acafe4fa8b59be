"""One rank of a two-rank OOMGuardTrainer job under torchrun, run by tests/test_trainer_ddp.py.

`torchrun --standalone --nproc_per_node 2 tests/ddp_trainer_worker.py OUT [PHASE@STEP ...]`: the Trainer wraps a
tiny Llama in DDP through Accelerate (gloo on CPU), each rank under its own roomy SimulatedGPU; rank 1 runs out of
memory once in each PHASE (forward, backward, clip, optimizer, or replay-clip: the clipping of a replay that an
OOM in the optimizer step started) of the Trainer's step STEP. Each rank writes its
report (global_step, the faults that fired, the guard's OOM events) and its weights to OUT.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.hf_trainer import RaggedText, training_args
from helpers.models import make_llama

from oomguard.integrations.transformers import OOMGuardTrainer
from oomguard.testing import SimulatedGPU

STEPS = 4
PER_RANK = 8  # the Trainer's per_device_train_batch_size: a global batch of 16 over two ranks


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
    main(Path(sys.argv[1]), sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (torch 2.13's gloo teardown can abort a finished rank: see tests/test_examples.py)
