"""What the rungs' effects leave on the model and hold on the device: undoing one (closing the guard, relaxing the
plan) leaves no trace of its own and gives back what the user had set up; one effect holds no copy another already
made. Each test was written against a bug found in review, named above it, and fails on the code as reviewed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.batches import ragged_lm_batch, tuple_batch
from helpers.models import make_llama
from helpers.steps import mse_step

from oomguard import OOMGuard, Plan, StepRollbackError
from oomguard.testing import SimulatedGPU


def lm_guard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> OOMGuard:
    return OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer, **options)


class _Blocks(torch.nn.Module):
    """A plain (non-transformers) model with three repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


# Bug (the checkpointing effect, transformers models): the undo is activation_checkpointing_disable, which does not
# remove the enable_input_require_grads forward hook transformers put on the input embeddings; every enable adds one.
def test_close_removes_the_input_embedding_hook_that_checkpointing_added() -> None:
    model = make_llama(layers=2)
    embeddings = model.get_input_embeddings()
    hooks_before = len(embeddings._forward_hooks)
    guard = lm_guard(model, torch.optim.SGD(model.parameters(), lr=0.1), ladder=[])
    batch = ragged_lm_batch([12, 3])
    for mode in ("partial", "full"):  # the ladder's own order
        guard.plan = Plan(checkpointing=mode)
        guard(batch)
    guard.close()
    assert len(embeddings._forward_hooks) == hooks_before


# Bug (the checkpointing effect, transformers models): it did not remember the model's own checkpointing: the "partial"
# rung un-checkpoints half the layers of a user-checkpointed model (more memory, not less), and undoing it (relaxing the
# plan, guard.close()) turns the user's checkpointing off entirely.
def test_checkpointing_effect_restores_the_users_own_checkpointing() -> None:
    model = make_llama(layers=2)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    guard = lm_guard(model, torch.optim.SGD(model.parameters(), lr=0.1), ladder=[])
    guard.plan = Plan(checkpointing="partial")
    guard(ragged_lm_batch([12, 3]))
    guard.close()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


# Bug (the checkpointing effect, other models, its undo): it deleted the block's instance `forward` attribute, so a
# forward the block already had as an instance attribute (a wrapper, an accelerate-style hook) is lost for good.
def test_generic_checkpointing_undo_keeps_an_existing_instance_forward() -> None:
    model = _Blocks()
    original = model.blocks[0].forward

    def doubled(x: torch.Tensor, _forward: Any = original) -> torch.Tensor:
        return _forward(x) * 2

    model.blocks[0].forward = doubled  # type: ignore[method-assign]
    guard = OOMGuard(mse_step(model), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), ladder=[])
    guard.plan = Plan(checkpointing="full")
    guard(tuple_batch())
    guard.close()
    assert vars(model.blocks[0]).get("forward") is doubled


# Bug (activation offload beside layer offload): activation offload kept only the storages parameters have when the
# forward starts; a streamed (layer-offloaded) block's weights get their device storage later, so every weight it saves
# for backward is copied to the host and back to the device in backward (a second device copy of the weights).
def test_activation_offload_does_not_copy_streamed_weights() -> None:
    model = make_llama(layers=2)
    in_forward = False
    copied: list[tuple[int, ...]] = []

    def step(batch: dict[str, torch.Tensor]) -> Any:
        nonlocal in_forward
        in_forward = True
        try:
            return model(**batch)
        finally:
            in_forward = False

    guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), ladder=[])
    guard.plan = Plan(activation_offload=True, offload_layers=2)
    batch = ragged_lm_batch([12, 12])
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        to_host = gpu.to_host

        def spy(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            if in_forward:
                params = {id(p.untyped_storage()) for p in model.parameters()}
                if id(tensor.untyped_storage()) in params:
                    copied.append(tuple(tensor.shape))
            return to_host(tensor, out)

        gpu.to_host = spy  # type: ignore[method-assign]
        guard(batch)
    assert copied == []


def test_streamed_gradients_go_down_without_a_synchronize_each() -> None:
    """Issue 27: layer offload synchronized once per gradient (so that the host could add it), stalling the
    device's compute on every copy; the first micro-batch's gradients need no add, and the step waits once."""
    model = make_llama(layers=4, hidden=64)
    guard = lm_guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ladder=[])
    guard.plan = Plan(offload_layers=4)
    batch = ragged_lm_batch([6, 6], seq_len=6)
    streamed = sum(1 for p in model.model.layers.parameters())
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard(batch)  # (the first step on the plan offloads the blocks)
        synchronize, waits = gpu.synchronize, []

        def counted() -> None:
            waits.append(1)
            synchronize()

        gpu.synchronize = counted  # type: ignore[method-assign]
        before = [p.detach().clone() for p in model.parameters()]
        guard(batch)
    assert len(waits) <= 4, f"{len(waits)} synchronizes for a step streaming {streamed} gradients"
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), "it stepped"


# Bug (the optimizer step's transaction, relaxing a plan): the step's transient-memory bound was kept across plan
# changes. Measured while the offloaded layers' optimizer ran on the host, it is far too small once the plan is relaxed
# and that state is back on the device: the fast (unjournaled) path is taken, the foreach AdamW step runs out of memory
# after changing the moments in place, and the call dies with StepRollbackError instead of falling back.
@pytest.mark.parametrize("capacity", [3_050_000, 3_100_000])
def test_relaxing_the_plan_does_not_reuse_a_host_side_step_bound(capacity: int) -> None:
    model = make_llama(layers=4, hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    guard = lm_guard(model, optimizer, ladder=["layer_offload"])
    batch = ragged_lm_batch([4], seq_len=4)
    guard.plan = Plan(offload_layers=4)
    with SimulatedGPU(capacity) as gpu:
        gpu.adopt(model)
        guard(batch)
        guard(batch)  # steady state: the fast path is allowed from here on
        guard.plan = Plan()
        try:
            result = guard(batch)
        except StepRollbackError as exc:
            pytest.fail(f"relaxed step could not be retried: {exc}")
    assert result.step == 2


# Bug (layer offload under amp): under amp each streamed weight is cast to bf16/fp16; the autocast cache kept that copy
# until the forward ended, so releasing the fp32 storage freed none of it. Fixed by turning the cache off while layers
# are offloaded. The cast copy a linear layer saves for backward kept them too (TinyLlama at micro-batch 1: bf16 + layer
# offload peaked at 6.5 GiB, fp32 at 5.7): such copies are now made again from the weight in backward
# (saved_tensor_hooks in the layer-offload effect), with or without activation offload.
@pytest.mark.parametrize("activation_offload", [True, False], ids=["with activation offload", "layer offload alone"])
def test_layer_offload_under_amp_does_not_keep_cast_weights_of_every_block(activation_offload: bool) -> None:
    def held_after_forward(plan: Plan) -> int:
        model = make_llama(layers=4, hidden=128)
        gpu = SimulatedGPU("1GiB")
        held: list[int] = []

        def step(batch: dict[str, torch.Tensor]) -> Any:
            output = model(**batch)
            held.append(gpu.memory_allocated())
            return output

        guard = OOMGuard(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), ladder=[])
        guard.plan = plan
        batch = ragged_lm_batch([12, 12])
        with gpu:
            gpu.adopt(model)
            guard(batch)
            resident = gpu.memory_allocated()  # between steps: what is left on the device
            guard(batch)
        return held[-1] - resident

    fp32 = held_after_forward(Plan(activation_offload=activation_offload, offload_layers=4))
    bf16 = held_after_forward(Plan(precision="bf16", activation_offload=activation_offload, offload_layers=4))
    assert bf16 <= fp32, f"bf16 forward holds {bf16} B above the resident weights, fp32 only {fp32} B"
