"""Shared builders: small models, batches and optimizers, all with fixed seeds and random weights."""

from __future__ import annotations

import copy
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from oomguard.testing import SimulatedGPU

VOCAB = 64
# The default ladder before optimizer_offload joined it: for tests of what other rungs, the journal or the
# agreement do after an optimizer-phase OOM (optimizer_offload would answer it first, and step on the host).
LADDER_WITHOUT_OPTIMIZER_OFFLOAD = ["micro_batch", "amp", "checkpointing", "activation_offload", "layer_offload"]

if os.environ.get("PYTEST_XDIST_WORKER"):  # one intra-op thread per test worker: no oversubscribed cores
    torch.set_num_threads(1)


def make_mlp(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def make_llama(seed: int = 0, layers: int = 2, hidden: int = 32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model: torch.nn.Module = LlamaForCausalLM(config)
    return model


def tuple_batch(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=generator), torch.randn(n, generator=generator)


def mse_step(model: torch.nn.Module):  # type: ignore[no-untyped-def]
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)

    return step


def ragged_lm_batch(lengths: list[int], seq_len: int = 12, seed: int = 2) -> dict[str, torch.Tensor]:
    """Right-padded causal-LM batch: samples of different lengths, pads masked and labelled -100."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), seq_len), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it was stepped with, to compare accumulation exactly."""

    def __init__(self, params, lr: float = 0.1) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor | None]] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        self.seen.append(
            [None if p.grad is None else p.grad.detach().clone() for g in self.param_groups for p in g["params"]]
        )
        return super().step(closure)


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def first_event(events: list[Any], kind: str) -> Any:
    """The first event of ``kind`` (progress events interleave with the others)."""
    return next(event for event in events if event.kind == kind)


def train_unguarded(model: torch.nn.Module, batches: list[Any], lr: float = 1e-3) -> torch.nn.Module:
    """``model`` (a transformers LM) trained on ``batches`` with AdamW, no guard: the reference runs compare to."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def train_on(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    plan: Any = None,
    budget: int | str = "1GiB",
    ladder: list[str] | None = None,
) -> tuple[Any, list[Any], int]:
    """Train ``model`` (a transformers LM) on ``batches``, guarded, under a SimulatedGPU of ``budget``: on ``plan``
    with no ladder, or from the plain plan down ``ladder``; no tuning. The guard, each step's StepResult and the
    last step's peak."""
    from oomguard import OOMGuard

    guard = OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer,
                     ladder=[] if ladder is None else ladder, tune_after=None)  # fmt: skip
    if plan is not None:
        guard.plan = plan
    with SimulatedGPU(budget) as gpu:
        gpu.adopt(model)
        results = []
        for batch in batches:
            gpu.reset_peak_memory_stats()
            results.append(guard(batch))
        peak = gpu.max_memory_allocated()
    return guard, results, peak


class CountingGPU(SimulatedGPU):
    """A SimulatedGPU that calls :meth:`counted` whenever its allocation count grows, from inside its own
    bookkeeping (the count is a plain attribute the simulator increments)."""

    def __init__(self, capacity: int | str) -> None:
        self._count = 0
        super().__init__(capacity)

    @property
    def allocations(self) -> int:
        return self._count

    @allocations.setter
    def allocations(self, value: int) -> None:
        before, self._count = self._count, value
        self.counted(before, value)

    def counted(self, before: int, after: int) -> None:
        """Allocations ``before + 1`` to ``after`` were just made."""


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt), put back as it was after (a test runner's worker may have
    put another in place)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
