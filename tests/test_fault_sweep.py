"""Fault sweep: one simulated out-of-memory error at allocation after allocation of a guarded training step.

For every rung configuration, a fault is armed with ``SimulatedGPU.fail_allocation`` at one device allocation
of a step (forward, backward, micro-batch accumulation, clipping, Adam's optimizer step including its lazily
built first-step state, the scheduler, the fp16 GradScaler), the guard recovers down the default ladder, and
what the step left behind is compared with fault-free runs (tests/helpers/sweep.py, ``problems``): the same
weights, optimizer, scheduler and scaler state bit for bit, every sample seen exactly once by the attempt that
succeeded, one Adam step and one scheduler step, and device memory back to where it belongs.

``-m slow`` sweeps every allocation: of two steps of a tiny block MLP (the first, when Adam builds its state,
and a steady-state one) on every configuration, of the first step of a tiny transformers Llama, of the first
step of a tiny Qwen2 on the chunked_loss rung (alone and with micro-batches), and of two steps on one of two gloo
ranks. The default run samples the edges of every phase (see ``DEFAULT_SAMPLES``). A PEFT LoRA's and a QLoRA's
first step (adapters on a bitsandbytes NF4 base) are swept at the last allocation of each phase (``-m slow``: the
edges of every phase of two steps). Double faults (an OOM while the guard is recovering from one) are at the end.

Host faults (``SimulatedGPU.fail_host_allocation``: a failed pinned allocation, a host ``MemoryError``) on the
offload rungs' plans are swept too (tests/helpers/hostsweep.py): host memory is not relieved down the ladder, so
the call must raise ``HostMemoryError`` with nothing committed and nothing held, and the same batch must train
exactly once called again. ``-m slow`` fails every host allocation of the TinyNet's first two steps and the step
after them on a running guard, and of a Llama's first two with its masters on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helpers.hostsweep
import helpers.qlora
import helpers.sweep
import pytest
import torch
from helpers.hostsweep import (
    HOST_CONFIGS,
    every_host_allocation,
    host_allocations,
    host_edges,
    host_ends,
    host_fault_step,
    host_problems,
    host_sweep,
)
from helpers.launch import RANKS, launch
from helpers.sweep import (
    CHUNK_BYTES,
    CHUNKED_CONFIGS,
    DEFAULT_DIST_CONFIGS,
    DIST_CONFIGS,
    FROZEN_LLAMA,
    LLAMA,
    QWEN2,
    TINY,
    Outcome,
    PhaseGPU,
    Sample,
    Snapshot,
    Sweep,
    Workload,
    every_allocation,
    initial_state,
    phase_edges,
    phase_ends,
    problems,
    run_step,
    rung_configs,
    sweep,
    young_garbage_only,
)

from oomguard import FallbackEvent, OOMGuard, Plan
from oomguard._detect import is_oom
from oomguard._distributed.agreement import Agreement
from oomguard._effects.early import EarlyStep
from oomguard._effects.hoststep import HostStep
from oomguard.testing import SimulatedGPU

TINY_CONFIGS = rung_configs(TINY.blocks)
LLAMA_CONFIGS = rung_configs(LLAMA.blocks)
# The full sweep's figures go here (one line per configuration) when OOMGUARD_SWEEP_FIGURES names a file.
FIGURES = os.environ.get("OOMGUARD_SWEEP_FIGURES")


def _warm_up() -> None:
    for name in ("layer offload", "amp fp16 + GradScaler"):
        run_step(initial_state(), TINY.batch(0), TINY_CONFIGS[name], fault=1)


@pytest.fixture(scope="module", autouse=True)
def _young_garbage_only() -> Iterator[None]:
    """The guard's gc.collect() on every recovery scans only what the steps make (see helpers.sweep)."""
    with young_garbage_only(_warm_up):
        yield


def record(workload: Workload, name: str, result: Sweep, seconds: float) -> None:
    if FIGURES is None:
        return
    phases = ", ".join(f"{phase} {count}" for phase, count in sorted(result.by_phase().items()))
    line = (
        f"{workload.name} | {name} | {result.injected} injected | {result.survived} survived | "
        f"phases: {phases} | {seconds:.0f} s\n"
    )
    with Path(FIGURES).open("a", encoding="utf-8") as figures:
        figures.write(line)


def check_sweep(
    workload: Workload,
    name: str,
    plan: Plan,
    sample: Sample,
    phases: set[str],
    steps: int = 2,
    host_step: HostStep = "exact",
) -> None:
    started = time.monotonic()
    result = sweep(plan, sample, workload=workload, steps=steps, host_step=host_step)
    record(workload, name, result, time.monotonic() - started)
    assert not result.failures, "\n".join(result.failures[:20])
    assert result.survived == result.injected > 0
    # Every phase asked for was hit (forward, backward with the accumulation, clipping, the optimizer step...).
    # At the master level clipping allocates nothing on the device: it runs on the fp32 gradients on the host.
    if plan.optimizer_offload == "master":
        phases = phases - {"clip"}
    assert phases <= set(result.by_phase())


PHASES = {"forward", "backward", "clip", "optimizer"}


# Each default-run configuration, and its sample: the first and last allocation of every phase of the first step
# and the first of a steady-state optimizer step; for every rung at once (10x slower per fault) the last
# allocation of every phase of the first step.
DEFAULT_SAMPLES: dict[str, Sample] = dict.fromkeys(TINY_CONFIGS, phase_edges)
DEFAULT_SAMPLES["every rung"] = phase_ends


@pytest.mark.parametrize("name", DEFAULT_SAMPLES)
def test_an_oom_at_sampled_allocations_of_a_step_loses_nothing(name: str) -> None:
    sample = DEFAULT_SAMPLES[name]
    check_sweep(TINY, name, TINY_CONFIGS[name], sample, PHASES, steps=1 if sample is phase_ends else 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_an_oom_at_every_allocation_of_a_step_loses_nothing(name: str) -> None:
    check_sweep(TINY, name, TINY_CONFIGS[name], every_allocation, PHASES)


# The fused host step (host_step="fused", the guard's default for Adam and AdamW: torch's fused CPU kernel steps what
# the plan keeps on the host), on both levels of optimizer_offload: the master level's stepped weights go up to the
# device bucket by bucket as the host step goes on (here a bucket a parameter). Every guard of these sweeps, faulted
# and fault-free, steps fused, and each fault-free step is compared with the user's loop within rounding
# (helpers.sweep.FUSED_TOLERANCE); the faulted ones with the fault-free ones bit for bit, as above. The others above
# step with host_step="exact".
FUSED_CONFIGS = {name: TINY_CONFIGS[name] for name in ("optimizer offload", "optimizer offload, master weights")}


def _fused_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of torch's fused AdamW kernel (the sweeps' optimizer is AdamW)."""
    calls: list[int] = []
    kernel = torch._fused_adamw_

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    return calls


def check_fused_sweep(name: str, sample: Sample, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every parameter a bucket of its own: each goes up before the next steps (oomguard/_effects/ascent.py).
    monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", 1)
    calls = _fused_kernel_calls(monkeypatch)
    check_sweep(TINY, f"{name}, fused host step", FUSED_CONFIGS[name], sample, PHASES, host_step="fused")
    assert calls, "torch's fused CPU AdamW stepped the host"


@pytest.mark.parametrize("name", FUSED_CONFIGS)
def test_an_oom_at_sampled_allocations_of_a_step_with_the_fused_host_step_loses_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_fused_sweep(name, phase_edges, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", FUSED_CONFIGS)
def test_an_oom_at_every_allocation_of_a_step_with_the_fused_host_step_loses_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_fused_sweep(name, every_allocation, monkeypatch)


# The master level's host step begun during the last backward (oomguard/_effects/early.py): only without clipping,
# so these sweeps clip nothing. A fault later in that backward, after buckets stepped on the host thread, finds them
# undone; every guard steps fused, a bucket a parameter.
def check_early_sweep(sample: Sample, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", 1)
    monkeypatch.setattr("helpers.sweep.MAX_GRAD_NORM", None)
    begun: list[int] = []
    step = EarlyStep._step

    def counted(self: EarlyStep, *args: Any) -> None:
        begun.append(1)
        step(self, *args)

    monkeypatch.setattr(EarlyStep, "_step", counted)
    name = "optimizer offload, master weights"
    check_sweep(TINY, f"{name}, early host step", FUSED_CONFIGS[name], sample, PHASES - {"clip"}, host_step="fused")
    assert begun, "buckets stepped during the last backward"


def test_an_oom_at_sampled_allocations_of_a_step_begun_during_backward_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_early_sweep(phase_edges, monkeypatch)


@pytest.mark.slow
def test_an_oom_at_every_allocation_of_a_step_begun_during_backward_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_early_sweep(every_allocation, monkeypatch)


# The Llama's first step (Adam building its state), on every configuration but all rungs at once: ~400 to ~1500
# allocations each, at 0.2 to 0.5 s per fault.
LLAMA_SWEPT = [name for name in LLAMA_CONFIGS if name != "every rung"]
# On a model whose attention is frozen (FROZEN_LLAMA): its frozen projections in 8 bits, and in 4.
QUANTIZED_WEIGHTS = {"quantized weights": Plan(quantized_weights=True), "4-bit weights": Plan(quantized_weights="4bit")}


@pytest.mark.slow
@pytest.mark.parametrize("name", LLAMA_SWEPT)
def test_an_oom_at_every_allocation_of_a_llama_step_loses_nothing(name: str) -> None:
    check_sweep(LLAMA, name, LLAMA_CONFIGS[name], every_allocation, PHASES, steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", QUANTIZED_WEIGHTS)
def test_an_oom_at_every_allocation_of_a_step_with_quantized_frozen_weights_loses_nothing(name: str) -> None:
    check_sweep(FROZEN_LLAMA, name, QUANTIZED_WEIGHTS[name], every_allocation, PHASES, steps=1)


@pytest.mark.parametrize("name", QUANTIZED_WEIGHTS)
def test_an_oom_at_sampled_allocations_of_a_step_with_quantized_frozen_weights_loses_nothing(name: str) -> None:
    check_sweep(FROZEN_LLAMA, name, QUANTIZED_WEIGHTS[name], phase_edges, PHASES, steps=2)


def loss_edges(step: int, phases: list[str]) -> list[int]:
    """Where the chunked loss works (first step only): the forward's last allocation (in the loss's last chunk,
    after its gradients were made) and the backward's first (the loss's backward comes first)."""
    return [len(phases) - phases[::-1].index("forward"), phases.index("backward") + 1] if step == 0 else []


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 16 rows (not the 8 MiB floor, which would take a tiny step's loss in one): the sweep then fails
    the allocations of each chunk of the loss in turn, the last (shorter) one too."""
    monkeypatch.setattr("oomguard._effects.chunked_ce._FLOOR_BYTES", CHUNK_BYTES)


def check_chunked_sweep(name: str, sample: Sample, phases: set[str]) -> None:
    started = time.monotonic()
    result = sweep(CHUNKED_CONFIGS[name], sample, workload=QWEN2, steps=1)
    record(QWEN2, name, result, time.monotonic() - started)
    assert not result.failures, "\n".join(result.failures[:20])
    assert result.survived == result.injected > 0
    assert phases <= set(result.by_phase())
    # The retry kept the rung (the ladder goes on from the plan that has it): recovered steps were chunked too.
    assert all("chunked loss" in fault["plan"] for fault in result.faults), [f["plan"] for f in result.faults]


# The chunked_loss rung on a Qwen2 (its head and loss patched, the loss's chunks allocating in the forward): every
# allocation of the first step of the rung alone in the slow suite (455 faults, about 17 minutes on a loaded
# 2-core machine; with micro-batches as well it was 765 faults in 30 minutes, all survived, too long to keep); in the
# default run the edges of the loss, alone and with micro-batches (the other phases are the TinyNet's and the
# Llama's, swept above). Each swept step's loss takes several chunks (see ``small_chunks``).
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("name", CHUNKED_CONFIGS)
def test_an_oom_at_sampled_allocations_of_a_chunked_loss_step_loses_nothing(name: str) -> None:
    check_chunked_sweep(name, loss_edges, {"forward", "backward"})


@pytest.mark.slow
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("name", ["chunked loss"])
def test_an_oom_at_every_allocation_of_a_chunked_loss_step_loses_nothing(name: str) -> None:
    check_chunked_sweep(name, every_allocation, PHASES)


def llama_sample(step: int, phases: list[str]) -> list[int]:
    """Counting a micro-batch's labels, and Adam building its state: one fault each (first step only)."""
    return [phases.index("split") + 1, phases.index("optimizer") + 1]


def test_a_llama_step_survives_an_oom_in_the_transformers_paths() -> None:
    """Its own checkpointing API, labels counted per micro-batch after the causal shift, and token-weighted
    micro-batches of a ragged batch."""
    plan = Plan(micro_batch_size=2, checkpointing="partial")
    check_sweep(LLAMA, "micro-batches, checkpointing partial", plan, llama_sample, {"split", "optimizer"}, steps=1)


# -- adapters: a PEFT LoRA, and a QLoRA (PEFT's adapters on a bitsandbytes NF4 base: tests/helpers/qlora.py) ------

#: The Llama's ragged batches and step, on a Llama of 2 layers, hidden 64, with LoRA adapters (r=4) on every linear
#: layer but the head: in fp32, and on its NF4 base. The QLoRA computes in fp32 (bitsandbytes' default): with
#: QLoRA's bf16, a step recovered onto the chunked loss equals that plan's fault-free step bit for bit but is off the
#: whole batch's by up to 3.6e-4 after AdamW's first step (bf16 products summed in another order, each gradient then
#: divided by its own size), past the sweep's 1e-5 for a split (tests/test_qlora.py holds the bf16 QLoRA's rungs).
ADAPTERS = {
    "PEFT LoRA": dataclasses.replace(
        LLAMA, name="PEFT LoRA (Llama, 2 layers, hidden 64, r=4)", make_model=lambda: helpers.qlora.lora()
    ),
    "QLoRA": dataclasses.replace(
        LLAMA,
        name="QLoRA (NF4 Llama, 2 layers, hidden 64, r=4, fp32 compute)",
        make_model=lambda: helpers.qlora.loadable(helpers.qlora.qlora_copy(compute_dtype=torch.float32)),
    ),
}


def check_adapters_sweep(name: str, sample: Sample, steps: int) -> None:
    pytest.importorskip("peft")
    if name == "QLoRA":
        pytest.importorskip("bitsandbytes")
    check_sweep(ADAPTERS[name], name, Plan(), sample, PHASES, steps=steps)


@pytest.mark.parametrize("name", ADAPTERS)
def test_an_oom_at_sampled_allocations_of_an_adapters_step_loses_nothing(name: str) -> None:
    """The last allocation of each phase of the first step (Adam building the adapters' state), recovered down the
    default ladder: what the step left, the frozen base's 4-bit codes and quantization state included, as the
    fault-free step leaves it, bit for bit."""
    check_adapters_sweep(name, phase_ends, steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ADAPTERS)
def test_an_oom_at_the_edges_of_every_phase_of_two_adapters_steps_loses_nothing(name: str) -> None:
    check_adapters_sweep(name, phase_edges, steps=2)


# -- host faults: a failed host allocation on an offload rung's plan (tests/helpers/hostsweep.py) -----------------

#: The phases in which each offload plan of the TinyNet allocates host memory in its first steps, each faulted:
#: saved activations in the forward (the step journal's copies in the optimizer step); the optimizer state moved to
#: the host as the plan is applied, and what Adam builds there; the fp32 masters and their gradients; an offloaded
#: block's parameters, gradients and state.
HOST_PHASES = {
    "activation offload": {"forward", "optimizer"},
    "optimizer offload": {"apply", "optimizer"},
    "optimizer offload, master weights": {"apply", "backward", "clip", "optimizer"},
    "layer offload": {"apply", "backward", "clip", "optimizer"},
}


def check_host_sweep(workload: Workload, name: str, plan: Plan, sample: Sample, phases: set[str], steps: int) -> None:
    started = time.monotonic()
    result = host_sweep(plan, sample, workload=workload, steps=steps)
    record(workload, f"host faults, {name}", result, time.monotonic() - started)
    assert not result.failures, "\n".join(result.failures[:20])
    assert result.survived == result.injected > 0
    assert {fault["error"] for fault in result.faults} == {"HostMemoryError"}
    assert phases <= set(result.by_phase()), result.by_phase()


# The default run's: the first step on a guard's first call, and the second on a guard that ran the first; the
# first and last two host allocations and the first and last of every phase; the masters' plan (several times
# slower per fault) the first and the last of every phase.
HOST_SAMPLES: dict[str, Sample] = dict.fromkeys(HOST_CONFIGS, host_edges)
HOST_SAMPLES["optimizer offload, master weights"] = host_ends


@pytest.mark.parametrize("name", HOST_CONFIGS)
def test_a_failed_host_allocation_at_sampled_points_of_an_offload_step_is_not_escalated_and_commits_nothing(
    name: str,
) -> None:
    check_host_sweep(TINY, name, TINY_CONFIGS[name], HOST_SAMPLES[name], HOST_PHASES[name], steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", HOST_CONFIGS)
def test_a_failed_host_allocation_anywhere_in_an_offload_step_is_not_escalated_and_commits_nothing(name: str) -> None:
    check_host_sweep(TINY, name, TINY_CONFIGS[name], every_host_allocation, HOST_PHASES[name], steps=2)


@pytest.mark.slow
def test_a_failed_host_allocation_anywhere_in_a_llama_step_with_host_masters_is_not_escalated() -> None:
    """The Llama with its fp32 masters and Adam's state on the host (the plan the planner recommends for a 1B model
    on 6 GiB): every host allocation of its first step, the masters' as the plan is applied included, and of its
    second on a guard that ran the first."""
    name = "optimizer offload, master weights"
    check_host_sweep(LLAMA, name, LLAMA_CONFIGS[name], every_host_allocation, HOST_PHASES[name], steps=1)


def _fused_host_rigs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The host sweep's guards step the host fused, a bucket a parameter (as ``check_fused_sweep``); the calls of
    the fused kernel."""
    monkeypatch.setattr("oomguard._effects.hoststep.BUCKET_ELEMENTS", 1)
    monkeypatch.setattr(helpers.hostsweep, "make_rig", functools.partial(helpers.sweep.make_rig, host_step="fused"))
    return _fused_kernel_calls(monkeypatch)


@pytest.mark.parametrize("name", FUSED_CONFIGS)
def test_a_failed_host_allocation_at_sampled_points_of_a_fused_host_step_is_not_escalated_and_commits_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fused_host_rigs(monkeypatch)
    check_host_sweep(TINY, f"{name}, fused", FUSED_CONFIGS[name], HOST_SAMPLES[name], HOST_PHASES[name], steps=1)
    assert calls, "torch's fused CPU AdamW stepped the host"


@pytest.mark.slow
@pytest.mark.parametrize("name", FUSED_CONFIGS)
def test_a_failed_host_allocation_anywhere_in_a_fused_host_step_is_not_escalated_and_commits_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every host allocation of the first step, and of the second on a guard that ran the first (a third, on level
    1, allocates nothing on the host at all: the fused kernel makes no temporaries)."""
    calls = _fused_host_rigs(monkeypatch)
    check_host_sweep(TINY, f"{name}, fused", FUSED_CONFIGS[name], every_host_allocation, HOST_PHASES[name], steps=1)
    assert calls, "torch's fused CPU AdamW stepped the host"


def test_the_host_sweep_sees_a_host_fault_escalated_as_a_device_oom(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the guard did before issue 26 (a failed host allocation read as a device OOM, recovered from down the
    ladder by offloading more), and a step left half-committed, are both caught."""
    plan = TINY_CONFIGS["optimizer offload"]
    state, batch = initial_state(), TINY.batch(0)
    reference, phases = host_allocations(state, batch, plan)
    # Every out-of-memory error is the device's, whatever ran out (the detector that cannot tell the host apart).
    monkeypatch.setattr("oomguard._guard.loop.is_host_oom", lambda error: False)
    # (what the ranks tell each other: one place, for the optimizer step's transaction and the runner alike)
    monkeypatch.setattr("oomguard._distributed.peers.is_device_oom", lambda error, separate_host: is_oom(error))
    escalated = host_fault_step(state, batch, plan, len(phases))
    found = host_problems(escalated, reference, plan=plan, step=0, sample_ids=[0, 1, 2, 3, 4])
    assert "the call returned: the failed host allocation was recovered from" in found
    assert any("fallback(s): the host fault was escalated" in p for p in found)
    assert any("the guard's plan moved" in p for p in found)
    assert any(p.startswith("committed: ") for p in found), "the escalated call committed a step"
    assert any("called again:" in p and "Adam step counts" in p for p in found), "and the retry a second one"


# -- the sweep's own checks can fail --------------------------------------------------------------------------


def test_the_comparison_sees_a_doubled_optimizer_step() -> None:
    """A step run twice (what a retry that forgot to undo a half-done step amounts to) is caught."""
    state = initial_state()
    batch = TINY.batch(0)
    once = run_step(state, batch, Plan(), ladder=[])
    twice = run_step(once.after, batch, Plan(), ladder=[])
    found = problems(twice, ooms=0, same_plan=once, intended=once, step=0, sample_ids=[0, 1, 2, 3, 4])
    assert any("Adam step counts" in p for p in found)
    assert any("scheduler is at 2" in p for p in found)
    assert any("vs fault-free" in p and "exp_avg" in p for p in found)


def test_the_comparison_sees_a_lost_sample() -> None:
    state = initial_state()
    whole = run_step(state, TINY.batch(0), Plan(), ladder=[])
    short = run_step(state, TINY.batch(0, 4), Plan(), ladder=[])  # the fifth sample never trained
    found = problems(short, ooms=0, same_plan=whole, intended=whole, step=0, sample_ids=[0, 1, 2, 3, 4])
    assert any("saw samples [0, 1, 2, 3]" in p for p in found)
    assert any("weights" in p for p in found)


def test_the_samples_hit_the_edges_of_every_phase() -> None:
    phases = ["forward"] * 3 + ["backward"] * 5 + ["optimizer"] * 4
    assert phase_edges(0, phases) == [1, 3, 4, 8, 9, 12]
    assert phase_edges(1, phases) == [9]
    assert phase_ends(0, phases) == [3, 8, 12]
    assert phase_ends(1, phases) == []
    assert every_allocation(1, phases) == list(range(1, 13))


# -- double faults: an OOM while the guard recovers from one ----------------------------------------------------


class References:
    """Fault-free steps from one state, per plan, computed once."""

    def __init__(self, state: Snapshot, batch: Any) -> None:
        self.state, self.batch = state, batch
        self._outcomes: dict[Plan, Outcome] = {}

    def __getitem__(self, plan: Plan) -> Outcome:
        if plan not in self._outcomes:
            self._outcomes[plan] = run_step(self.state, self.batch, plan, ladder=[])
        return self._outcomes[plan]

    def problems(self, outcome: Outcome, plan: Plan, ooms: int) -> list[str]:
        """What is wrong with ``outcome``, a step on ``plan`` that met ``ooms`` OOMs (see helpers.sweep.problems)."""
        ids = [int(i) for i in TINY.ids(self.batch).tolist()]
        same_plan, intended = self[outcome.result.plan], self[plan]
        return problems(outcome, ooms=ooms, same_plan=same_plan, intended=intended, step=0, sample_ids=ids)


@pytest.mark.parametrize("name", ["whole batch", "layer offload"])
def test_a_second_oom_while_the_next_rung_is_applied_is_recovered(name: str) -> None:
    """The first fault strikes at the last allocation of each phase; as the guard falls back, a second is armed at
    the first allocation the retry makes on the cheaper plan (applying the rung, streaming a block in, the
    forward). The guard falls back twice and the step still equals a fault-free one."""
    plan = TINY_CONFIGS[name]
    references = References(initial_state(), TINY.batch(0))
    armed: list[int] = []

    def arm_on_fallback(event: Any, gpu: PhaseGPU) -> None:
        if isinstance(event, FallbackEvent) and not armed:
            armed.append(1)
            gpu.fail_allocation(1)

    faults = phase_ends(0, references[plan].phases)
    for index in faults:
        armed.clear()
        outcome = run_step(references.state, references.batch, plan, fault=index, on_event=arm_on_fallback)
        assert armed, "the guard fell back"
        found = references.problems(outcome, plan, ooms=2)
        assert not found, f"first fault at allocation {index}: " + "\n".join(found)
    assert len(faults) == 4


def test_an_oom_inside_recoverys_autograd_flush_is_survived(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failed backward the guard runs a tiny backward to drain autograd's queue; it can fail too."""
    import oomguard._guard.recovery

    references = References(initial_state(), TINY.batch(0))
    flush = oomguard._guard.recovery.flush_autograd_queue
    gpus: list[SimulatedGPU] = []
    flushes: list[bool] = []

    def failing_flush(device: torch.device) -> None:
        gpus[-1].fail_allocation(1)  # the flush's own first allocation
        flush(device)
        flushes.append(gpus[-1].fault_pending)

    def remember(gpu: PhaseGPU, guard: OOMGuard) -> None:
        gpus.append(gpu)

    monkeypatch.setattr(oomguard._guard.recovery, "flush_autograd_queue", failing_flush)
    backward = [i for i, phase in enumerate(references[Plan()].phases, 1) if phase == "backward"]
    for index in (backward[0], backward[len(backward) // 2], backward[-1]):
        outcome = run_step(references.state, references.batch, Plan(), fault=index, arm=remember)
        assert flushes[-1] is False, "the flush's allocation failed"
        found = references.problems(outcome, Plan(), ooms=1)
        assert not found, "\n".join(found)


def test_an_oom_while_recovery_empties_the_cache_is_survived() -> None:
    """A device too full even to give its cache back: freeing is best effort, the retry finds out the rest."""
    references = References(initial_state(), TINY.batch(0))
    forward = references[Plan()].phases.index("forward") + 1
    outcome = run_step(references.state, references.batch, Plan(), fault=forward, arm=empty_cache_fails_once)
    assert not references.problems(outcome, Plan(), ooms=1)


def empty_cache_fails_once(gpu: PhaseGPU, guard: OOMGuard) -> None:
    real = gpu.empty_cache
    calls: list[int] = []

    def empty_cache() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected in empty_cache)")
        real()

    gpu.empty_cache = empty_cache  # type: ignore[method-assign]


class WorldOfOne(Agreement):
    """The agreement protocol in a world of one process, which agrees with itself: it drives the distributed code
    path of a step (every failure held until the ranks agree, then re-raised) without a process group."""

    def __init__(self) -> None:
        self.rank, self.world = 0, 1

    def _all_max(self, *values: int) -> list[int]:
        return list(values)

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        return None  # the average over one rank


def _step_that_keeps_its_error(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The tiny workload's step, written so that its frame holds its own error: a reference cycle through the
    traceback that keeps every frame of the failed forward, and their tensors, alive until a garbage collection."""
    try:
        return TINY.loss(model, batch)
    except Exception as exc:
        kept = exc  # noqa: F841 (the point: a local that refers to the error whose traceback holds this frame)
        raise


def _distributed(gpu: PhaseGPU, guard: OOMGuard) -> None:
    guard._runner.agreement = WorldOfOne()


@pytest.mark.parametrize(
    ("case", "garbage_collection"),
    [("the distributed path", False), ("a step that keeps its error", True)],
)
def test_a_failed_forward_held_in_a_reference_cycle_is_freed(
    case: str, garbage_collection: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the distributed sweep: the distributed path kept the failed forward's error in a local of a frame
    in its own traceback, a reference cycle. With layer offload the failed attempt had also moved weights to the
    host, so memory looked back below where the attempt began, the guard skipped its full gc pass, and the failed
    forward's tensors stayed on the device through the retry. Now (1) the distributed path makes no cycle: it
    frees all with no garbage collection at all; (2) a cycle the user's own step makes is freed by the guard's
    young-generation pass, which runs after every failure (automatic collection is off throughout, see
    ``run_step``)."""
    plan = TINY_CONFIGS["layer offload"]
    workload = dataclasses.replace(TINY, loss=_step_that_keeps_its_error) if case.startswith("a step") else TINY
    arm = _distributed if case == "the distributed path" else None
    if not garbage_collection:
        monkeypatch.setattr("oomguard._guard.recovery.gc.collect", lambda generation=2: 0)
    references = References(initial_state(), TINY.batch(0))
    forward = [i for i, phase in enumerate(references[plan].phases, 1) if phase == "forward"]
    freed: dict[int, int] = {}
    for index in forward:
        outcome = run_step(references.state, references.batch, plan, workload=workload, fault=index, arm=arm)
        found = references.problems(outcome, plan, ooms=1)
        assert not found, f"fault at allocation {index}: " + "\n".join(found)
        freed[index] = outcome.ooms[0].memory_after_recovery.allocated
    # However far the failed forward got, recovery freed all of it: the same memory in use after each.
    assert len(set(freed.values())) == 1, f"in use after recovering from a fault at each allocation: {freed}"


# -- distributed: the sweep on one of two gloo ranks ------------------------------------------------------------


def launch_sweep(out: Path, mode: str, timeout: float) -> list[dict[str, Any]]:
    """Both ranks of tests/helpers/sweep.py, through helpers.launch (hard timeout, the whole process group killed
    if a rank hangs); their reports."""
    codes, hung = launch(Path(helpers.sweep.__file__), out, mode, timeout)
    logs = "\n".join((out / f"rank{rank}.log").read_text()[-3000:] for rank in range(2))
    assert not hung, f"a rank hung and was killed:\n{logs}"
    assert codes == [0, 0], logs
    return [json.loads((out / f"sweep{rank}.json").read_text()) for rank in range(2)]


def check_distributed(reports: list[dict[str, Any]], configs: tuple[str, ...]) -> None:
    rank0, rank1 = (report["configs"] for report in reports)
    assert list(rank0) == list(rank1) == list(configs)
    for name in configs:
        assert not rank0[name]["failures"] and not rank1[name]["failures"], (
            name,
            rank0[name]["failures"][:5],
            rank1[name]["failures"][:5],
        )
        faults0, faults1 = rank0[name]["faults"], rank1[name]["faults"]
        assert faults1, name
        assert [(f["step"], f["index"]) for f in faults0] == [(f["step"], f["index"]) for f in faults1]
        assert {f["error"] for f in faults1} == {"OutOfMemoryError"}, "rank 1 ran out of memory itself"
        assert {f["error"] for f in faults0} == {"PeerOutOfMemory"}, "rank 0 retried because its peer failed"
        for fault0, fault1 in zip(faults0, faults1, strict=True):
            assert fault0["plan"] == fault1["plan"], "both ranks recovered on the same plan"
            assert fault0["digest"] == fault1["digest"], "the replicas are identical after the step"


def record_distributed(reports: list[dict[str, Any]]) -> None:
    if FIGURES is None:
        return
    with Path(FIGURES).open("a", encoding="utf-8") as figures:
        for name, found in reports[1]["configs"].items():
            faults = found["faults"]
            survived = sum(not fault["problems"] for fault in faults)
            figures.write(f"DDP, faults on rank 1 of 2 | {name} | {len(faults)} injected | {survived} survived\n")


@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_an_oom_on_one_of_two_ranks_loses_nothing_on_either(tmp_path: Path) -> None:
    reports = launch_sweep(tmp_path, "sampled", timeout=240)
    record_distributed(reports)
    check_distributed(reports, DEFAULT_DIST_CONFIGS)


@pytest.mark.integration
@pytest.mark.subprocess
@pytest.mark.slow
@RANKS
def test_an_oom_at_every_allocation_on_one_of_two_ranks_loses_nothing_on_either(tmp_path: Path) -> None:
    reports = launch_sweep(tmp_path, "full", timeout=3600)
    record_distributed(reports)
    check_distributed(reports, DIST_CONFIGS)
