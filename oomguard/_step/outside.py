"""Leaves outside the optimizer: tensors a step's loss reaches that require grad but that the guard does not step.

A learnable loss weight kept out of the model, an adversarial input, a parameter missing from the optimizer: their
gradients accumulate over micro-batches like the model's, but the guard only drops the model's after a failed
attempt. Without more, the gradient of a micro-batch that ran before the OOM would be counted again by the retry.
So the first loss of the guard's first attempt is walked back to its leaves once (walking every step's graph
would cost milliseconds a step), the batch's own tensors that require grad are added at every call (a fresh
adversarial input per batch), and at the first micro-batch of every attempt the gradients of those outside the
optimizer are kept, to be put back if the attempt fails. A leaf made anew for each batch that the loss reaches
only through the step function's closure is not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from oomguard._graph import graph_nodes
from oomguard._step.batch import batch_leaves

__all__ = ["OutsideLeaves"]

Saved = list[tuple[torch.Tensor, torch.Tensor | None]]


class OutsideLeaves:
    """The leaves a step's loss reaches outside ``params``, found once, and their gradients kept per attempt."""

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._params = params  # (asked at each attempt: the optimizer may have gained a group since)
        self._found: list[weakref.ref[torch.Tensor]] | None = None

    def keep(self, loss: torch.Tensor, batch: Any) -> Saved:
        """The leaves' gradients now (copies), before the attempt's first backward on ``batch``."""
        params = {id(p) for p in self._params()}
        if self._found is None:
            self._found = [weakref.ref(leaf) for leaf in _leaves(loss)]
        leaves = {id(leaf): leaf for ref in self._found if (leaf := ref()) is not None and id(leaf) not in params}
        for _, tensor in batch_leaves(batch):
            if tensor.requires_grad and tensor.is_leaf and id(tensor) not in params:
                leaves.setdefault(id(tensor), tensor)
        return [(leaf, None if leaf.grad is None else leaf.grad.detach().clone()) for leaf in leaves.values()]

    @staticmethod
    def put_back(saved: Saved) -> None:
        """After a failed attempt: each leaf's gradient as it was before the attempt."""
        for leaf, grad in saved:
            leaf.grad = grad


def _leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """Every leaf that backward from ``loss`` accumulates a gradient into (an ``AccumulateGrad`` node's)."""
    return [leaf for node in graph_nodes(loss) if isinstance(leaf := getattr(node, "variable", None), torch.Tensor)]
