"""Where a step is relative to a model's stack of blocks: before it, inside it, or past it, in each pass.

A phase's peak is affine in the count of identical blocks only where it is reached at a moment of the same kind
whatever the depth. A backward can peak past the stack on a shallow model (at the embedding's gradient, which
every block's gradients are resident beside) and inside it on a deep one (where the inputs saved by the blocks
below are still held): the two moments grow at different rates with the blocks, and a line through two shallow
peaks passes below the deep one (llama-3.2-1b streamed in micro-batches: 9 % below at 16 layers). So the probe
keeps each phase's peak per region (:class:`Regions`), each composed on its own (:mod:`oomguard._planner.compose`),
and the larger of them taken.

Within the stack the peak is at its first or its last block, whichever the blocks' saved inputs and gradients make
the larger; on a one-block model the two are the same block, so which it is does not change with the depth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from oomguard._effects.base import EffectTarget
from oomguard._effects.blocks import find_blocks, is_transformers_model

__all__ = ["BEFORE", "INSIDE", "PAST", "Regions", "stack"]

BEFORE, INSIDE, PAST = 0, 1, 2  # (the embedding and, in backward, the loss and head; the blocks; the rest)


class Regions:
    """Marks, per pass (``pass_key()``: the phase and micro-batch, as the probe keys its peaks), whether the stack of
    ``blocks`` has begun and whether it is done: in forward, the first block's start and the last block's end; in
    backward, the gradient of a block's output (its backward begins) and that of the first block's input (the
    stack's backward is done). A checkpoint's recompute, which runs the blocks' forward inside backward, marks
    nothing. Where the first block's input needs no gradient (frozen embeddings), backward never passes the stack:
    what follows it counts as inside, which the composition takes as one region, as before there were any."""

    def __init__(self, blocks: Sequence[torch.nn.Module], pass_key: Callable[[], Hashable]) -> None:
        self._blocks, self._key = list(blocks), pass_key
        self._begun: Hashable = None
        self._done: Hashable = None

    def __call__(self) -> int:
        """The region the step is in now."""
        key = self._key()
        return PAST if key == self._done else INSIDE if key == self._begun else BEFORE

    @contextlib.contextmanager
    def marking(self) -> Iterator[Regions]:
        """The blocks hooked for what runs inside (the hooks removed after)."""
        handles = []
        try:
            for index, block in enumerate(self._blocks):
                handles.append(block.register_forward_pre_hook(self._entering(first=index == 0), with_kwargs=True))
                handles.append(block.register_forward_hook(self._leaving(last=index == len(self._blocks) - 1)))
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _entering(self, first: bool) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if _recomputing():
                return
            self._begun = self._key()
            if first and torch.is_grad_enabled():
                _on_gradient((args, kwargs), self._stack_done)

        return hook

    def _leaving(self, last: bool) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if _recomputing():
                return
            if last:
                self._done = self._key()
            if torch.is_grad_enabled():
                _on_gradient(output, self._stack_begun)

        return hook

    def _stack_begun(self, grad: torch.Tensor) -> None:
        self._begun = self._key()

    def _stack_done(self, grad: torch.Tensor) -> None:
        self._done = self._key()


def stack(target: EffectTarget) -> list[torch.nn.Module]:
    """The blocks of ``target``'s model whose regions the probe tells apart: its repeated blocks, or the one decoder
    layer of a transformers model cut to one (the copy composition starts from; any other model has no stack at
    one block, and is composed from two and three)."""
    if target.blocks or not is_transformers_model(target.model):
        return target.blocks
    return find_blocks(target.model, least=1)


def _on_gradient(tensors: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """``hook`` called when the gradient of each tensor in ``tensors`` that needs one is computed."""
    for leaf in tree_flatten(tensors)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(hook)  # type: ignore[no-untyped-call]


def _recomputing() -> bool:
    """Whether a block's forward runs inside backward (a checkpoint's recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)
