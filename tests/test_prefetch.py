"""Layer offload brings the next block of a pass in while the current one computes (issue 27): block k+1 in
forward, k-1 in backward, on CUDA on the copy stream (the compute waits only when it reaches it). Under the
simulator the same code runs, each copy a memcpy: what is checked here is the order, the memory (at most one more
block resident), the maths, and what the planner's time model makes of it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.batches import ragged_lm_batch
from helpers.models import make_llama
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard import OOMGuard, Plan
from oomguard._planner.engine import dry_run
from oomguard._planner.speed import DeviceSpeed
from oomguard.testing import SimulatedGPU

STREAMED = Plan(offload_layers=4)
BATCH = ragged_lm_batch([6, 6], seq_len=6)


def trained(prefetch: bool, monkeypatch: pytest.MonkeyPatch, events: list[Any] | None = None) -> tuple[Any, int]:
    """A 4-layer Llama with every layer streamed, two steps; its weights and the second step's peak. ``events``
    gets ("prefetch", layer) for each weight prefetched and ("forward"/"backward", layer) as each layer's compute
    begins (after the guard's own hooks)."""
    monkeypatch.setattr("oomguard._effects.layers.PREFETCH_FROM", 3 if prefetch else 1000)
    model = make_llama(layers=4, hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer, ladder=[])
    guard.plan = STREAMED
    layer_of = {id(p): i for i, layer in enumerate(model.model.layers) for p in layer.parameters()}
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(BATCH)
        if events is not None:
            prefetch_copy = gpu.prefetch
            hosts = {p.data_ptr(): layer_of[id(p)] for p in model.parameters() if id(p) in layer_of}  # (host copies)

            def spy(device: torch.Tensor, host: torch.Tensor) -> Any:
                events.append(("prefetch", hosts.get(host.data_ptr())))
                return prefetch_copy(device, host)

            gpu.prefetch = spy  # type: ignore[method-assign]
            for index, layer in enumerate(model.model.layers):
                layer.register_forward_pre_hook(lambda *_, i=index: events.append(("forward", i)))
                layer.register_full_backward_pre_hook(lambda *_, i=index: events.append(("backward", i)))
        gpu.reset_peak_memory_stats()
        guard(BATCH)
        peak = gpu.max_memory_allocated()
    return [p.detach().clone() for p in model.parameters()], peak


def test_each_next_block_is_on_its_way_before_the_compute_reaches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[Any] = []
    trained(True, monkeypatch, events)
    order = [event for i, event in enumerate(events) if i == 0 or event != events[i - 1]]  # (a weight each: once)
    forward, backward = order[: order.index(("backward", 3))], order[order.index(("backward", 3)) :]
    # (Each layer's own events come after the guard's hooks: the next layer is sent for as this one begins.)
    assert forward == [("prefetch", 1), ("forward", 0), ("prefetch", 2), ("forward", 1), ("prefetch", 3),
                       ("forward", 2), ("forward", 3)]  # fmt: skip
    assert backward == [("backward", 3), ("prefetch", 2), ("backward", 2), ("prefetch", 1), ("backward", 1),
                        ("prefetch", 0), ("backward", 0)]  # fmt: skip


def test_prefetching_keeps_the_maths_and_at_most_one_more_block_resident(monkeypatch: pytest.MonkeyPatch) -> None:
    ahead, peak = trained(True, monkeypatch)
    one_by_one, plain_peak = trained(False, monkeypatch)
    weights = make_llama(layers=4, hidden=64).model.layers[0].parameters()
    layer = sum(-(-p.numel() * p.element_size() // 512) * 512 for p in weights)  # (allocations of 512 B blocks)
    assert all(torch.equal(a, b) for a, b in zip(ahead, one_by_one, strict=True))
    assert plain_peak <= peak <= plain_peak + layer, f"{peak - plain_peak} B more at the peak; a layer is {layer} B"


def test_the_planner_counts_the_prefetched_blocks_beside_the_compute_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks' copies up had all been added to the compute (it waited for each)."""
    slow = DeviceSpeed(gpu_tflops=1e-4, link_gbps=0.05)  # (compute long enough to hide copies, copies that matter)

    def candidate(prefetch: bool) -> Any:
        monkeypatch.setattr("oomguard._effects.layers.PREFETCH_FROM", 3 if prefetch else 1000)
        with FakeTensorMode():
            model = make_llama(layers=4, hidden=64)
            report = dry_run(
                lambda b: model(**b), ragged_lm_batch([6, 6], seq_len=6), model=model,
                optimizer=torch.optim.AdamW(model.parameters()), capacity=2**40, target="cuda", label="llama",
                plans=[STREAMED], speed=slow,
            )  # fmt: skip
        return report.candidates[0]

    ahead, waited = candidate(True), candidate(False)
    assert ahead.transfer_bytes == waited.transfer_bytes, "the same copies"
    saved = waited.predicted_seconds - ahead.predicted_seconds
    assert 0 < saved <= ahead.transfer_bytes / (slow.link_gbps * 1e9), f"{saved} s hidden"
