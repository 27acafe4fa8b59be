"""The autograd graph behind a loss, walked once: what backward from it will run (each node once)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["graph_nodes"]


def graph_nodes(loss: torch.Tensor) -> Iterator[Any]:
    """Every node backward from ``loss`` runs, each once (its ``AccumulateGrad`` nodes too: their ``variable`` is
    the leaf they accumulate into). The nodes walked are kept alive until the walk ends: an identity freed could be
    taken by a node not yet seen, which would then be skipped."""
    kept: list[Any] = []
    seen: set[int] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        kept.append(node)
        yield node
        todo.extend(next_node for next_node, _ in node.next_functions)
