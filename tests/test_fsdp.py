"""FSDP2 (``fully_shard``) under the guard: two gloo ranks where only rank 1 runs out of memory, in forward, backward,
an all-gather, a reduce-scatter and the optimizer step; and what the guard refuses or leaves off the ladder.

Every job runs under a hard timeout (tests/helpers/launch.py): a rank left in a collective is killed and the test
fails. See tests/fsdp_worker.py for what each rank does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.launch import ENV, RANKS, WORLD, launch, rendezvous
from helpers.models import make_llama, make_mlp
from helpers.once import once
from helpers.steps import mse_step
from torch.distributed.fsdp import FSDPModule

from oomguard import GuardConfigError, OOMGuard, Plan
from oomguard._effects.sharding import SHARDED
from oomguard._ladder.rungs import RungContext, builtin

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"


def reports(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"report{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return once("fsdp run", lambda: _sharded_run(tmp_path_factory.mktemp("fsdp")))


def _sharded_run(out: Path) -> Path:
    codes, hung = launch(WORKER, out, "run", timeout=420)
    logs = "\n".join((out / f"rank{r}.log").read_text()[-4000:] for r in range(WORLD))
    assert not hung, f"a rank hung and was killed:\n{logs}"
    assert codes == [0, 0], logs
    return out


@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_every_rank_recovers_from_one_ranks_oom_anywhere_in_an_fsdp2_step(sharded_run: Path) -> None:
    rank0, rank1 = reports(sharded_run)
    assert rank1["faults_fired"] == dict.fromkeys(
        ["all_gather", "forward", "backward", "reduce_scatter", "optimizer"], True
    )
    assert not any(rank0["faults_fired"].values()), "only rank 1 ran out of memory"
    assert rank0["agreement"] == rank1["agreement"] == "FSDPAgreement"
    # Rank 1's all-gather and reduce-scatter buffers failed to allocate inside the gated comms: it passed their
    # gates with its failure, and rank 0 was never left in either collective. (Under a quarter of the plain step's
    # peak either rank may also run out of memory in a gated allocation of its own: each passes its gate the same
    # way, and which allocation it is moves with the collector's timing, so those are counted apart.)
    assert rank1["injected_gate_failures"] == 2 and rank0["injected_gate_failures"] == 0
    assert rank1["gate_failures"] >= 2
    assert rank0["budget"] == rank0["peak"] // 4, "a quarter of the plain FSDP step's peak"
    assert [s["plan"] for s in rank0["steps"]] == [s["plan"] for s in rank1["steps"]], "one plan on every rank"
    assert [s["ooms"] for s in rank0["steps"]] == [s["ooms"] for s in rank1["steps"]]
    assert all(s["ooms"] >= 1 for s in rank0["steps"]), "rank 0 retried every time rank 1 failed"
    assert any(s["plan"]["micro_batch_size"] for s in rank0["steps"]), "the budget made the ranks split the batch"
    assert all(s["clean"] for s in rank0["steps"] + rank1["steps"]), "FSDP resharded, no unsharded gradient left"
    assert rank0["adam_steps"] == rank1["adam_steps"] == [5], "one optimizer step per call, no more"
    assert rank0["comms_after_close"] == ["DefaultAllGather/DefaultReduceScatter"], "close() put FSDP's own back"
    events = [json.loads(line) for line in (sharded_run / "events.jsonl").read_text().splitlines()]
    assert {e["error"]["error_type"] for e in events if e["event"] == "oom"} >= {"PeerOutOfMemory"}


@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_fsdp2_weights_equal_a_single_process_fp32_run_on_the_whole_batch(sharded_run: Path) -> None:
    assert_weights_equal_a_single_process_run(sharded_run, steps=5, world=WORLD)


@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_checkpointing_and_activation_offload_of_sharded_blocks_stay_exact(tmp_path: Path) -> None:
    codes, hung = launch(WORKER, tmp_path, "offload", timeout=300)
    assert not hung and codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    rank0, rank1 = reports(tmp_path)
    assert rank1["faults_fired"] == {"forward": True, "backward": True} and not any(rank0["faults_fired"].values())
    plans = [[s["plan"] for s in report["steps"]] for report in (rank0, rank1)]
    assert plans[0] == plans[1]
    assert all(plan["checkpointing"] == "full" and plan["activation_offload"] for plan in plans[0])
    assert all(s["clean"] for s in rank0["steps"] + rank1["steps"])
    assert_weights_equal_a_single_process_run(tmp_path, steps=3, world=WORLD)


@pytest.mark.slow  # (the default run keeps the main job, checkpointing and clipping: make test stays short)
@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_both_ranks_failing_in_different_places_agree_and_stay_exact(tmp_path: Path) -> None:
    codes, hung = launch(WORKER, tmp_path, "both", timeout=300)
    assert not hung and codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    rank0, rank1 = reports(tmp_path)
    assert all(rank0["faults_fired"].values()) and all(rank1["faults_fired"].values())
    assert rank1["gate_failures"] >= 1
    assert [s["plan"] for s in rank0["steps"]] == [s["plan"] for s in rank1["steps"]]
    assert [s["ooms"] for s in rank0["steps"]] == [s["ooms"] for s in rank1["steps"]]
    assert all(s["clean"] for s in rank0["steps"] + rank1["steps"])
    own = [
        {(e["step"], e["attempt"]) for e in map(json.loads, (tmp_path / name).read_text().splitlines())
         if e["event"] == "oom" and e["error"]["error_type"] == "OutOfMemoryError"}
        for name in ("events.jsonl", "events.rank1.jsonl")
    ]  # fmt: skip
    assert own[0] & own[1], "some attempt failed on both ranks, each with its own OOM"
    assert own[0] - own[1] and own[1] - own[0], "and some on one rank only, each way"
    assert_weights_equal_a_single_process_run(tmp_path, steps=3, world=WORLD)


@pytest.mark.slow  # (the default run keeps the main job, checkpointing and clipping: make test stays short)
@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_amp_autocasts_on_top_of_fsdp2s_policy_and_the_ranks_agree(tmp_path: Path) -> None:
    codes, hung = launch(WORKER, tmp_path, "amp", timeout=300)
    assert not hung and codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    rank0, rank1 = reports(tmp_path)
    assert all(rank1["faults_fired"].values()) and not rank0["faults_fired"]
    plans = [[s["plan"] for s in report["steps"]] for report in (rank0, rank1)]
    assert plans[0] == plans[1] and all(plan["precision"] == "bf16" for plan in plans[0])
    assert all(s["clean"] for s in rank0["steps"] + rank1["steps"])
    # bf16 autocast is mixed precision: within amp's tolerance of the fp32 run (7.8e-4 seen after three steps).
    assert_weights_equal_a_single_process_run(tmp_path, steps=3, world=WORLD, atol=5e-3)


@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_clipping_sharded_gradients_is_agreed_and_exact(tmp_path: Path) -> None:
    """The norm of sharded gradients is a collective: rank 1 runs out of memory inside the clip (before its gate)
    in step 0, in forward in step 1 and in the optimizer step in step 2; the clipped steps equal one process's."""
    from fsdp_worker import CLIP

    codes, hung = launch(WORKER, tmp_path, "clip", timeout=300)
    assert not hung and codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    rank0, rank1 = reports(tmp_path)
    assert all(rank1["faults_fired"].values()) and not rank0["faults_fired"]
    assert [s["plan"] for s in rank0["steps"]] == [s["plan"] for s in rank1["steps"]]
    assert [s["ooms"] for s in rank0["steps"]] == [s["ooms"] for s in rank1["steps"]]
    assert rank0["norms"] == rank1["norms"] and all(norm > CLIP for norm in rank0["norms"])
    assert all(s["clean"] for s in rank0["steps"] + rank1["steps"])
    assert_weights_equal_a_single_process_run(tmp_path, steps=3, world=WORLD, max_norm=CLIP)


@pytest.mark.integration
@pytest.mark.subprocess
def test_fsdp2_on_a_process_group_of_one_is_reset_after_each_failure(tmp_path: Path) -> None:
    """No peer to agree with, but FSDP's state must still be reset after a failed attempt, and its micro-batching
    must still sync only in the last backward."""
    command = [sys.executable, str(WORKER), "0", "1", rendezvous(), str(tmp_path), "single"]
    with (tmp_path / "rank0.log").open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=ENV, timeout=300, check=False)
    assert done.returncode == 0, (tmp_path / "rank0.log").read_text()[-3000:]
    (report,) = [json.loads((tmp_path / "report0.json").read_text())]
    assert all(report["faults_fired"].values()) and report["agreement"] == "FSDPAgreement"
    assert all(s["clean"] for s in report["steps"]) and report["adam_steps"] == [3]
    assert_weights_equal_a_single_process_run(tmp_path, steps=3, world=1)


def assert_weights_equal_a_single_process_run(
    out: Path, steps: int, world: int, atol: float = 1e-5, max_norm: float | None = None
) -> None:
    """Every rank's gathered weights are equal, and within ``atol`` of one process's fp32 AdamW run on the whole of
    each global batch (the ranks' average of equal halves is its mean), clipped to ``max_norm`` if given."""
    from fsdp_worker import EPS, LR, global_batches

    weights = [torch.load(out / f"weights{rank}.pt") for rank in range(world)]
    for name in weights[0]:
        assert all(torch.equal(weights[0][name], other[name]) for other in weights), f"{name} differs between ranks"
    reference = make_llama(layers=4, hidden=64)
    initial = {name: value.clone() for name, value in reference.state_dict().items()}
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS)
    for batch in global_batches(steps):
        optimizer.zero_grad()
        reference(**batch).loss.backward()
        if max_norm is not None:
            assert torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm) > max_norm, "the clip scales"
        optimizer.step()
    assert set(weights[0]) == set(reference.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[0][name], value, rtol=0, atol=atol)
    assert any(not torch.equal(initial[name], value) for name, value in reference.state_dict().items())


SWEEP = Path(__file__).resolve().parent / "fsdp_sweep.py"


def check_fsdp_sweep(out: Path, mode: str, timeout: float) -> dict[str, Any]:
    """The FSDP2 fault sweep on two gloo ranks (tests/fsdp_sweep.py): every case agreed, clean and exact."""
    codes, hung = launch(SWEEP, out, mode, timeout=timeout)
    assert not hung and codes == [0, 0], "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    rank0, rank1 = reports(out)
    assert rank0["problems"] == rank1["problems"] == []
    assert rank1["allocations"] > 100 and rank1["faults"] >= 20
    # Each fault fired, but those armed in the last allocations of the optimizer step: with a fault armed, the
    # step's journal keeps its copies on the host, so the faulted step allocates less on the device there.
    assert all(fault > 0.8 * rank1["allocations"] for fault in rank1["unfired"])
    return rank1


@pytest.mark.slow  # (the default run keeps the main job, checkpointing and clipping: make test stays short)
@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_fsdp2_fault_sweep_on_a_sample_of_rank_ones_allocations(tmp_path: Path) -> None:
    check_fsdp_sweep(tmp_path, "sample", timeout=300)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.subprocess
@RANKS
def test_fsdp2_fault_sweep_on_every_allocation_of_rank_ones_step(tmp_path: Path) -> None:
    report = check_fsdp_sweep(tmp_path, "every", timeout=1800)
    assert report["faults"] == report["allocations"]


# -- what the guard refuses, and the rungs that stay off the ladder (one process, no process group) ---------------


def _sharded_looking(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its class swapped for an ``FSDPModule`` subclass, as ``fully_shard`` does (no mesh needed)."""
    module.__class__ = type(f"FSDP{type(module).__name__}", (FSDPModule, type(module)), {})
    return module


def test_fsdp1_is_refused_up_front_with_what_to_use_instead() -> None:
    flat = type("FullyShardedDataParallel", (torch.nn.Linear,), {})(4, 4)
    model = torch.nn.Sequential(flat, torch.nn.Linear(4, 1))
    with pytest.raises(GuardConfigError, match=r"FSDP1.*fully_shard"):
        OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_fsdp2_is_accepted_with_clipping_too() -> None:
    model = _sharded_looking(make_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = OOMGuard(mse_step(model), model=model, optimizer=optimizer, max_grad_norm=1.0)
    try:
        assert guard.options.max_grad_norm == 1.0
        assert guard._context.fact(SHARDED, False), "the guard must know the model is sharded, to skip rungs"
    finally:
        guard.close()


@pytest.mark.parametrize(
    "name", ["optimizer_offload", "layer_offload", "quantized_optimizer", "quantized_weights", "chunked_loss"]
)
def test_rungs_that_cannot_work_on_sharded_parameters_stay_off_the_ladder(name: str) -> None:
    rung = builtin(name)
    assert rung is not None
    facts = {"chunked_loss_applies": True, "trainable_bytes": 1, "state_ratio": 2.0, "block_bytes": (1, 1)}
    unsharded = RungContext(batch_size=8, num_blocks=2, frozen_linears=True, facts={**facts, SHARDED: False})
    sharded = RungContext(batch_size=8, num_blocks=2, frozen_linears=True, facts={**facts, SHARDED: True})
    assert rung.escalate(Plan(), unsharded) is not None, "the rung applies to this model unsharded"
    assert rung.escalate(Plan(), sharded) is None


def test_amp_gives_bf16_under_fsdp2_but_not_fp16() -> None:
    amp = builtin("amp")
    assert amp is not None
    bf16 = amp.escalate(Plan(), RungContext(batch_size=8, facts={SHARDED: True}))
    assert bf16 is not None and bf16.precision == "bf16"
    assert amp.escalate(Plan(), RungContext(batch_size=8, bf16_supported=False, facts={SHARDED: True})) is None
    assert amp.escalate(Plan(), RungContext(batch_size=8, bf16_supported=False)) is not None


@pytest.mark.parametrize("name", ["micro_batch", "checkpointing", "activation_offload"])
def test_the_exact_rungs_still_apply_under_fsdp2(name: str) -> None:
    rung = builtin(name)
    assert rung is not None
    assert rung.escalate(Plan(), RungContext(batch_size=8, num_blocks=4, facts={SHARDED: True})) is not None


def test_fsdp2_on_a_torch_without_the_reset_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(FSDPModule, "reset_iter_state")  # (torch before 2.13)
    model = _sharded_looking(make_mlp())
    with pytest.raises(GuardConfigError, match=r"torch 2.13 or newer.*reset_iter_state"):
        OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
