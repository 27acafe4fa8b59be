"""The optimizer step on the host: torch's fused CPU kernel for Adam and AdamW, else its per-parameter loop where the
user asked for ``foreach``.

Where the offload rungs step parameters on the host (optimizer offload's copies and masters, layer offload's streamed
blocks), the user's own optimizer runs on CPU tensors. Two of its paths serve the CPU badly:

* ``foreach=True`` runs torch's multi-tensor path, which computes each intermediate for *every* parameter of a group
  before the next (Adam's ``sqrt(v)``: one more fp32 copy of the whole model, 4 bytes a parameter of host memory at
  the step's peak, a quarter of what optimizer offload keeps there) and is no faster on the CPU, which has no kernel
  launches to save. torch itself picks the loop for CPU tensors when ``foreach`` is left to it.
* The loop makes a pass over memory per elementwise operation; torch's fused CPU Adam (``fused=True``) makes one,
  in place, vectorised and threaded, with no temporaries at all.

So with ``host_step="fused"`` (the default), a group of exactly :class:`torch.optim.Adam` or
:class:`torch.optim.AdamW` (a subclass may step otherwise: left alone) whose parameters on the host are CPU tensors of
a float dtype with gradients of their own dtype steps them with ``fused=True``: the same hyperparameters, state and
learning rates, the same maths within float rounding (the kernel orders its operations otherwise: not bit for bit,
so the rung says so). The state it makes is the loop's (``step`` a float32 scalar on the CPU, moments like their
parameters), so the user's unfused optimizer loads and steps it. ``GradScaler`` still unscales the gradients itself:
it asks ``optimizer._step_supports_amp_scaling``, set when the optimizer was built unfused. With
``host_step="exact"``, and for the other optimizers whose loop and multi-tensor path give the same bits on CPU tensors
(checked for each, in ``tests/test_host_step.py``), the host part steps with ``foreach=False``: every bit the user's.

A group whose parameters step partly on the device (the blocks layer offload keeps there, its embeddings and head) is
split for the step: its device part steps as the user configured it, so the device keeps its kernels (on CUDA the
loop or the fused kernel would be another speed, or other bits), and only the host part changes path. The groups
change only while the optimizer's own ``step`` runs (step hooks): the scheduler, the step's journal and the user's
hooks see them as the user built them, and so does everything after the step, whether it raised or not.

Where the caller asks to hear of them (``stepped=``: the master level uploads each stepped weight as soon as it has
one), the host part of a group steps as buckets of about :data:`BUCKET_ELEMENTS` elements, each a group of its own
with the same entries (the state is per parameter: the same maths, bit for bit), and each bucket's parameters are
reported as the optimizer's loop over its groups moves past it, while the next bucket steps. torch's optimizers
listed in :data:`LOOPED_OPTIMIZERS` step each group whole in one pass of that loop; no others are changed here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.hooks import step_replaced

__all__ = [
    "BUCKET_ELEMENTS",
    "FUSED_OPTIMIZERS",
    "HOST_STEPS",
    "LOOPED_OPTIMIZERS",
    "HostStep",
    "Stepped",
    "buckets",
    "fuses",
    "host_loops",
]

#: How the host part of a step runs (see the module): torch's fused kernel, or the user's maths bit for bit.
HostStep = Literal["fused", "exact"]
HOST_STEPS: tuple[HostStep, ...] = ("fused", "exact")

#: The optimizers whose per-parameter loop gives the multi-tensor path's bits on CPU tensors (torch's NAdam and
#: RAdam do not: they keep their own path).
LOOPED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.SGD,
)

#: The optimizers whose host part steps with torch's fused CPU kernel under ``host_step="fused"``.
FUSED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)

#: About how many elements of host parameters step as one bucket where the stepped ones are reported (see the
#: module): 64 MiB of fp32 masters, 32 MiB of bf16 weights going up as the next bucket steps. A bucket holds whole
#: parameters: one larger than this is a bucket of its own.
BUCKET_ELEMENTS = 1 << 24

#: What hears of each bucket of host parameters as soon as the step has stepped it (see the module).
Stepped = Callable[[list[torch.Tensor]], None]


@contextlib.contextmanager
def host_loops(
    optimizer: torch.optim.Optimizer,
    backend: MemoryBackend,
    host_step: HostStep = "fused",
    stepped: Stepped | None = None,
) -> Iterator[None]:
    """Around an optimizer step: the host part of each group on the host path of ``host_step`` (see the module)
    while the optimizer's own ``step`` runs, and only then (from its last pre-hook to its first post-hook: the
    scheduler, the journal and the user's hooks see the groups as the user built them); everything as it was after
    it, whether it raised or not. ``stepped`` hears of each bucket of host parameters the step has stepped, while
    the step goes on (never of a bucket whose step raised)."""
    if not backend.offloads or type(optimizer) not in LOOPED_OPTIMIZERS:  # (a subclass may step otherwise)
        yield
        return
    split = _HostSplit(backend, fuse=host_step == "fused" and type(optimizer) in FUSED_OPTIMIZERS, stepped=stepped)
    before = optimizer.register_step_pre_hook(split.enter)  # (after the user's pre-hooks, registered earlier)
    after = optimizer.register_step_post_hook(split.leave)
    optimizer._optimizer_step_post_hooks.move_to_end(after.id, last=False)  # type: ignore[attr-defined]  # (first)
    stepping = optimizer.step  # (the class's, or a scheduler's wrapper of it)

    def step(*args: Any, **kwargs: Any) -> Any:
        try:
            return stepping(*args, **kwargs)
        finally:  # (a step that raised ran no post-hook: the journal's undo must see the user's groups)
            split.leave(optimizer)

    if hasattr(stepping, "_wrapped_by_lr_sched"):  # (a scheduler checks that it still counts the steps: it does)
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    try:
        with step_replaced(optimizer, step):
            yield
    finally:
        before.remove()
        after.remove()
        split.leave(optimizer)


class _HostSplit:
    """The groups of one optimizer changed for its step (:meth:`enter`) and put back (:meth:`leave`)."""

    def __init__(self, backend: MemoryBackend, fuse: bool, stepped: Stepped | None = None) -> None:
        self.backend, self.fuse, self.stepped = backend, fuse, stepped
        self._groups: list[dict[str, Any]] | None = None  # the optimizer's list of groups, while changed
        self._changed: list[tuple[dict[str, Any], dict[str, Any]]] = []  # each group changed, its entries before

    def enter(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """The host part of each group on its host path; a group stepping partly on the device split in two, and
        its host part in buckets where they are reported."""
        self.leave(optimizer)  # (a step hook that stepped again would nest: never twice)
        stepped = _Stepping(self.stepped)  # the groups the step sees
        for group in optimizer.param_groups:
            settings = _host_settings(group, self.fuse)
            host = [p for p in group["params"] if p.grad is not None and not self.backend.is_device(p)]
            if self.fuse and host and not _fusable(host):  # (a bf16 gradient of an fp32 master, say: the loop)
                settings = _host_settings(group, fuse=False)
            parts = buckets(host) if self.stepped is not None else [host]
            if not host or (not settings and len(parts) == 1):
                stepped.add(group, host)
                continue
            on_host = {id(p) for p in host}
            device = [p for p in group["params"] if id(p) not in on_host]
            if len(parts) == 1 and not any(p.grad is not None for p in device):  # the group whole on the host
                self._changed.append((group, {key: group[key] for key in settings}))
                group.update(settings)
                stepped.add(group, host)
                continue
            if any(p.grad is not None for p in device):  # a mixed group: the device part keeps the user's group
                self._changed.append((group, {"params": group["params"]}))
                group["params"] = device
                stepped.add(group, [])
            for bucket in parts:  # (copies of the group's entries: the state is the parameters')
                stepped.add({**group, **settings, "params": bucket}, bucket)
        self._groups, optimizer.param_groups = optimizer.param_groups, stepped

    def leave(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Every group, and the optimizer's list of them, as they were before :meth:`enter` (none changed: a no-op)."""
        if self._groups is not None:
            optimizer.param_groups, self._groups = self._groups, None
        for group, before in reversed(self._changed):
            group.update(before)
        self._changed.clear()


class _Stepping(list[dict[str, Any]]):
    """The groups an optimizer steps (see :meth:`_HostSplit.enter`): iterated, it reports each group's host
    parameters once the loop has moved past it (the group is stepped), where there is someone to hear of them."""

    def __init__(self, stepped: Stepped | None) -> None:
        super().__init__()
        self._stepped = stepped
        self._host: dict[int, list[torch.Tensor]] = {}  # by the group's identity: its host parameters

    def add(self, group: dict[str, Any], host: list[torch.Tensor]) -> None:
        self.append(group)
        if host:
            self._host[id(group)] = host

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for group in list.__iter__(self):
            yield group
            host = self._host.get(id(group))
            if host and self._stepped is not None:  # (the loop asked for the next group: this one is stepped)
                self._stepped(host)


def buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` in order, in buckets of about :data:`BUCKET_ELEMENTS` elements (whole parameters)."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for param in params:
        if buckets[-1] and size + param.numel() > BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += param.numel()
    return buckets


def fuses(optimizer: type[torch.optim.Optimizer], group: dict[str, Any], host_step: HostStep) -> bool:
    """Whether ``group``'s host part steps with torch's fused CPU kernel (its parameters fusable: see the module)."""
    fuse = host_step == "fused" and optimizer in FUSED_OPTIMIZERS
    return bool(group.get("fused")) or _host_settings(group, fuse).get("fused", False)


def _host_settings(group: dict[str, Any], fuse: bool) -> dict[str, Any]:
    """The entries ``group``'s host part steps with (none: as it is)."""
    if group.get("fused"):
        return {}  # (the user's own kernel choice: left as it is)
    if fuse and not group.get("capturable") and not group.get("differentiable"):  # (what the fused kernel refuses)
        return {"fused": True, "foreach": False}  # (torch refuses both at once)
    return {"foreach": False} if group.get("foreach") else {}


def _fusable(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused CPU Adam takes ``params``: CPU tensors of a float dtype, each gradient of its dtype."""
    return all(
        p.device.type == "cpu" and p.is_floating_point() and p.grad is not None and p.grad.dtype == p.dtype
        for p in params
    )
