"""The dispatch side of the accounting: the ``TorchDispatchMode`` that shows every aten op to the accounting of
:mod:`oomguard._backends.accounting`, and the helpers that classify ops and their tensors.

What is counted, and why, is told in :mod:`oomguard._backends.accounting`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_map

from oomguard._backends.units import format_bytes
from oomguard._bitsandbytes import quant_state_tensors

__all__: list[str] = []

_aten = torch.ops.aten
FRESH = {_aten.lift_fresh.default}
RESIZE = _aten.resize_.default
# Ops that update running statistics in place without saying so in their schema.
_UNANNOTATED_MUTATION = {
    _aten.native_batch_norm.default,
    _aten.cudnn_batch_norm.default,
    _aten.miopen_batch_norm.default,
}
# Batch-norm ops whose sixth argument is `training`; in eval mode they mutate nothing (and their meta kernels
# report statistics outputs the CPU kernels do not allocate), so they are not sized in advance then.
_BATCH_NORM_WITH_STATS = {_aten._native_batch_norm_legit.default}


#: Ops that read a tensor's metadata (C++ asks a fake tensor's device through the dispatcher): nothing to account.
_METADATA = {torch.ops.prim.device.default, torch.ops.prim.layout.default}


@functools.cache
def allocates_nothing(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` only reads metadata or makes views: every output aliases an input, nothing is written, so
    no storage is made, grown or changed and there is nothing to account (half the ops of a training step)."""
    if func in _METADATA:
        return True
    if func in FRESH:  # (its output aliases a constant made outside the mode: accounted as new)
        return False
    schema = func._schema
    if schema.is_mutable or not schema.returns:
        return False
    return all(ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns)


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``tensor``'s memory: itself, or a wrapper subclass's inner tensors (those it names in
    ``__tensor_flatten__``; the wrapper itself has no storage), recursively. A name that is no tensor (a DTensor
    names its device mesh) holds no memory."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [plain for part in inner if isinstance(part, torch.Tensor) for plain in plain_tensors(part)]


def cpu_storages(tree: Any) -> list[torch.UntypedStorage]:
    """The storages of the strided CPU tensors in ``tree`` (an op's arguments or outputs): the only ones
    accounted."""
    found: list[torch.UntypedStorage] = []
    for leaf in _tensors_in(tree, []):
        for tensor in plain_tensors(leaf):
            if tensor.device.type == "cpu" and tensor.layout == torch.strided:
                found.append(tensor.untyped_storage())
    return found


def _tensors_in(tree: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in ``tree``, through its lists, tuples and dicts: an op's arguments and outputs hold nothing
    else (``tree_flatten``'s registry of node types costs half the accounting of an op)."""
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _tensors_in(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors_in(item, found)
    return found


def writes_and_allocates(func: torch._ops.OpOverload, args: Any) -> bool:
    """Whether the op both mutates its inputs and allocates: it must be sized before it runs."""
    if func in _UNANNOTATED_MUTATION or func in _BATCH_NORM_WITH_STATS:
        return len(args) > 5 and bool(args[5])  # running statistics change only in training mode
    return _writes_and_returns_fresh(func)


@functools.cache
def _writes_and_returns_fresh(func: torch._ops.OpOverload) -> bool:
    schema = func._schema
    writes = any(arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments)
    return writes and any(ret.alias_info is None for ret in schema.returns)


def written(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors an in-place op writes to, from its schema's write annotations."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    found: list[torch.Tensor] = []
    for index, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(arg.name)
        for leaf in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
    return found


def to_meta(value: Any) -> Any:
    """A CPU tensor's meta twin (same shape, strides and dtype, no data); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def meta_output_bytes(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> list[int] | None:
    """The bytes of each fresh (not aliased) output storage ``func`` would make, from a run on meta tensors before
    the real one; None where the op has no meta kernel."""
    try:
        meta_out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    except (NotImplementedError, RuntimeError):
        return None
    aliased = {i for i, ret in enumerate(func._schema.returns) if ret.alias_info is not None}
    outs = meta_out if isinstance(meta_out, (tuple, list)) else (meta_out,)
    return [
        int(t.untyped_storage().nbytes())
        for i, t in enumerate(outs)
        if i not in aliased and isinstance(t, torch.Tensor)
    ]


def resized_bytes(tensor: torch.Tensor, size: Any) -> int:
    """The bytes ``tensor``'s storage needs after ``tensor.resize_(size)``."""
    numel = 1
    for dim in size:
        numel *= int(dim)
    return (int(tensor.storage_offset()) + numel) * tensor.element_size()


class Paused(threading.local):
    """Set while a device copies outside the accounting (per thread: other threads are still accounted);
    ``with paused:`` sets it for the block. One for every device (:data:`PAUSED`): a copy one device makes through
    its own primitives is accounted by that device alone, even while another one's mode is active (a guard
    dropped in one simulation and undone, by the garbage collector, inside the next)."""

    depth = 0

    @property
    def active(self) -> bool:
        return self.depth > 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


PAUSED = Paused()


ALIGN = 512  # CUDA's caching allocator rounds every block up to 512 bytes


def aligned(nbytes: int) -> int:
    """``nbytes`` as the device's allocator holds it."""
    return -(-nbytes // ALIGN) * ALIGN


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors of what ``adopt`` takes: a module's parameters, buffers and gradients (and the quantization state
    of its bitsandbytes 4-bit weights, resident beside them), an optimizer's state."""
    if isinstance(obj, torch.Tensor):
        return plain_tensors(obj)
    if isinstance(obj, torch.nn.Module):
        found = list(obj.parameters()) + list(obj.buffers())
        found += [t for p in obj.parameters() for t in quant_state_tensors(p)]  # (bitsandbytes' 4-bit weights)
        return tensors_of(found + [p.grad for p in obj.parameters() if p.grad is not None])
    if isinstance(obj, torch.optim.Optimizer):
        return tensors_of([v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)])
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        return [t for item in obj for t in tensors_of(item)]
    raise TypeError(f"adopt() takes modules, optimizers, tensors or iterables of them, got {type(obj).__name__}")


def untracked_storages(tensors: list[torch.Tensor], tracked: dict[int, int]) -> list[torch.UntypedStorage]:
    """The storages of the strided CPU tensors among ``tensors`` that are not ``tracked`` yet, each once."""
    fresh: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor.device.type == "cpu" and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            if id(storage) not in tracked:
                fresh[id(storage)] = storage
    return list(fresh.values())


#: Told an op, its arguments and keyword arguments (and, after it ran, its outputs).
OpHook = Callable[..., None]


class AccountingMode(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Runs every aten op between the accounting's two hooks: ``before`` may refuse it (raise the OOM a device
    would raise before the kernel ran), ``after`` accounts its outputs. Nothing is accounted while paused.

    An op on a wrapper tensor subclass (a quantized weight) is left to the subclass, with this mode still active:
    what it runs on its inner tensors is accounted, op by op."""

    def __init__(self, paused: Paused, before: OpHook, after: OpHook) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.paused, self.before, self.after = paused, before, after

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(kind) for kind in types):
            return NotImplemented  # (the subclass's __torch_dispatch__ runs next, under this mode)
        kwargs = kwargs or {}
        if self.paused.active or allocates_nothing(func):
            return func(*args, **kwargs)
        self.before(func, args, kwargs)
        mutated = written(func, args, kwargs)
        versions = [t._version for t in mutated]
        out = func(*args, **kwargs)
        # Under a dispatch mode some in-place kernels (the foreach ones) skip the version bump a real device
        # does; restore it, since the guard (and autograd) read version counters.
        stale = [t for t, v in zip(mutated, versions, strict=True) if t._version == v]
        if stale:
            increment_version(stale)
        self.after(func, args, kwargs, out)
        return out


def all_host(storages: list[torch.UntypedStorage], host: AbstractSet[int]) -> bool:
    """Whether an op on these input storages runs on the host: it has some, and all are ``host`` memory."""
    return bool(storages) and all(id(s) in host for s in storages)


def host_outputs(
    func: torch._ops.OpOverload, args: Any, out: Any, inputs: list[torch.UntypedStorage], host: AbstractSet[int]
) -> set[int]:
    """The output storages that an op computed on the host (from ``host`` inputs only; ``_foreach_`` ops decide
    per list element)."""
    if func.__name__.startswith("_foreach_") and isinstance(out, (list, tuple)):
        lists = [arg for arg in args if isinstance(arg, (list, tuple)) and len(arg) == len(out)]
        return {
            id(result.untyped_storage())
            for index, result in enumerate(out)
            if isinstance(result, torch.Tensor) and all_host(cpu_storages([arg[index] for arg in lists]), host)
        }
    if all_host(inputs, host):
        return {id(s) for s in cpu_storages(out)}
    return set()


def simulated_oom(nbytes: int, capacity: int, allocated: int, free: int) -> torch.OutOfMemoryError:
    """The error a simulated device raises, worded as CUDA's so that any OOM handler recognises it."""
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {format_bytes(nbytes)}. Simulated GPU 0 has a total capacity "
        f"of {format_bytes(capacity)} of which {format_bytes(max(0, free))} is free. Of the allocated "
        f"memory {format_bytes(allocated)} is allocated by tensors. (simulated by "
        f"oomguard.testing.SimulatedGPU; the wording follows CUDA's, so any OOM handler recognises it.)"
    )


def compiled_model_note(model: torch.nn.Module) -> str | None:
    """What to tell a user training a model compiled with ``torch.compile`` (or ``m.compile()``) under the
    simulation; None for a model that is not compiled."""
    if not any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        return None
    return (
        f"{type(model).__name__} is compiled (torch.compile), but under the simulated device it runs eagerly: the "
        f"simulation's dispatch mode makes torch.compile skip the frame, and the skip is cached, so the same model "
        f"code stays eager later in this process until torch._dynamo.reset(). Memory figures and OOMs here are "
        f"those of eager execution; test compiled training on a real GPU"
    )
