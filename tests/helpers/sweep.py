"""The fault-sweep harness, and one rank of a two-rank gloo fault sweep.

Imported by tests/test_fault_sweep.py (and test_reliability.py, test_master_weights.py), it runs one guarded
training step from a saved state with one simulated out-of-memory error armed at a chosen device allocation
(``SimulatedGPU.fail_allocation``), and compares what the step left behind with a fault-free reference. Run as
``python tests/helpers/sweep.py RANK WORLD PORT OUT MODE`` (by tests/test_fault_sweep.py through
:func:`helpers.launch.launch`), it does the same under DDP on two gloo ranks, with every fault on rank 1, and
writes what it found to ``OUT/sweep<RANK>.json``.

What one faulted step is checked for (:func:`problems`), against a fault-free run of the same step:

* the fault fired inside the step, and the guard caught exactly that one out-of-memory error;
* weights, optimizer state (Adam's moments and step counts), scheduler state and GradScaler state equal, bit for
  bit, those of a fault-free step on the plan the guard recovered on; and, within a stated tolerance, those of a
  fault-free step on the plan it started from;
* the attempt that succeeded saw every sample of the batch exactly once;
* Adam's step count went up by exactly one and the scheduler advanced exactly once;
* device memory in use after the step equals the reference's, and after each recovery it was back to (at most)
  what it was when the call began.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __name__ == "__main__":  # a rank's script: the helpers package is imported from tests/, not from this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from helpers.batches import ragged_lm_batch
from helpers.devices import CountingGPU
from helpers.models import make_llama, make_qwen2
from oomguard import OOMEvent, OOMGuard, Plan, StepResult
from oomguard._effects.hoststep import HostStep
from oomguard._planner.fakes import _collector_paused

CAPACITY = "64MiB"  # roomy: the only out-of-memory errors are the injected ones
MAX_GRAD_NORM = 0.05  # small enough that clipping really rescales the gradients
STEPS = 2  # step 0 builds Adam's state lazily; step 1 is a steady-state step


def rung_configs(blocks: int) -> dict[str, Plan]:
    """One plan per rung configuration, for a model with ``blocks`` repeated blocks. A plan's rungs are forced;
    recovery from an injected fault then goes down the default ladder."""
    return {
        "whole batch": Plan(),
        "micro-batches": Plan(micro_batch_size=2),
        "amp bf16": Plan(precision="bf16"),
        "amp fp16 + GradScaler": Plan(precision="fp16"),
        "checkpointing partial": Plan(checkpointing="partial"),
        "checkpointing full": Plan(checkpointing="full"),
        "activation offload": Plan(activation_offload=True),
        "optimizer offload": Plan(optimizer_offload=True),
        "optimizer offload, master weights": Plan(precision="bf16", optimizer_offload="master"),
        "quantized optimizer": Plan(quantized_optimizer=True),
        "layer offload": Plan(offload_layers=blocks - 1),
        "every rung": Plan(
            micro_batch_size=2,
            precision="bf16",
            checkpointing="full",
            activation_offload=True,
            optimizer_offload=True,
            offload_layers=blocks,
        ),
    }


# -- the workloads: small models with repeated blocks, and batches whose samples carry ids ----------------------


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class TinyNet(torch.nn.Module):
    """Three repeated blocks (what checkpointing and layer offload work on) between an input and a head."""

    def __init__(self, width: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, width)
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(blocks)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x).squeeze(-1)
        return out


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyNet()


def _tiny_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets, and each sample's id (unique across steps)."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.arange(step * size, (step + 1) * size)
    return torch.randn(size, 4, generator=generator), torch.randn(size, generator=generator), ids


def _tiny_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _llama_batch(step: int, size: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences of different lengths, one with a masked prompt: token weighting matters."""
    lengths = [12 - (5 * row + 3 * step) % 9 for row in range(size)]
    batch = ragged_lm_batch(lengths, seq_len=12, seed=step)
    batch["labels"][0, :4] = -100  # a prompt the loss leaves out
    batch["ids"] = torch.arange(step * size, (step + 1) * size)
    return batch


def _llama_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    loss: torch.Tensor = output.loss
    return loss


@dataclass(frozen=True)
class Workload:
    """A model, its batches (samples carry ids in ``ids``), and the user's forward-only step."""

    name: str
    make_model: Callable[[], torch.nn.Module]
    make_batch: Callable[[int, int], Any]  # (step, batch size) -> batch
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    ids: Callable[[Any], torch.Tensor]
    batch_size: int  # odd where possible, so micro-batches of 2 are uneven
    blocks: int

    def batch(self, step: int, size: int | None = None) -> Any:
        return self.make_batch(step, size or self.batch_size)


TINY = Workload("TinyNet (3 blocks)", _tiny_model, _tiny_batch, _tiny_loss, lambda batch: batch[2], 5, 3)
LLAMA = Workload(
    "Llama (2 layers, hidden 32)",
    lambda: make_llama(layers=2, hidden=32),
    _llama_batch,
    _llama_loss,
    lambda batch: batch["ids"],
    4,
    2,
)


def _frozen_llama() -> torch.nn.Module:
    """The Llama with its attention projections frozen, as a LoRA job's base model is (the rest trains)."""
    model = make_llama(layers=2, hidden=32)
    for name, param in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            param.requires_grad_(False)
    return model


#: For the quantized_weights rung, which needs frozen linear weights.
FROZEN_LLAMA = Workload(
    "Llama (2 layers, hidden 32), attention frozen", _frozen_llama, _llama_batch, _llama_loss,
    lambda batch: batch["ids"], 4, 2,
)  # fmt: skip


#: For the chunked_loss rung: a causal LM whose head and loss it patches (vocabulary 2,048, tied embeddings), on
#: the Llama's ragged batches (labels -100 on pads and on a prompt).
QWEN2 = Workload(
    "Qwen2 (2 layers, hidden 32, vocabulary 2048, tied)", make_qwen2, _llama_batch, _llama_loss,
    lambda batch: batch["ids"], 4, 2,
)  # fmt: skip

#: The chunked loss alone, and with micro-batches (each micro-batch's loss in chunks, weighted by its tokens).
CHUNKED_CONFIGS = {
    "chunked loss": Plan().with_level("chunked_loss", 1),
    "micro-batches, chunked loss": Plan(micro_batch_size=2).with_level("chunked_loss", 1),
}
#: A chunk's fp32 logits at most this many bytes in the swept steps: 16 rows of the Qwen2's 2,048 logits, so a
#: step's 48 tokens take 3 chunks (a micro-batch's 24 take 2), each chunk's allocations faulted in turn.
CHUNK_BYTES = 4 * 2048 * 16


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over two groups (torch builds Adam's state group by group), foreach (in place, then temporaries)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups: list[dict[str, Any]] = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, foreach=True)


def _decay(step: int) -> float:
    return 1.0 / (1.0 + step)  # the learning rate changes every step: a doubled or lost scheduler step shows


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _decay)


def share(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """One rank's share of a global tuple batch (rows rank, rank + world, ...)."""
    return tuple(t[rank::world].contiguous() for t in batch)


# -- state, one step, and what it left ----------------------------------------------------------------------------


def clone_state(value: Any) -> Any:
    """A deep copy whose tensors are fresh host tensors (never aliases of live training state)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: clone_state(item) for key, item in value.items()}
    if isinstance(value, list):
        return [clone_state(item) for item in value]
    if isinstance(value, tuple):
        return tuple(clone_state(item) for item in value)
    return copy.deepcopy(value)


@dataclass(frozen=True)
class Snapshot:
    """Everything a training step changes: weights, optimizer, scheduler, the committed GradScaler state."""

    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None

    @classmethod
    def of(cls, model: torch.nn.Module, optimizer: Any, scheduler: Any, guard: OOMGuard | None) -> Snapshot:
        scaler = guard.effects._scaler_state if guard is not None else None
        return cls(
            clone_state(model.state_dict()),
            clone_state(optimizer.state_dict()),
            clone_state(scheduler.state_dict()),
            clone_state(scaler),
        )


@contextlib.contextmanager
def young_garbage_only(warm_up: Callable[[], object]) -> Iterator[None]:
    """Freeze every object that exists (after ``warm_up`` has made torch load what it loads lazily), so that the
    guard's ``gc.collect()`` on each recovery scans only what the steps create since (a failed attempt's frames
    and graph among them) instead of all of torch and transformers: several times faster, and nothing the guard
    must free is frozen. Unfrozen on exit."""
    warm_up()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: No garbage collection but the guard's explicit ``gc.collect()``: what a failed attempt leaves in reference cycles
#: is then still in use after the step unless the guard collected it, whatever the collector's timing (the pause the
#: guard's dry runs run under, the collector as it was after).
automatic_gc_off = _collector_paused


class PhaseGPU(CountingGPU):
    """A SimulatedGPU that also records, for every device allocation, the phase of the step it was made in
    (``"outside"`` before the first attempt), and the memory in use as each attempt begins."""

    def __init__(self, capacity: int | str) -> None:
        self.phases: list[str] = []
        self.phase: Callable[[], str] = lambda: "outside"
        self.attempt_bases: list[int] = []
        super().__init__(capacity)

    def counted(self, before: int, after: int) -> None:
        phase = self.phase() if self.attempt_bases else "outside"
        self.phases.extend([phase] * (after - before))

    def reset_peak_memory_stats(self) -> None:
        self.attempt_bases.append(self.memory_allocated())  # each attempt starts here (oomguard/_step/runner.py)
        super().reset_peak_memory_stats()


@dataclass
class Outcome:
    """What one guarded call did and left behind."""

    result: StepResult
    after: Snapshot
    parameters: int
    adam_steps: list[int]  # Adam's step count of every parameter that has state
    grads_left: int  # parameters still holding a gradient after the call (the guard owns zero_grad)
    memory_before: int
    memory_after: int
    phases: list[str]  # the phase of each allocation the call made (1-based index i is phases[i - 1])
    fired: bool
    ooms: list[OOMEvent]
    seen: dict[int, list[int]]  # attempt (0-based) -> sample ids the step function saw in it

    @property
    def allocations(self) -> int:
        return len(self.phases)


#: A call's device figures: memory in use as its first attempt began, in use after it, each allocation's phase.
Figures = tuple[int, int, list[str]]


@dataclass
class Rig:
    """A model, optimizer, scheduler and guard built afresh from a saved state, on a fresh simulated device; the
    OOM events the guard reported and, per attempt (counted by those events), the sample ids the step saw."""

    gpu: PhaseGPU
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    guard: OOMGuard
    ooms: list[OOMEvent]
    seen: dict[int, list[int]]

    def enter(self) -> None:
        """Inside the device's context: the model and optimizer are on it, and allocations record their phase."""
        self.gpu.adopt(self.model, self.optimizer)
        self.gpu.phase = lambda: self.guard._runner.progress.phase

    def call(self, batch: Any) -> tuple[StepResult, Figures]:
        """One guarded call, only the guard's own gc.collect() freeing reference cycles; with the device's
        figures for the call: memory when its first attempt began, in use after it, each allocation's phase."""
        start, bases = self.gpu.allocations, len(self.gpu.attempt_bases)
        with automatic_gc_off():  # only the guard's own gc.collect() frees what sits in reference cycles
            result = self.guard(batch)
        # Under DDP the first call allocates the agreement buffer before its first attempt begins.
        return result, (self.gpu.attempt_bases[bases], settled_memory(self.gpu), self.gpu.phases[start:])

    def outcome(self, result: StepResult, figures: Figures, fired: bool) -> Outcome:
        """What the call left (outside the device's context: the copies are not device allocations)."""
        parameters = [p for p in self.model.parameters() if p.requires_grad]  # (frozen ones have no Adam state)
        adam_steps = [int(s["step"]) for s in self.optimizer.state.values()]
        grads_left = sum(p.grad is not None for p in parameters)
        after = Snapshot.of(self.model, self.optimizer, self.scheduler, self.guard)
        before, memory_after, phases = figures
        return Outcome(
            result, after, len(parameters), adam_steps, grads_left, before, memory_after, phases, fired, self.ooms,
            dict(self.seen),
        )  # fmt: skip


def settled_memory(gpu: PhaseGPU) -> int:
    """Device memory in use after a call, once the collectives' tensors are let go: under torch.distributed, gloo's
    thread drops a finished collective's tensors a little after the wait on it returned, and on a loaded machine (a
    test beside this one) later still (the guard's recovery waits for the same: ``_settle``). Memory still in use
    after 20 ms is what the sweep looks for; a process of one rank reads it at once."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for _ in range(10):
            time.sleep(0.002)
    return gpu.memory_allocated()


def make_rig(
    state: Snapshot,
    plan: Plan,
    *,
    workload: Workload = TINY,
    gpu: PhaseGPU | None = None,
    ladder: Iterable[str] | None = None,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    on_event: Callable[[Any, PhaseGPU], None] | None = None,
    host_step: HostStep = "exact",
) -> Rig:
    """A fresh rig on ``plan`` from ``state`` (see :func:`run_step` for the arguments), on ``gpu`` if given."""
    gpu = gpu if gpu is not None else PhaseGPU(CAPACITY)
    model = workload.make_model()
    model.load_state_dict(state.model)
    trained = wrap(model) if wrap is not None else model
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    optimizer.load_state_dict(clone_state(state.optimizer))
    scheduler.load_state_dict(clone_state(state.scheduler))
    ooms: list[OOMEvent] = []
    seen: dict[int, list[int]] = defaultdict(list)

    def step(micro_batch: Any) -> torch.Tensor:
        seen[len(ooms)].extend(int(i) for i in workload.ids(micro_batch).tolist())  # this attempt saw these
        return workload.loss(trained, micro_batch)

    def sink(event: Any) -> None:
        if isinstance(event, OOMEvent):
            ooms.append(event)
        if on_event is not None:
            on_event(event, gpu)

    guard = OOMGuard(
        step,
        model=trained,
        optimizer=optimizer,
        scheduler=scheduler,
        max_grad_norm=MAX_GRAD_NORM,
        ladder=ladder,
        sinks=[sink],
        relax_after=None,
        host_step=host_step,  # ("exact" by default: compared with the user's loop bit for bit; see FUSED_TOLERANCE)
    )
    guard.plan = plan
    guard.effects._scaler_state = clone_state(state.scaler)  # the committed fp16 loss scale, as a running guard has it
    return Rig(gpu, model, optimizer, scheduler, guard, ooms, seen)


def run_step(
    state: Snapshot,
    batch: Any,
    plan: Plan,
    *,
    workload: Workload = TINY,
    fault: int | None = None,
    ladder: Iterable[str] | None = None,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    arm: Callable[[PhaseGPU, OOMGuard], None] | None = None,
    on_event: Callable[[Any, PhaseGPU], None] | None = None,
    host_step: HostStep = "exact",
) -> Outcome:
    """One guarded step from ``state`` on ``plan``, with an OOM armed at device allocation ``fault`` (1-based).

    Every call builds its model, optimizer, scheduler and guard afresh from ``state``, so faults never leak into
    each other. ``ladder=[]`` runs ``plan`` alone (a reference); the default ladder recovers. ``wrap`` wraps the
    model (DDP); ``arm`` (before the call) and ``on_event`` (on each event the guard emits, in recovery too) can
    inject further faults. ``host_step`` is the guard's (``"fused"``: torch's fused CPU Adam steps what the plan
    steps on the host).
    """
    rig = make_rig(state, plan, workload=workload, ladder=ladder, wrap=wrap, on_event=on_event, host_step=host_step)
    with rig.gpu:
        rig.enter()
        if fault is not None:
            rig.gpu.fail_allocation(fault)
        if arm is not None:
            arm(rig.gpu, rig.guard)
        result, figures = rig.call(batch)
        fired = not rig.gpu.fault_pending
    outcome = rig.outcome(result, figures, fired)
    # The guard is dropped in a reference cycle: collected here, outside every SimulatedGPU, it undoes its effects
    # on the CPU. Left to the next call's recovery (the guard's gc.collect()), a guard whose effects hold weights
    # (quantized_weights, amp's frozen base) gave them back under that call's device, which counted them (+16 KiB
    # "in use after the step" for a fault at the Llama's last forward allocation).
    del rig
    gc.collect()
    return outcome


def initial_state(workload: Workload = TINY) -> Snapshot:
    model = workload.make_model()
    optimizer = make_optimizer(model)
    state = Snapshot.of(model, optimizer, make_scheduler(optimizer), None)
    # fp16 plans start from a loss scale of 2^8, not torch's 2^16, at which these tiny models' scaled gradients
    # overflow and the GradScaler skips the step by design: every step here is a real optimizer step.
    return dataclasses.replace(state, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8).state_dict())


# -- comparing ------------------------------------------------------------------------------------------------


def differences(a: Any, b: Any, path: str = "", tolerance: float = 0.0) -> list[str]:
    """Where two nested states differ: tensors bit for bit (or within ``tolerance``, relative and absolute),
    everything else by ==."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}"]
        if tolerance == 0.0 or not a.is_floating_point():
            same = torch.equal(a, b)
        else:
            same = torch.allclose(a, b, rtol=tolerance, atol=tolerance)
        return [] if same else [f"{path}: differs by up to {(a.double() - b.double()).abs().max().item():.3g}"]
    if isinstance(a, Snapshot) and isinstance(b, Snapshot):
        return [
            d
            for name in ("model", "optimizer", "scheduler", "scaler")
            for d in differences(getattr(a, name), getattr(b, name), name, tolerance)
        ]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for key in a for d in differences(a[key], b[key], f"{path}[{key!r}]", tolerance)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]", tolerance)
        ]
    if isinstance(a, float) and isinstance(b, float) and tolerance:
        return [] if abs(a - b) <= tolerance * max(abs(a), abs(b)) else [f"{path}: {a!r} != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


# Micro-batching changes the order in which float gradients are summed (accumulated per micro-batch, weighted),
# so a step recovered on micro-batches equals a whole-batch step only up to rounding: weights within 1e-5
# relative and absolute (a thousandth of one Adam step at lr 1e-2). Adam's first step divides a gradient by its
# own magnitude plus eps, so a rounding change in a gradient that cancels to near eps moves its weight by far
# more than the rounding itself: fault-free steps of the test Llama on micro-batches of 1 and of 2 differ by up to
# 1.4e-6 in one weight with transformers 5.24 (a tenth of this bound was enough with earlier releases). A lost or
# doubled sample is caught by the bit-for-bit comparison with the same plan and by the sample ids, not by this
# one. Everything else is compared bit for bit.
MICRO_BATCH_TOLERANCE = 1e-5


def problems(
    outcome: Outcome,
    *,
    ooms: int,
    same_plan: Outcome,
    intended: Outcome,
    step: int,
    sample_ids: list[int],
) -> list[str]:
    """Everything wrong with a step that met ``ooms`` out-of-memory errors, compared with fault-free steps on the
    plan it recovered on (``same_plan``) and on the plan it started from (``intended``). Empty when recovery
    lost nothing."""
    found: list[str] = []
    result = outcome.result
    if not outcome.fired:
        found.append("the injected fault never fired")
    if result.ooms != ooms:
        found.append(f"{result.ooms} OOM(s) caught, {ooms} expected")
    final = outcome.seen.get(result.ooms, [])
    if sorted(final) != sorted(sample_ids):
        found.append(f"the successful attempt saw samples {sorted(final)}, not {sorted(sample_ids)}")
    found += [f"vs fault-free on {result.plan.describe()}: {d}" for d in differences(outcome.after, same_plan.after)]
    plan = intended.result.plan
    # A recovery into amp, into or out of bf16 master weights or 8-bit optimizer state, changes the maths by design.
    masters = (result.plan.optimizer_offload == "master", plan.optimizer_offload == "master")
    same_maths = result.plan.precision == plan.precision and masters[0] == masters[1]
    same_maths = same_maths and result.plan.quantized_optimizer == plan.quantized_optimizer
    same_maths = same_maths and result.plan.quantized_weights == plan.quantized_weights
    split_differently = result.micro_batch_size != intended.result.micro_batch_size
    # A recovery into (or out of) the chunked loss sums the loss and the head's gradient chunk by chunk: as exact as
    # micro-batches are, in a different float summation order.
    split_differently = split_differently or result.plan.level("chunked_loss") != plan.level("chunked_loss")
    # In half precision every micro-batch's products round on their own: only the same-plan comparison is exact.
    if same_maths and not (split_differently and plan.precision is not None):
        tolerance = MICRO_BATCH_TOLERANCE if split_differently else 0.0
        found += [
            f"vs fault-free on {plan.describe()}: {d}"
            for d in differences(outcome.after.model, intended.after.model, "weights", tolerance)
        ]
    if len(outcome.adam_steps) != outcome.parameters or any(count != step + 1 for count in outcome.adam_steps):
        found.append(f"Adam step counts {outcome.adam_steps} after step {step}")
    if outcome.grads_left:
        found.append(f"{outcome.grads_left} parameter(s) still hold a gradient after the step")
    if outcome.after.scheduler["last_epoch"] != step + 1:
        found.append(f"the scheduler is at {outcome.after.scheduler['last_epoch']} after step {step}")
    if outcome.memory_after != same_plan.memory_after:
        found.append(f"{outcome.memory_after - same_plan.memory_after:+d} bytes in use after the step")
    for event in outcome.ooms:
        freed = event.memory_after_recovery.allocated
        # Layer offload moves weights to the host as the plan is applied, optimizer offload the optimizer's state
        # (the step counters Adam made since, too), 8-bit state and weights shrink them: less in use is then expected.
        offloading = event.plan["offload_layers"] > 0 or plan.offload_layers > 0
        offloading = offloading or event.plan["optimizer_offload"] or plan.optimizer_offload
        offloading = offloading or event.plan["quantized_optimizer"] or plan.quantized_optimizer
        offloading = offloading or event.plan["quantized_weights"] or plan.quantized_weights
        if freed > outcome.memory_before or (not offloading and freed != outcome.memory_before):
            found.append(f"{freed - outcome.memory_before:+d} bytes in use after recovering from {event.error.phase}")
    return found


Sample = Callable[[int, list[str]], list[int]]  # (step, phase of each allocation) -> 1-based indices to fault


def every_allocation(step: int, phases: list[str]) -> list[int]:
    """The full sweep: every allocation of every step (made by an attempt: under DDP the guard's first call
    allocates its agreement buffer before)."""
    return [i for i, phase in enumerate(phases, 1) if phase != "outside"]


def _edges(phases: list[str], first: bool = True, last: bool = True) -> set[int]:
    picked: set[int] = set()
    for phase in set(phases) - {"outside"}:
        where = [i for i, p in enumerate(phases, 1) if p == phase]
        picked |= ({where[0]} if first else set()) | ({where[-1]} if last else set())
    return picked


def phase_edges(step: int, phases: list[str]) -> list[int]:
    """The default run's sample: in the first step (Adam builds its state) the first and last allocation of every
    phase; in later steps the first allocation of the optimizer step (in place updates, then temporaries)."""
    if step == 0:
        return sorted(_edges(phases))
    # (a step on the host makes no device allocation in a later optimizer step: the host sweep faults it)
    return [phases.index("optimizer") + 1] if "optimizer" in phases else []


def phase_ends(step: int, phases: list[str]) -> list[int]:
    """A lighter sample for slow configurations: the last allocation of every phase (of the first step only:
    sweep it with ``steps=1``)."""
    return sorted(_edges(phases, first=False)) if step == 0 else []


@dataclass
class Sweep:
    """What a sweep injected and found: per fault, the step, the allocation index, its phase, the problems."""

    faults: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def injected(self) -> int:
        return len(self.faults)

    @property
    def survived(self) -> int:
        return sum(not fault["problems"] for fault in self.faults)

    def by_phase(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for fault in self.faults:
            counts[fault["phase"]] = counts.get(fault["phase"], 0) + 1
        return counts


def sweep(
    plan: Plan,
    sample: Sample,
    *,
    workload: Workload = TINY,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    part: Callable[[Any], Any] | None = None,
    choose: Callable[[list[int]], list[int]] | None = None,
    faulted: bool = True,
    steps: int = STEPS,
    host_step: HostStep = "exact",
) -> Sweep:
    """Inject one OOM at each sampled allocation of each of the first ``steps`` steps on ``plan`` (each run from
    the fault-free state before that step), and check every one with :func:`problems`. Under DDP, ``part`` takes
    this rank's share of a batch, ``choose`` agrees on the indices and ``faulted=False`` runs a rank that only
    sees its peer's faults. Every guard (faulted and fault-free) steps the host with ``host_step``; with
    ``"fused"`` each fault-free step is also compared with the user's own loop (``"exact"``) within
    :data:`FUSED_TOLERANCE`."""
    report = Sweep()
    state = initial_state(workload)
    for step in range(steps):
        batch = workload.batch(step)
        if part is not None:
            batch = part(batch)
        ids = [int(i) for i in workload.ids(batch).tolist()]
        intended = run_step(state, batch, plan, workload=workload, ladder=[], wrap=wrap, host_step=host_step)
        if host_step != "exact":
            report.failures += _off_the_loop(state, batch, plan, workload, wrap, intended, step)
        if gc.get_freeze_count():  # inside young_garbage_only: freeze what this plan made torch load lazily too
            gc.collect()
            gc.freeze()
        report.failures += [
            f"fault-free step {step}: {p}"
            for p in problems(intended, ooms=0, same_plan=intended, intended=intended, step=step, sample_ids=ids)
        ]
        picked = sample(step, intended.phases)
        if choose is not None:
            picked = choose(picked)
        references = {intended.result.plan: intended}
        # Memory after recovery, for faults after the plan was applied: as its effects made it, every time. (An
        # apply that fails part-way may leave a consistent deeper configuration to retry from, as layer offload and
        # 8-bit weights do layer by layer: never more than before the attempt, which problems() checks.)
        freed: dict[int, list[int]] = {}
        for index in picked:
            fault = index if faulted else None
            outcome = run_step(state, batch, plan, workload=workload, fault=fault, wrap=wrap, host_step=host_step)
            final = outcome.result.plan
            if final not in references:  # under DDP every rank recovers on the same plan: all get here together
                references[final] = run_step(
                    state, batch, final, workload=workload, ladder=[], wrap=wrap, host_step=host_step
                )
            found = problems(outcome, ooms=1, same_plan=references[final], intended=intended, step=step, sample_ids=ids)
            phase = intended.phases[index - 1] if faulted else "peer"
            report.faults.append(
                {
                    "step": step,
                    "index": index,
                    "phase": phase,
                    "reported_phase": outcome.ooms[0].error.phase if outcome.ooms else None,
                    "error": outcome.ooms[0].error.error_type if outcome.ooms else None,
                    "plan": final.describe(),
                    "digest": [float(v.double().sum()) for v in outcome.after.model.values()],
                    "problems": found,
                }
            )
            report.failures += [f"step {step}, allocation {index} ({phase}): {p}" for p in found]
            if outcome.ooms and outcome.ooms[0].error.phase != "apply":
                freed.setdefault(outcome.ooms[0].memory_after_recovery.allocated, []).append(index)
        if len(freed) > 1:  # recovery frees all a failed attempt made, however far it got: the same every time
            report.failures.append(f"step {step}: in use after recovery (bytes: allocations faulted) {freed}")
        state = intended.after
    return report


# torch's fused CPU Adam (``host_step="fused"``) orders its float operations otherwise than the user's loop: the
# weights of a fault-free fused step are within this (relative and absolute) of the loop's, as in
# tests/test_host_step.py (1e-6 of the norm there). Faulted fused steps are compared with fault-free fused ones bit for
# bit: the same kernel on the same values.
FUSED_TOLERANCE = 1e-6


def _off_the_loop(
    state: Snapshot,
    batch: Any,
    plan: Plan,
    workload: Workload,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None,
    fused: Outcome,
    step: int,
) -> list[str]:
    """How a fault-free fused step differs from the user's loop (``host_step="exact"``) beyond rounding."""
    exact = run_step(state, batch, plan, workload=workload, ladder=[], wrap=wrap)
    found = differences(fused.after.model, exact.after.model, "weights", FUSED_TOLERANCE)
    found += differences(fused.after.optimizer, exact.after.optimizer, "optimizer", FUSED_TOLERANCE)
    return [f"fault-free step {step}, fused vs the loop: {d}" for d in found]


# -- one rank of the distributed sweep ------------------------------------------------------------------------

#: The rung configurations swept under DDP (layer offload under DDP is otherwise untested).
DIST_CONFIGS = ("whole batch", "micro-batches", "checkpointing full", "layer offload")
# The sampled run's: from the whole batch a fault in forward or backward recovers on micro-batches, one in
# clipping or the optimizer step into layer offload; with layer offload engaged, the failed attempt itself has
# moved weights to the host, so memory in use drops below where the attempt began even if the attempt's
# activations were still held (they were, under DDP, until a reference cycle was broken in oomguard/_step/runner.py).
DEFAULT_DIST_CONFIGS = ("whole batch", "layer offload")


def distributed_sweep(
    name: str,
    mode: str,
    workload: Workload,
    wrap: Callable[[torch.nn.Module], torch.nn.Module],
    part: Callable[[Any], Any],
    choose: Callable[[list[int]], list[int]],
    rank: int,
) -> dict[str, Any]:
    plan = rung_configs(TINY.blocks)[name]
    sample, steps = (every_allocation, STEPS) if mode == "full" else (phase_ends, 1)
    result = sweep(plan, sample, workload=workload, wrap=wrap, part=part, choose=choose, faulted=rank == 1, steps=steps)
    return {"faults": result.faults, "failures": result.failures}


def distributed_main(rank: int, world: int, init_method: str, out: Path, mode: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    started = time.monotonic()

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.parallel.DistributedDataParallel(model)

    def part(batch: Any) -> Any:  # the global batch has 2 x 5 samples: each rank trains on 5
        return share(batch, rank, world)

    def choose(picked: list[int]) -> list[int]:  # rank 1 is the faulted one: its step's allocations count
        box = [picked]
        dist.broadcast_object_list(box, src=1)
        return list(box[0])

    global_batch = dataclasses.replace(TINY, batch_size=2 * TINY.batch_size)
    configs = DIST_CONFIGS if mode == "full" else DEFAULT_DIST_CONFIGS
    warm_up = part(global_batch.batch(0))
    fault = 5 if rank == 1 else None
    with young_garbage_only(lambda: run_step(initial_state(), warm_up, Plan(), wrap=wrap, fault=fault)):
        report = {name: distributed_sweep(name, mode, global_batch, wrap, part, choose, rank) for name in configs}
    (out / f"sweep{rank}.json").write_text(json.dumps({"configs": report, "seconds": time.monotonic() - started}))
    dist.barrier()  # leaving while a peer still talks can abort it
    # No destroy_process_group: the caller leaves with os._exit, and torch 2.13's gloo teardown is where a
    # finished job can hang or abort (see tests/test_examples.py)


if __name__ == "__main__":
    distributed_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
    # Done and written: leave without the interpreter's shutdown, where torch 2.13's gloo can abort a finished
    # rank (its run-loop thread frees a collective's tensors and needs the GIL as the interpreter goes away:
    # "terminate called without an active exception"; see tests/test_examples.py). An error above still exits 1.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
