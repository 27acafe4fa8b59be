"""Host memory, the guard's second budget: how much of it the guard may use (``host_memory=``, the OS's figure
with a container's cgroup limit, a simulated host's limit), and what happens when a host allocation fails."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.batches import tuple_batch
from helpers.models import make_mlp
from helpers.steps import mse_step

from oomguard import GuardConfigError, HostMemoryError, LadderExhausted, OOMGuard, Plan, Rung, RungContext, oom_guard
from oomguard._backends import host
from oomguard._backends.host import HOST_MARGIN_MIN_BYTES, HostAllocationError, available_host_memory, host_budget
from oomguard._backends.memory import CpuMemory, CudaMemory, MemorySnapshot, snapshot
from oomguard._backends.units import GiB, format_bytes
from oomguard._cli.main import main
from oomguard._detect import is_device_oom, is_host_oom
from oomguard._distributed.peers import OUTCOMES, PeerFailure, failure_outcome, peer_failure
from oomguard._effects.activation_host import ActivationLedger
from oomguard._events import JsonlSink, ProgressEvent
from oomguard._ladder.plan import Phase
from oomguard.testing import SimulatedGPU

DEFAULT = SimpleNamespace(host_bytes=None)  # the options of a guard given no host_memory=


def fake_machine(root: Path, available: int | None = None, cgroup: str | None = None, **files: str) -> Path:
    """A fake ``/`` under ``root``: ``/proc/meminfo`` with ``available`` bytes, ``/proc/self/cgroup`` with
    ``cgroup``, and each of ``files`` (a path below ``/sys/fs/cgroup``, ``__`` for ``/``) with its text."""
    (root / "proc" / "self").mkdir(parents=True)
    if available is not None:
        (root / "proc" / "meminfo").write_text(
            f"MemTotal: {4 * available // 1024} kB\nMemFree: 1024 kB\nMemAvailable: {available // 1024} kB\n"
        )
    if cgroup is not None:
        (root / "proc" / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        path = root / "sys" / "fs" / "cgroup" / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_default_budget_is_what_the_os_says_is_available_less_a_tenth_or_1_gib(tmp_path: Path) -> None:
    big = fake_machine(tmp_path / "big", available=32 * GiB)
    assert available_host_memory(big) == 32 * GiB
    assert host_budget(DEFAULT, None, big) == 32 * GiB - int(3.2 * GiB), "a tenth of a large machine's"
    small = fake_machine(tmp_path / "small", available=4 * GiB)
    assert host_budget(DEFAULT, None, small) == 3 * GiB, "at least 1 GiB left free"
    tiny = fake_machine(tmp_path / "tiny", available=HOST_MARGIN_MIN_BYTES // 2)
    assert host_budget(DEFAULT, None, tiny) == 0, "nothing to offload into, rather than a negative budget"


def test_a_cgroup_v2_limit_inside_a_container_caps_the_budget(tmp_path: Path) -> None:
    limited = fake_machine(
        tmp_path / "v2",
        available=64 * GiB,
        cgroup="0::/\n",
        **{"cgroup.controllers": "cpu memory", "memory.max": str(8 * GiB), "memory.current": str(2 * GiB)},
    )
    assert available_host_memory(limited) == 6 * GiB, "the container's headroom, not the machine's"
    unlimited = fake_machine(
        tmp_path / "max", available=64 * GiB, cgroup="0::/\n", **{"cgroup.controllers": "memory", "memory.max": "max"}
    )
    assert available_host_memory(unlimited) == 64 * GiB


def test_the_tightest_cgroup_v2_level_above_the_process_caps_the_budget(tmp_path: Path) -> None:
    nested = fake_machine(
        tmp_path / "nested",
        available=64 * GiB,
        cgroup="0::/slice/job\n",
        **{
            "cgroup.controllers": "memory",
            "slice__memory.max": str(5 * GiB),  # the parent's limit applies to every child
            "slice__memory.current": str(1 * GiB),
            "slice__job__memory.max": "max",
            "slice__job__memory.current": str(1 * GiB),
        },
    )
    assert available_host_memory(nested) == 4 * GiB


def test_a_cgroup_v1_limit_caps_the_budget_and_its_no_limit_value_does_not(tmp_path: Path) -> None:
    limited = fake_machine(
        tmp_path / "v1",
        available=64 * GiB,
        cgroup="5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
        **{
            "memory__docker__abc__memory.limit_in_bytes": str(10 * GiB),
            "memory__docker__abc__memory.usage_in_bytes": str(7 * GiB),
        },
    )
    assert available_host_memory(limited) == 3 * GiB
    unlimited = fake_machine(
        tmp_path / "v1-none",
        available=64 * GiB,
        cgroup="5:memory:/\n",
        **{"memory__memory.limit_in_bytes": "9223372036854771712", "memory__memory.usage_in_bytes": str(GiB)},
    )
    assert available_host_memory(unlimited) == 64 * GiB


def test_without_proc_psutil_says_and_without_either_the_budget_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = tmp_path / "mac"
    bare.mkdir()
    monkeypatch.setattr(host, "_psutil_available", lambda: 12 * GiB)
    assert available_host_memory(bare) == 12 * GiB
    monkeypatch.setattr(host, "_psutil_available", lambda: None)
    assert available_host_memory(bare) is None and host_budget(DEFAULT, None, bare) is None


def test_host_memory_is_the_budget_as_given_and_a_simulated_host_is_its_own(tmp_path: Path) -> None:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert OOMGuard(mse_step(model), model=model, optimizer=optimizer, host_memory="16GiB").host_budget == 16 * GiB
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer)
    with SimulatedGPU("1MiB", host_capacity="3MiB"):
        assert guard.host_budget == 3 * 2**20
        guard((torch.randn(4, 16), torch.randn(4)))  # the first call fixes it
    assert guard.host_budget == 3 * 2**20, "resolved once, at the first call"
    with SimulatedGPU("1MiB"):
        assert guard.host_budget == 3 * 2**20
        unlimited = OOMGuard(mse_step(model), model=model, optimizer=optimizer)
        assert unlimited.host_budget is None, "a simulated host without host_capacity has no limit"
    unlimited.close()
    guard.close()


@pytest.mark.parametrize("bad", ["lots", -1, 0, 1.5])
def test_a_host_memory_that_is_no_size_is_refused_clearly(bad: object) -> None:
    model = make_mlp()
    with pytest.raises(GuardConfigError, match=r"host_memory=.*'16GiB'"):
        OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters()), host_memory=bad)


# -- a host allocation that fails is host memory: not escalated, nothing committed ---------------------------------

WIDTH = 256  # an MLP of 4609 parameters: 18,436 bytes of fp32 weights


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def snapshot_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], Any]:
    """The weights and the optimizer's state, copied: what a call that commits nothing leaves as it found."""
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())


def assert_unchanged(model: torch.nn.Module, optimizer: torch.optim.Optimizer, before: tuple[list[Any], Any]) -> None:
    weights, state = before
    for p, q in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, q)
    now = optimizer.state_dict()
    assert now["state"].keys() == state["state"].keys()
    for key, entry in state["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(now["state"][key][name]), torch.as_tensor(value)), (key, name)


def test_host_memory_running_out_under_optimizer_offload_raises_host_memory_error_and_commits_nothing() -> None:
    model = make_mlp(width=WIDTH)
    optimizer = torch.optim.Adam(model.parameters())
    # The guard is told of more host memory than there is (host_memory=), so it predicts that optimizer_offload
    # fits and engages it: a host failure nobody predicted (where it is predicted, nothing engages: see below).
    told = 2**20
    ladder = ["optimizer_offload", "layer_offload"]
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, ladder=ladder, host_memory=told)
    before = snapshot_of(model, optimizer)
    host = weights_bytes(model)  # one copy of the weights: the step journal fits, the host step's copies do not
    # The device holds the weights, gradients and activations, not Adam's two moments (measured: 111,616 bytes
    # for the plain step, 48,128 with the optimizer on the host).
    with SimulatedGPU((111_616 + 48_128) // 2, host_capacity=host) as gpu:
        gpu.adopt(model)
        with pytest.raises(HostMemoryError, match=r"host memory \(RAM\) ran out") as raised:
            step(tuple_batch(n=8))
        assert gpu.max_host_memory_allocated() <= host
        assert gpu.host_memory_allocated() == 0, "giving up, the guard let go of all it held on the host"
        assert step.guard.host_budget == told
    message = str(raised.value)
    assert "host memory exhausted" in message and "18.0 KiB" in message, "what the host said: wanted, in use, limit"
    assert "host_memory=" in message and "quantized_optimizer" in message, "and the fix"
    assert isinstance(raised.value, MemoryError)
    kinds = [(event.kind, getattr(event, "reason", None)) for event in step.guard.events if event.kind != "progress"]
    assert kinds == [("oom", None), ("fallback", None), ("oom", None), ("exhausted", "host")], (
        "one device OOM moved to optimizer_offload; the host's did not move on to layer_offload"
    )
    assert [plan.optimizer_offload for plan, _ in raised.value.tried] == [False, True]
    assert_unchanged(model, optimizer, before)
    assert not step.guard.effects.holds, "the offload was undone, as when the guard gives up"


def test_a_failed_pinned_allocation_during_activation_offload_is_not_escalated_and_commits_nothing() -> None:
    model = make_mlp(width=WIDTH)
    optimizer = torch.optim.Adam(model.parameters())
    ladder = ["activation_offload", "optimizer_offload", "layer_offload"]
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, ladder=ladder, relax_after=None)
    step.guard.plan = Plan(activation_offload=True)
    with SimulatedGPU("1MiB") as gpu:
        gpu.adopt(model)
        step(tuple_batch(n=8, seed=1))  # Adam's state exists: the next step's journal has it all to undo
        before = snapshot_of(model, optimizer)
        gpu.fail_host_allocation(1)  # the next saved activation's host buffer (a failed cudaHostAlloc)
        with pytest.raises(HostMemoryError, match=r"host memory \(RAM\) ran out \(OOM in forward") as raised:
            step(tuple_batch(n=8, seed=2))
        assert [plan for plan, _ in raised.value.tried] == [Plan(activation_offload=True)], "no rung was tried next"
        assert_unchanged(model, optimizer, before)
        assert step(tuple_batch(n=8, seed=2)).ooms == 0, "caught, the same batch trains once the host has room"
    assert [event.kind for event in step.guard.events if event.kind not in ("progress", "oom")] == ["exhausted"]


def test_a_pinned_allocation_that_fails_with_cudas_words_is_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = torch.empty

    def no_pinned_memory(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        if pin_memory:  # what cudaHostAlloc's failure reads like: the words of a device OOM
            raise RuntimeError("CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinned_memory)
    cuda = CudaMemory(torch.device("cuda", 0))  # (its to_host pins before it touches the device)
    with pytest.raises(MemoryError, match=r"host memory: a pinned host buffer of 4\.0 KiB") as raised:
        cuda.to_host(torch.ones(1024))
    assert is_host_oom(raised.value) and not is_device_oom(raised.value, separate_host=True)
    assert isinstance(raised.value.__cause__, RuntimeError), "CUDA's own error is kept as the cause"
    device_words = RuntimeError("CUDA error: out of memory")  # the same words from anywhere else: the device's
    assert is_device_oom(device_words, separate_host=True) and not is_host_oom(device_words)


def test_a_step_back_up_that_runs_out_of_host_memory_goes_back_to_the_plan_that_worked() -> None:
    model = make_mlp(width=WIDTH)
    optimizer = torch.optim.Adam(model.parameters())
    ladder = ["micro_batch", "activation_offload"]
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, ladder=ladder, relax_after=2, tune_after=None)
    worked = Plan(micro_batch_size=4, activation_offload=True)
    step.guard.plan = worked
    with SimulatedGPU("1MiB") as gpu:
        gpu.adopt(model)
        step(tuple_batch(n=8, seed=1))
        step(tuple_batch(n=8, seed=2))  # two clean steps: the next call steps back up, one rung given back
        gpu.fail_host_allocation(1)  # and that attempt runs out of host memory
        result = step(tuple_batch(n=8, seed=3))
    assert (result.ooms, result.plan) == (1, worked), "not down the ladder, nor given up: the plan that worked"
    relaxes = [event for event in step.guard.events if event.kind == "relax"]
    # (which rung: the planned step up's choice, the plan predicted fastest; here activation offload given back at
    # the plan's micro-batches, where the ladder's step gave back micro-batching before 3b1e0bb)
    assert [(event.outcome, event.rung) for event in relaxes] == [("failed", "activation_offload")]  # type: ignore[attr-defined]


def test_going_from_offloaded_state_to_master_weights_keeps_no_host_buffer_of_the_first_level() -> None:
    """Before: the first level's host copies of every weight and gradient stayed alive at the master level (two
    copies of the weights, 36,872 bytes here), until the guard closed."""
    held = {}
    for start in (Plan(optimizer_offload=True), None):
        model = make_mlp(width=WIDTH)
        step = oom_guard(mse_step(model), model=model, optimizer=torch.optim.Adam(model.parameters()), ladder=[])
        master = Plan(precision="bf16", optimizer_offload="master")
        with SimulatedGPU("1MiB") as gpu:
            gpu.adopt(model)
            for plan in (start or master, master):
                step.guard.plan = plan
                step(tuple_batch(n=8, seed=1))
            held[start is not None] = gpu.host_memory_allocated()
        step.guard.close()
    assert held[True] == held[False] > weights_bytes(make_mlp(width=WIDTH)), "the masters and moments, only"


# -- no plan past the host budget is engaged ---------------------------------------------------------------------


def deep_mlp() -> torch.nn.Module:
    """Nine 128-wide layers (134,401 parameters: 537,604 bytes of fp32 weights): many parameters, so that 8-bit
    state, dequantized a few parameters at a time, needs less device memory than Adam's fp32 state."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, 128), torch.nn.Tanh()]
    for _ in range(8):
        layers += [torch.nn.Linear(128, 128), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(128, 1))


# A device with room for the weights, gradients and activations and 8-bit moments, not Adam's fp32 ones (measured
# peaks: 2,295,296 bytes for the plain step, 1,653,248 with 8-bit state, 1,087,488 with the state on the host).
ADAM_DOES_NOT_FIT = (2_295_296 + 1_653_248) // 2


def host_capped_run(ladder: list[str], host: int, steps: int = 3) -> tuple[Any, SimulatedGPU, list[Any]]:
    """Train :func:`deep_mlp`, whose Adam state does not fit the device, for ``steps`` steps under a host of
    ``host`` bytes; the guarded step, the simulator, and each call's result or the error it raised (which ends the
    run)."""
    model = deep_mlp()
    step = oom_guard(mse_step(model), model=model, optimizer=torch.optim.Adam(model.parameters()), ladder=ladder)
    outcomes: list[Any] = []
    with SimulatedGPU(ADAM_DOES_NOT_FIT, host_capacity=host) as gpu:
        gpu.adopt(model)
        for seed in range(steps):
            try:
                outcomes.append(step(tuple_batch(n=8, seed=seed)))
            except Exception as error:  # (the run ends here; the test reads what it raised)
                outcomes.append(error)
                break
    return step, gpu, outcomes


def test_optimizer_offload_past_the_host_budget_is_refused_before_anything_moves() -> None:
    """Before: optimizer_offload engaged, the host step's copies ran the host out, HostMemoryError after trying."""
    host = weights_bytes(deep_mlp())  # one copy of the weights: Adam's state alone is two
    step, gpu, outcomes = host_capped_run(["optimizer_offload"], host)
    error = outcomes[-1]
    assert isinstance(error, LadderExhausted) and not isinstance(error, HostMemoryError), outcomes
    message = str(error)
    assert "host memory (RAM) has room for" in message and "optimizer_offload" in message
    assert f"past the guard's host budget of {format_bytes(host)}" in message, "what is available"
    assert f"needs about {format_bytes(4 * host)}" in message, "what it needs: the state, weights and gradients"
    assert "quantized_optimizer" in message and "nothing was moved to the host" in message, "what would fit"
    assert [plan for plan, _ in error.tried] == [Plan()], "optimizer_offload was never tried"
    assert gpu.max_host_memory_allocated() <= host
    kinds = [event.kind for event in step.guard.events if event.kind not in ("progress",)]
    assert "fallback" not in kinds and kinds[-1] == "exhausted"


def test_the_ladder_moves_on_to_8_bit_state_where_the_host_has_no_room_for_the_state() -> None:
    """Before: optimizer_offload engaged first and the host ran out (HostMemoryError)."""
    host = weights_bytes(deep_mlp())
    step, gpu, outcomes = host_capped_run(["micro_batch", "optimizer_offload", "quantized_optimizer"], host)
    assert all(not isinstance(outcome, Exception) for outcome in outcomes), outcomes
    assert outcomes[-1].plan.quantized_optimizer and not outcomes[-1].plan.optimizer_offload
    plans = [event.plan for event in step.guard.events if event.kind in ("fallback", "oom")]
    assert not any(plan["optimizer_offload"] for plan in plans), "optimizer_offload never engaged"
    assert gpu.max_host_memory_allocated() <= host


def test_with_room_on_the_host_optimizer_offload_engages_as_before() -> None:
    host = 8 * weights_bytes(deep_mlp())
    _, gpu, outcomes = host_capped_run(["optimizer_offload"], host)
    assert all(not isinstance(outcome, Exception) for outcome in outcomes), outcomes
    assert outcomes[0].ooms == 1 and outcomes[-1].plan == Plan(optimizer_offload=True)
    assert 0 < gpu.max_host_memory_allocated() <= host


def test_fallback_and_progress_events_carry_the_host_memory_in_use() -> None:
    """Before: the events' memory had no host figure."""
    step, _, outcomes = host_capped_run(["optimizer_offload"], 8 * weights_bytes(deep_mlp()))
    events = [event.to_dict() for event in step.guard.events if event.kind in ("fallback", "progress")]
    assert [event["event"] for event in events] == ["fallback", "progress", "progress", "progress"], outcomes
    state = 2 * weights_bytes(deep_mlp())  # Adam's moments, on the host from the fallback on
    assert all(event["memory"]["host_allocated"] >= state for event in events[1:]), "what the guard holds there"
    assert snapshot(CpuMemory()).host_allocated is None, "not counted where the backend does not count it"


def test_a_journal_the_host_has_no_room_for_is_skipped_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the second step's journal (the weights and Adam's two moments: three copies) ran the host out and the
    guard gave up with HostMemoryError on a plan that needs no host memory of its own."""
    model = make_mlp(width=WIDTH)
    optimizer = torch.optim.Adam(model.parameters())
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, ladder=[], step_journal="auto")
    host = 2 * weights_bytes(model)  # the first step's journal (the weights: no state yet) fits, later ones do not
    with SimulatedGPU("1MiB", host_capacity=host) as gpu, caplog.at_level(logging.WARNING, logger="oomguard"):
        gpu.adopt(model)
        step.guard.plan = Plan()
        for seed in range(4):
            step.guard._runner.transaction.invalidate()  # (every step journaled, as after a change of plan)
            assert step(tuple_batch(n=8, seed=seed)).ooms == 0
        assert gpu.max_host_memory_allocated() <= host
    assert caplog.text.count("step journal skipped") == 1, "said once, not per step"
    assert "do not fit the host budget of 36.0 KiB" in caplog.text


def test_a_remembered_plan_past_the_host_budget_is_not_taken(tmp_path: Path) -> None:
    """A job with host room saved optimizer offload in the state file; the same model on a host with room for one
    copy of its weights starts plain, as the ladder would, instead of engaging the remembered plan."""
    state, roomy = tmp_path / "plans.json", 8 * weights_bytes(deep_mlp())
    for room, ladder in (
        (roomy, ["optimizer_offload"]),
        (weights_bytes(deep_mlp()), ["micro_batch", "optimizer_offload", "quantized_optimizer"]),
    ):
        model = deep_mlp()
        optimizer = torch.optim.Adam(model.parameters())
        step = oom_guard(mse_step(model), model=model, optimizer=optimizer, ladder=ladder, state_file=state)
        with SimulatedGPU(ADAM_DOES_NOT_FIT, host_capacity=room) as gpu:
            gpu.adopt(model)
            results = [step(tuple_batch(n=8, seed=seed)) for seed in range(2)]
        step.guard.close()
    assert not any(r.plan.optimizer_offload for r in results), [r.plan for r in results]
    assert results[-1].plan.quantized_optimizer and gpu.max_host_memory_allocated() <= weights_bytes(deep_mlp())


# -- stepping back up never tries a plan past the host budget ----------------------------------------------------


class Staging(Rung):
    """A rung whose effect (none here) keeps 100,000 host bytes per sample of a micro-batch: stepping back up to
    larger micro-batches adds host memory, as activation offload's saved tensors do."""

    name = "staging"

    def host_bytes(self, plan: Plan, context: RungContext) -> int:
        return 100_000 * plan.effective_micro_batch_size(context.batch_size) if plan.level(self.name) else 0


def test_a_step_back_up_past_the_host_budget_is_not_tried_and_said() -> None:
    """Before: the guard stepped back up to micro-batches of 4 (400,000 host bytes in a 300,000-byte budget)."""
    model = make_mlp(width=WIDTH)
    optimizer = torch.optim.Adam(model.parameters())
    ladder: list[Any] = ["micro_batch", Staging()]
    options: dict[str, Any] = {"relax_after": 2, "tune_after": None, "predictive": False, "host_memory": 300_000}
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, ladder=ladder, **options)
    degraded = Plan(micro_batch_size=2).with_level("staging", 1)
    step.guard.plan = degraded
    with SimulatedGPU("1MiB") as gpu:
        gpu.adopt(model)
        results = [step(tuple_batch(n=8, seed=seed)) for seed in range(3)]
    assert [r.plan for r in results] == [degraded] * 3, "two clean steps, then no try at micro-batches of 4"
    assert all(r.ooms == 0 for r in results)
    relaxes = [event for event in step.guard.events if event.kind == "relax"]
    assert [(e.outcome, e.rung, e.step) for e in relaxes] == [("host", "micro_batch", 2)]  # type: ignore[attr-defined]
    held = relaxes[0]
    assert held.plan["micro_batch_size"] == 4 and held.previous_plan == degraded.to_dict()  # type: ignore[attr-defined]
    assert f"{format_bytes(400_000)} on the host, past the guard's host budget of {format_bytes(300_000)}" in str(
        held.describe()
    )
    assert held.next_try_after == 4, "it waits twice as long, as after a try that failed"  # type: ignore[attr-defined]


# -- activation offload keeps the host budget as it copies, and measures what it took -----------------------------

PER_SAMPLE = 1028  # measured: the host bytes activation offload's saved tensors take per sample of the WIDTH MLP


def sgd_guard(plan: Plan, host_memory: int, **options: Any) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    """A guarded MSE step on the WIDTH MLP with SGD and no step journal (the host holds the saved tensors only),
    started on ``plan`` with a host budget of ``host_memory`` bytes."""
    model = make_mlp(width=WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ladder = ["micro_batch", "activation_offload"]
    step = oom_guard(
        mse_step(model),
        model=model,
        optimizer=optimizer,
        ladder=ladder,
        step_journal="never",
        host_memory=host_memory,
        tune_after=None,
        **options,
    )
    step.guard.plan = plan
    return step, model, optimizer


def test_saved_activations_past_the_host_budget_raise_host_memory_error_before_the_copy() -> None:
    """Before: the whole batch's saved tensors (65,792 bytes) went to the host past the guard's 40,000-byte budget."""
    budget = 40_000
    step, model, optimizer = sgd_guard(Plan(activation_offload=True), budget, relax_after=None)
    before = snapshot_of(model, optimizer)
    with SimulatedGPU("4MiB", host_capacity=10**7) as gpu:  # (the machine has room; the guard's budget does not)
        gpu.adopt(model)
        with pytest.raises(HostMemoryError, match=r"host memory \(RAM\) ran out") as raised:
            step(tuple_batch(n=64, seed=1))
        assert gpu.max_host_memory_allocated() <= budget, "no copy past the budget was made"
        assert gpu.host_memory_allocated() == 0
    message = str(raised.value)
    assert "activation offload would copy" in message and f"host budget of {format_bytes(budget)}" in message
    assert "of them already" in message, "what the saved tensors held when the next did not fit"
    assert [plan for plan, _ in raised.value.tried] == [Plan(activation_offload=True)], "not down the ladder"
    assert_unchanged(model, optimizer, before)


def test_the_rung_estimates_saved_activations_from_the_last_step_and_stepping_up_past_the_budget_is_not_tried() -> None:
    """Before: activation offload estimated no host memory, so the step back up to micro-batches of 32 (32,896
    bytes of saved tensors) ran past the guard's 25,000-byte budget."""
    budget, degraded = 25_000, Plan(micro_batch_size=16, activation_offload=True)
    step, model, _ = sgd_guard(degraded, budget, relax_after=2, predictive=False)
    with SimulatedGPU("4MiB", host_capacity=10**7) as gpu:
        gpu.adopt(model)
        results = [step(tuple_batch(n=64, seed=seed)) for seed in range(3)]
        assert gpu.max_host_memory_allocated() == 16 * PER_SAMPLE <= budget
    assert [(r.plan, r.ooms) for r in results] == [(degraded, 0)] * 3, "no try at micro-batches of 32"
    ladder, context = step.guard.ladder, step.guard._escalation.context(gpu, 64, False)
    assert ladder.host_bytes(degraded, context) == 16 * PER_SAMPLE, "what the step measured, per sample"
    assert ladder.host_bytes(degraded.replace(micro_batch_size=32), context) == 32 * PER_SAMPLE
    relaxes = [(e.outcome, e.plan["micro_batch_size"]) for e in step.guard.events if e.kind == "relax"]  # type: ignore[attr-defined]
    assert relaxes == [("host", 32)]


def test_the_budget_check_counts_the_plans_other_offloading_where_the_backend_does_not_count_the_host() -> None:
    """Where the host is not counted (CUDA), the check adds the copies to the rungs' estimate of the rest."""
    ledger = ActivationLedger()
    ledger.budget, ledger.others = 100, lambda plan: 60
    first = torch.empty(0)  # (stands for a host copy: what keeps its bytes alive)
    ledger.reserve(30, Plan(activation_offload=True), None)
    ledger.add(first, 30)
    with pytest.raises(HostAllocationError, match=r"would copy 20 B more .* holds 30 B of them already and 90 B"):
        ledger.reserve(20, Plan(activation_offload=True), None)
    del first  # the graph that saved it let it go
    assert ledger.held == 0
    ledger.reserve(20, Plan(activation_offload=True), None)


# -- oomguard report shows the host memory the events name --------------------------------------------------------


def test_the_report_shows_the_host_memory_the_guard_held_in_all_and_per_rung(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the report had no host figure, though the events carry ``memory.host_allocated``."""
    log = tmp_path / "host.jsonl"
    model = deep_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    options: dict[str, Any] = {"ladder": ["optimizer_offload"], "log_file": log, "log_every": 1}
    step = oom_guard(mse_step(model), model=model, optimizer=optimizer, **options)
    with SimulatedGPU(ADAM_DOES_NOT_FIT, host_capacity=8 * weights_bytes(model)) as gpu:
        gpu.adopt(model)
        for seed in range(3):
            step(tuple_batch(n=8, seed=seed))
    step.guard.close()
    held = [event.memory.host_held or 0 for event in step.guard.events]
    on_offload = [e.memory.host_held or 0 for e in step.guard.events if e.plan.get("optimizer_offload")]
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert f"Host memory held by the guard: at most {format_bytes(max(held))}" in out
    assert "| host memory held (most) |" in out
    row = next(line for line in out.splitlines() if line.startswith("| optimizer_offload |"))
    assert row.startswith("| optimizer_offload | 1 | 3 | ") and row.endswith(f" {format_bytes(max(on_offload))} |")
    assert max(on_offload) >= 2 * weights_bytes(model), "Adam's moments, on the host"


def test_a_report_of_events_without_host_figures_has_no_host_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = MemorySnapshot("cuda", allocated=1, reserved=1, peak=1, capacity=None)  # (CUDA counts no host memory)
    sink = JsonlSink(tmp_path / "cuda.jsonl")
    sink(ProgressEvent(0, Plan().to_dict(), snap, loss=1.0, bucket=0, steps_by_rung={"none": 1}))
    assert main(["report", str(sink.path)]) == 0
    out = capsys.readouterr().out
    assert "host memory" not in out.lower() and "| none | 0 | 1 | 0.00 s |\n" in out + "\n"


# -- after host memory ran out, the events and the error name the host's figures ----------------------------------


def test_a_host_failure_is_described_by_the_host_memory_held_and_the_host_budget() -> None:
    """Before: the OOM event gave the device's figures only, the give-up event none, and the error the budget but
    not what the guard held on the host."""
    budget = 65_600  # room for the whole batch's Tanh output (65,536 bytes), not for the model's output beside it
    step, model, _ = sgd_guard(Plan(activation_offload=True), budget, relax_after=None)
    with SimulatedGPU("4MiB", host_capacity=10**7) as gpu:
        gpu.adopt(model)
        with pytest.raises(HostMemoryError) as raised:
            step(tuple_batch(n=64, seed=1))
    oom, exhausted = (next(e for e in step.guard.events if e.kind == kind) for kind in ("oom", "exhausted"))
    held = oom.error.memory.host_held  # type: ignore[attr-defined]  (at most, in the attempt that failed)
    assert held == 64 * 256 * 4, "the saved Tanh output, copied before the next copy was refused"
    figures = f"the guard held {format_bytes(held)} on the host, of its host budget of {format_bytes(budget)}"
    assert f"(host memory (RAM) ran out: {figures}; device: " in oom.describe()
    assert oom.to_dict()["error"]["host"] is True and oom.to_dict()["error"]["host_budget"] == budget
    assert exhausted.describe().endswith(
        f"giving up on this batch (host) after 1 OOM(s): host memory (RAM) ran out: {figures}"
    )
    assert (exhausted.to_dict()["host_held"], exhausted.to_dict()["host_budget"]) == (held, budget)
    assert f"Host memory: {figures}; 0 B after freeing. Device memory in use after freeing: " in str(raised.value)


def test_a_peer_ranks_host_failure_is_told_as_host_memory_between_a_device_oom_and_a_fatal_error() -> None:
    """Before: a rank whose host memory ran out told the others "fatal", and they said it was no out-of-memory
    error (the two-rank run is in test_distributed.py)."""
    host_error = MemoryError("host memory exhausted. Tried to allocate 4.0 KiB of host memory")
    assert failure_outcome(host_error, separate_host=True) == "host"
    assert failure_outcome(host_error, separate_host=False) == "oom", "on a CPU-only run the host is the device"
    assert failure_outcome(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), True) == "oom"
    assert failure_outcome(ValueError("a bug"), True) == "fatal"
    error = peer_failure("host", Phase.FORWARD)
    assert isinstance(error, PeerFailure) and "another rank ran out of host memory (RAM) in the forward" in str(error)
    assert "not an out-of-memory error" not in str(error)
    assert OUTCOMES.index("oom") < OUTCOMES.index("host") < OUTCOMES.index("fatal"), "the worst of the ranks wins"
