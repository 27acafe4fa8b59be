"""The master level's host step begun during the last backward: each bucket as soon as its gradients are complete.

At the master level the optimizer steps fp32 masters on the host (:mod:`.masters`). Stepped after backward, the
host's work stands between the last backward kernel and the next forward (1.2 s of a 1B model's step on a desktop
host) while the device idles. But a bucket of parameters whose gradients backward has finished cannot change any
more in this step, so where nothing after backward looks at every gradient at once, its step can run while backward
goes on: in the last micro-batch's backward, as soon as every parameter of a bucket has had its gradient accumulated
(the gradients leave as backward makes them, :mod:`.descent`), a host thread sums the bucket's gradients into their
fp32 sums, steps its masters with the user's Adam or AdamW (the same kernel as the step after backward would run:
the same bits) and sends the stepped weights up (:mod:`.ascent`). What is left (the buckets finished last, such as
a tied embedding, and any parameter without a gradient) steps as before, after backward, through the transaction.

Only where the step after backward would not look at all gradients first and nothing could make it differ:
the guard's own step (not a Trainer's), no gradient clipping, no ``GradScaler``, one process, exactly
:class:`torch.optim.Adam` or :class:`torch.optim.AdamW` with no step hooks, no wrapper of its own ``step`` (a
scheduler's step counter aside) and its state already made (its first step runs after backward), and a journal that
fits the host budget (``step_journal="never"``: none). Elsewhere nothing changes.

Backward must read no weight after its bucket stepped. Two things in the last forward would break that, and the
master level checks for both once the forward is done (:meth:`~.masters.MasterWeights.early_backward`): a reentrant
activation checkpoint in the graph (its backward recomputes its block from the weights as they are then: the step
stays after backward) and writes to the weights on the device made by the step function (an embedding's
``max_norm``, weights clipped in the step: committed to the masters before any bucket steps).

A step begun during backward is not committed until the attempt's step is: each bucket's masters and moments are
copied to host buffers (kept from step to step, 12 bytes a parameter) before it steps, and an attempt that fails
afterwards (an OOM later in backward, an interrupt, the step after backward) puts them back and uploads the
masters' rounding again. A parameter whose gradient backward accumulates again after its bucket stepped (backward
running forward code again by other means than a checkpoint the check knows) spoils the early steps: the rest of
that backward may have read a stepped weight, so the attempt is dropped and run again with the whole step after
backward, and the guard begins no step during backward again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.optim.adam import adam as torch_adam

from oomguard._backends.host import host_in_use
from oomguard._backends.memory import MemoryBackend, nbytes
from oomguard._effects.ascent import Ascent
from oomguard._effects.descent import Descent, summed
from oomguard._effects.hoststep import FUSED_OPTIMIZERS, HostStep, buckets, fuses
from oomguard._effects.interrupts import run_whole
from oomguard._graph import graph_nodes

__all__ = ["EarlyStep", "Groups", "SpoiledEarlyStep", "recomputes_forward"]

#: Halved weights by the optimizer's parameter groups: (the group, its weights).
Groups = list[tuple[dict[str, Any], list[Any]]]


class SpoiledEarlyStep(Exception):
    """A gradient came for a weight whose bucket had already stepped during backward (backward ran forward code
    again and accumulated into it twice): the gradients of the rest of that backward may have been computed from a
    stepped weight. Raised from the weight's hook, it ends the backward; the runner drops the attempt and runs it
    again with the whole step after backward. Never reaches a user."""


class _Early(Protocol):
    """What a halved weight keeps (see :class:`~oomguard._effects.masters._Weight`)."""

    param: torch.nn.Parameter
    master: torch.Tensor
    image: torch.Tensor
    grad: torch.Tensor | None
    staging: torch.Tensor | None
    summed: bool


@dataclass(eq=False)
class _Bucket:
    """Weights of one parameter group that step together once backward has finished all their gradients."""

    weights: list[Any]  # (_Early)
    group: dict[str, Any]
    fused: bool  # torch's fused CPU kernel (else its per-parameter loop), as the step after backward would run
    waiting: set[int] = field(default_factory=set)  # the weights whose gradient has not come yet, by identity


class EarlyStep:
    """The early host steps of one master level (see the module)."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}  # by weight identity, while armed
        self._optimizer: torch.optim.Optimizer | None = None  # set while armed, with the two below
        self._backend: MemoryBackend | None = None
        self._ascent: Ascent | None = None
        self._stream: torch.cuda.Stream | None = None  # the caller's CUDA stream, where the uploads go
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._copies: dict[int, torch.Tensor] = {}  # the journal's host buffers, by tensor identity (kept)
        self._journal: list[tuple[torch.Tensor, torch.Tensor]] = []  # this attempt's: (tensor, its copy)
        self.stepped: set[int] = set()  # the weights stepped early in this attempt, by identity
        #: Parameters (elements) the last step stepped during backward: what the planner's time model hides.
        self.elements = 0

    @property
    def armed(self) -> bool:
        return self._optimizer is not None

    @staticmethod
    def groups(weights: Sequence[_Early], optimizer: torch.optim.Optimizer) -> Groups | None:
        """The weights by the optimizer's groups (in its order), where its step of them may begin early (see the
        module: the optimizer, its hooks and state; the host aside); None where it may not."""
        if type(optimizer) not in FUSED_OPTIMIZERS or _hooked(optimizer) or _wrapped(optimizer):
            return None
        by_param = {id(w.param): w for w in weights}
        groups = []
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("differentiable"):
                return None
            members = [by_param[id(p)] for p in group["params"] if id(p) in by_param]
            for weight in members:
                state = optimizer.state.get(weight.param, {})
                keys = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group["amsgrad"] else set())
                if not keys <= state.keys() or any(not isinstance(state[k], torch.Tensor) for k in keys):
                    return None  # (the first step makes the state: after backward, journaled)
                if any(state[k].is_cuda for k in keys):
                    return None
            if members:
                groups.append((group, members))
        return groups or None

    def arm(
        self,
        groups: Groups,
        optimizer: torch.optim.Optimizer,
        host_step: HostStep,
        backend: MemoryBackend,
        ascent: Ascent,
        budget: int | None,
    ) -> bool:
        """The last backward is next: its buckets may step as they complete, where every condition of the module
        holds for the optimizer (its hooks and state) and for the host budget, their stepped weights going up
        through ``ascent``. True if armed."""
        self.disarm()
        self.elements = 0
        tensors = [t for _, members in groups for w in members for t in _mutable(optimizer, w)]
        needed = sum(nbytes(t) for t in tensors if not _fits(self._copies.get(id(t)), t))
        if budget is not None and (host_in_use(backend) or 0) + needed > budget:
            return False
        # What the host thread writes is made here, in the caller's thread, where host memory is counted.
        self._copies = {id(t): self._kept(t) for t in tensors}
        for group, members in groups:
            for weight in members:
                if weight.grad is None or weight.grad.shape != weight.master.shape:
                    weight.grad, weight.summed = torch.empty_like(weight.master), False
            fused = fuses(type(optimizer), group, host_step)
            for part in buckets([w.master for w in members]):
                ids = {id(m) for m in part}
                chosen = [w for w in members if id(w.master) in ids]
                entry = _Bucket(chosen, group, fused, {id(w) for w in chosen})
                self._buckets.update({id(w): entry for w in chosen})
        self._optimizer, self._backend, self._ascent = optimizer, backend, ascent
        first = groups[0][1][0]  # (the host thread's uploads go on the caller's stream, as the step's do)
        cuda = first.param.device.type == "cuda" and not is_fake(first.master)
        self._stream = torch.cuda.current_stream(first.param.device) if cuda else None
        return True

    def _kept(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = self._copies.get(id(tensor))
        return copy if copy is not None and _fits(copy, tensor) else torch.empty_like(tensor)

    def taken(self, weight: _Early) -> bool:
        """Whether ``weight``'s bucket has begun its step (another gradient for it now spoils the early steps)."""
        bucket = self._buckets.get(id(weight))
        return bucket is not None and id(weight) not in bucket.waiting

    def ready(self, weight: _Early, descent: Descent) -> None:
        """Backward has sent ``weight``'s gradient down (``descent``): its bucket steps once it is complete."""
        bucket = self._buckets.get(id(weight))
        if bucket is None or id(weight) not in bucket.waiting:
            return
        bucket.waiting.discard(id(weight))
        if bucket.waiting:
            return
        descent.take(bucket.weights)  # (its copies are the bucket's to land: one wait for all of them)
        self.stepped.update(id(w) for w in bucket.weights)
        assert self._backend is not None
        copied = self._backend.fence()  # (the bucket's copies down: what its step waits for, and nothing later)
        if is_fake(weight.master):  # (the planner's fake step: in this thread, whose mode makes the fakes)
            self._step(bucket, copied)
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oomguard-early-step")
        self._pending.append(self._worker.submit(self._step, bucket, copied))

    def _step(self, bucket: _Bucket, copied: Callable[[], None]) -> None:
        """One bucket: its gradients landed and summed, its masters and moments journaled, stepped, sent up."""
        optimizer, backend, ascent = self._optimizer, self._backend, self._ascent
        assert optimizer is not None and backend is not None and ascent is not None
        copied()  # (its gradients' copies are complete: only this thread waits, backward goes on)
        for weight in bucket.weights:
            summed(weight)
        for tensor in [t for w in bucket.weights for t in _mutable(optimizer, w)]:
            self._journal.append((tensor, self._copies[id(tensor)].copy_(tensor)))
        with torch.no_grad():
            _adam(optimizer, bucket.group, bucket.weights, bucket.fused)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            ascent.send(bucket.weights, backend, in_step=False)
        self.elements += sum(w.master.numel() for w in bucket.weights)

    def wait(self) -> None:
        """Every bucket begun is stepped (the error of the first that failed raises here, once all have ended)."""
        for future in self._drain():
            future.result()

    def undo(self) -> None:
        """A failed attempt, or a gradient that came after its bucket stepped: each early step put back, whole (see
        :func:`.run_whole`), and the masters' rounding uploaded again; disarmed (what is left of the step runs
        after backward)."""
        everything = {id(b): b for b in self._buckets.values()}.values()
        stepped = [w for bucket in everything for w in bucket.weights if id(w) in self.stepped]
        ascent, backend = self._ascent, self._backend

        def restore() -> None:  # (after the drain: what the host thread journaled until it stopped)
            for tensor, copy in reversed(self._journal):
                tensor.copy_(copy)

        def resend() -> None:
            if ascent is not None and backend is not None:
                ascent.resend(stepped, backend)

        run_whole([self._drain, restore, resend])
        self.disarm()
        self.elements = 0

    def _drain(self) -> list[concurrent.futures.Future[None]]:
        """Every bucket begun ends, whether it stepped or failed; what they were."""
        pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)
        return pending

    def disarm(self) -> None:
        """Nothing more steps early (the attempt's step committed them, or they were undone)."""
        self._drain()
        self._buckets, self._optimizer, self._backend, self._ascent, self._journal = {}, None, None, None, []
        self.stepped = set()

    def close(self) -> None:
        """The level ends: nothing kept."""
        self.disarm()
        self._copies = {}
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether anything hooks the optimizer's step (it would see two steps, or a step without its buckets)."""
    from torch.optim import optimizer as module

    tables = [
        module._global_optimizer_pre_hooks,
        module._global_optimizer_post_hooks,
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
    ]
    return any(len(table) for table in tables)  # type: ignore[arg-type]


def _wrapped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` is replaced on the instance by something other than a scheduler's step counter
    (a wrapper clipping by value, a logger): it would never see the steps begun during backward."""
    step = vars(optimizer).get("step")
    if step is None:
        return False
    # (functools.wraps copies the counter's mark onto a wrapper of it: what it wraps tells them apart)
    counts = getattr(step, "_wrapped_by_lr_sched", False)
    return not (counts and getattr(step, "__wrapped__", None) is type(optimizer).step)


def recomputes_forward(loss: torch.Tensor) -> bool:
    """Whether backward from ``loss`` runs forward code again, reading the weights as they are then: a reentrant
    activation checkpoint (torch's, DeepSpeed's, transformers' default) recomputes its block inside its backward
    node. No weight may step and go up before that (the recompute would read the stepped weight)."""
    # (a custom Function's node is named for it: CheckpointFunctionBackward)
    return any("Checkpoint" in type(node).__name__ for node in graph_nodes(loss))


def _mutable(optimizer: torch.optim.Optimizer, weight: _Early) -> list[torch.Tensor]:
    """What stepping ``weight`` changes: its master and its state's tensors."""
    state = optimizer.state[weight.param]
    return [weight.master, *(value for value in state.values() if isinstance(value, torch.Tensor))]


def _fits(copy: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    return copy is not None and copy.shape == tensor.shape and copy.dtype == tensor.dtype


def _adam(optimizer: torch.optim.Optimizer, group: dict[str, Any], weights: list[Any], fused: bool) -> None:
    """torch's Adam (AdamW: its decoupled weight decay) on ``weights``' masters, with ``group``'s settings: what
    ``optimizer.step()`` runs on them with the host step's kernel (see :mod:`.hoststep`)."""
    states = [optimizer.state[w.param] for w in weights]
    beta1, beta2 = group["betas"]
    torch_adam(
        [w.master for w in weights],
        [w.grad for w in weights],
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
        [s["step"] for s in states],
        foreach=False,
        capturable=False,
        differentiable=False,
        fused=fused,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        decoupled_weight_decay=group.get("decoupled_weight_decay", False),
        amsgrad=group["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )
