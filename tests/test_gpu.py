"""The same contract on a real CUDA device, under a memory cap. Skipped without CUDA (marker: gpu)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers.models import make_llama

from oomguard import OOMGuard, Plan, is_oom, oom_guard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CAP = 1 << 30  # 1 GiB: small enough that a batch of 64 x 512 tokens does not fit whole


@pytest.fixture
def capped() -> Iterator[None]:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP / total)
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_a_real_cuda_oom_is_detected(capped: None) -> None:
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(2 * CAP, dtype=torch.uint8, device="cuda")
    assert is_oom(info.value)


def test_guard_recovers_on_cuda_and_frees_back_to_baseline(capped: None) -> None:
    model = make_llama(layers=2, hidden=256).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = oom_guard(lambda batch: model(**batch), model=model, optimizer=optimizer)
    ids = torch.randint(0, 64, (64, 512), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    model(input_ids=ids[:1, :8], labels=ids[:1, :8]).loss.backward()  # warm up: cuBLAS keeps its workspace
    model.zero_grad(set_to_none=True)
    baseline = torch.cuda.memory_allocated()
    first = step(batch)
    second = step(batch)
    assert first.ooms >= 1
    assert second.ooms == 0
    assert first.rungs == ("micro_batch",)
    ooms = [event for event in step.guard.events if event.kind == "oom"]
    assert all(event.memory_after_recovery.allocated == baseline for event in ooms)  # type: ignore[attr-defined]
    assert torch.cuda.max_memory_allocated() <= CAP


def _trained_on_cuda(plan: Plan, journal: str = "auto") -> list[torch.Tensor]:
    """A 4-layer Llama trained three steps on CUDA on ``plan`` (no ladder), its weights after."""
    torch.manual_seed(0)
    model = make_llama(layers=4, hidden=256).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer, ladder=[], step_journal=journal)
    guard.plan = plan
    for seed in range(3):
        ids = torch.randint(0, 64, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        guard({"input_ids": ids, "labels": ids})
    weights = [p.detach().float().cpu() for p in model.parameters()]
    guard.close()
    return weights


def test_the_master_levels_step_begun_during_backward_is_the_step_after_backward_on_cuda() -> None:
    """Issue 27's early host step on CUDA: the host thread waits on events for its gradients, uploads on the
    caller's stream; the same bits as the step after backward (``step_journal="never"`` keeps it after)."""
    master = Plan(precision="bf16", optimizer_offload="master")
    early, after = _trained_on_cuda(master), _trained_on_cuda(master, journal="never")
    assert all(torch.equal(a, b) for a, b in zip(early, after, strict=True))


def test_layer_offload_with_the_next_block_prefetched_trains_as_the_device_does_on_cuda() -> None:
    """Issue 27's prefetch on the copy stream: the compute waits on each block's event; the weights of four
    streamed blocks are those of the plan that streams none, within the host step's float rounding."""
    streamed, resident = _trained_on_cuda(Plan(offload_layers=4)), _trained_on_cuda(Plan())
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(streamed, resident, strict=True))
