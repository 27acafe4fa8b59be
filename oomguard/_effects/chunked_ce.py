"""The output head and cross-entropy of a causal LM, a chunk of rows at a time: the full logits never exist.

:func:`chunked_cross_entropy` returns the *sum* of the per-token cross-entropies of ``steps(x @ W.T + b)``
against ``target`` (``ignore_index`` rows count nothing), with its gradients computed in the forward, chunk by
chunk, so the head's product runs once per step, as without chunking (the device model prices one product, not
two). Per chunk: the logits, the recorded element-wise steps (softcap, logit scale) and transformers' own
``.float()`` + ``cross_entropy`` run under a local autograd, whose gradient of the chunk's logits gives the
chunk's input gradient and adds to the head's weight (and bias) gradient, accumulated in fp32 across chunks
(bf16 accumulation is a known cause of divergence). Backward only scales the kept gradients by the upstream one.

Why not torch 2.13's ``torch.nn.functional.linear_cross_entropy`` (with ``LinearCrossEntropyOptions``), which the
issue prefers? It was checked here (fp32 loss within 3e-7, gradients within 1.4e-6 of the unchunked ones; it runs
under ``FakeTensorMode``) and does not serve, for two reasons:

* It is one opaque custom op (``torch_nn._linear_cross_entropy_batch_chunked``): a dispatch mode sees that op and
  its outputs, never the chunk buffers it allocates inside. ``oomguard.testing.SimulatedGPU`` and the fault sweep
  (which fails every allocation of a step in turn) are dispatch modes: under them a 4 x 256-token, 32,000-word
  step's loss showed 16 MiB where the op really allocates a 512-row chunk of fp32 logits (62.5 MiB) and its
  softmax; the planner's fake-tensor run, priced the same way, would under-count too. Here every allocation is an
  ordinary aten op, counted and faultable like the rest of the step.
* Between the head and the loss, models apply element-wise steps to the logits: Gemma 2/3's softcap is a
  ``tanh``, which does not commute with the product, so the op could not compute their loss; here it runs inside
  the chunk, exactly (and linear scales need no special case either).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.nn import functional

from oomguard._effects.elision import elided
from oomguard._effects.lazy_logits import Step

__all__ = ["ChunkSpec", "chunk_rows", "chunked_cross_entropy", "needs_of"]

_FLOOR_BYTES = 8 * 2**20  # a chunk's fp32 logits may take at least this much: fewer, larger products


def chunk_rows(rows: int, vocab: int, hidden_bytes: int, chunk_bytes: int | None = None) -> int:
    """How many rows one chunk takes: its fp32 logits at most ``chunk_bytes``, by default the larger of 8 MiB and
    the hidden states' size (Liger's rule: the loss's working memory no larger than its input's), at least 1."""
    budget = chunk_bytes if chunk_bytes is not None else max(_FLOOR_BYTES, hidden_bytes)
    return max(1, min(rows, budget // (4 * vocab)))  # 4: bytes of one fp32 logit


@dataclass(frozen=True)
class ChunkSpec:
    """How to compute one loss: the head's dtype, the recorded steps, the ignored label and the chunk's rows."""

    dtype: torch.dtype  # what the head computes in (autocast's dtype, or the operands' own)
    steps: tuple[Step, ...]
    ignore_index: int
    rows: int
    needs: tuple[bool, bool, bool]  # whether the input, the weight and the bias need a gradient


def chunked_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    spec: ChunkSpec,
) -> torch.Tensor:
    """The fp32 sum of the cross-entropies of ``spec.steps(linear(x, weight, bias))`` rows against ``target``.

    ``x``: (rows, hidden), ``target``: (rows,) class indices. Differentiable in ``x``, ``weight`` and ``bias``."""
    result: torch.Tensor = _ChunkedHeadLoss.apply(x, weight, bias, target, spec)  # type: ignore[no-untyped-call]
    return result


def needs_of(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[bool, bool, bool]:
    """Which of the operands a gradient must be made for (read outside the Function: its forward runs with grad
    mode off)."""
    on = torch.is_grad_enabled()
    return (on and x.requires_grad, on and weight.requires_grad, on and bias is not None and bias.requires_grad)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Forward: the loss and every gradient, chunk by chunk. Backward: the kept gradients times the upstream one."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        spec: ChunkSpec,
    ) -> torch.Tensor:
        need_x, need_w, need_b = spec.needs
        # The operands in the head's dtype once (a no-op without autocast), as F.linear under autocast casts them.
        w = weight.to(spec.dtype)
        b = None if bias is None else bias.to(spec.dtype)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_x else None
        # fp32 accumulators: a bf16 weight gradient summed over many chunks would lose the small ones.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b else None
        with torch.autocast(x.device.type, enabled=False):  # casts are explicit here; backward has no autocast
            for start, standing_for in _runs(x, spec.rows):
                rows = slice(start, start + spec.rows)
                with standing_for:
                    xc = x[rows].to(spec.dtype)
                    loss, grad_logits = _chunk(xc, w, b, target[rows], spec)
                    total += loss
                    if grad_logits is None:
                        continue
                    if grad_x is not None:
                        grad_x[rows] = grad_logits @ w  # cast to x's dtype by the copy, as autocast's backward does
                    if grad_w is not None:
                        _accumulate(grad_w, grad_logits.t(), xc)
                    if grad_b is not None:
                        grad_b += grad_logits.sum(0, dtype=torch.float32)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in place: a second backward through the same graph (retain_graph) then fails autograd's version
        # check with its own clear error, instead of using gradients that were scaled already.
        grads: Sequence[torch.Tensor | None] = ctx.saved_tensors
        out = [None if g is None else g.mul_(grad_total).to(dtype) for g, dtype in zip(grads, ctx.dtypes, strict=True)]
        return (*out, None, None)


def _runs(x: torch.Tensor, rows: int) -> list[tuple[int, AbstractContextManager[None]]]:
    """The first row of each chunk run, and the context it runs in: every chunk, each by itself; but on fake tensors
    while a dry run elides repetitions (:mod:`oomguard._effects.elision`), only the first chunk, the second standing
    for every one up to the last, and the last. Those are all the situations a chunk meets: the first runs with no
    chunk before it, every later one beside the previous chunk's gradient of its logits (still held while the next
    is computed), and the last maybe on fewer rows; each frees what it made, so their memory is the same."""
    starts = list(range(0, x.shape[0], rows))
    repeat = elided()
    if repeat is None or len(starts) < 4 or not is_fake(x):
        return [(start, contextlib.nullcontext()) for start in starts]
    return [
        (starts[0], contextlib.nullcontext()),
        (starts[1], repeat(len(starts) - 2)),
        (starts[-1], contextlib.nullcontext()),
    ]


def _chunk(
    xc: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, spec: ChunkSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's summed loss (fp32, no history) and the gradient of that sum in the chunk's logits (None when
    nothing needs a gradient). The loss is transformers' ``ForCausalLMLoss`` on these rows: ``.float()`` then
    ``cross_entropy`` with ``ignore_index``, summed."""
    logits = functional.linear(xc, w, b)
    wanted = any(spec.needs)
    # A local graph from the chunk's logits to its loss, freed with the chunk; its saved tensors stay where they are
    # (the activation offload rung's hooks would copy every chunk's softmax to the host and back).
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
        leaf = logits.requires_grad_(wanted)  # ``logits`` was made with grad off: a leaf of this local graph
        out = leaf
        for step in spec.steps:
            out = step(out)
        loss = functional.cross_entropy(out.float(), target, ignore_index=spec.ignore_index, reduction="sum")
        if not wanted:
            return loss.detach(), None
        (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """A saved tensor, kept where it is. Detached: a saved output handed back as itself would hold its own
    grad_fn, a cycle through autograd's C++ graph that the garbage collector cannot see, and a chunk that runs
    out of memory before its gradient is taken would then never be freed (as in the guard's own hooks)."""
    return tensor.detach() if tensor.grad_fn is not None else tensor


def _accumulate(into: torch.Tensor, grad_logits_t: torch.Tensor, xc: torch.Tensor) -> None:
    """``into += grad_logits_t @ xc`` in fp32: in place where the operands are fp32, else their product (in the
    head's dtype, as the unchunked backward computes it) added to the fp32 sum."""
    if grad_logits_t.dtype == into.dtype:
        into.addmm_(grad_logits_t, xc)
    else:
        into += grad_logits_t @ xc
